"""``tft-bridge-node.service`` installed verbatim on a real systemd with the default
launcher (``auto``: transient units) and the stand-in API server on the host: a job's
pods give a transient unit whose bridge systemd watches on the shipped ``WatchdogSec``,
that recovers a fault, that a restart or a SIGKILL of the node service leaves running
(the same main process, adopted before READY), and that stops when the pods go; and the
transient unit's sandbox is read back from systemd and held to ``tft-bridge@.service``'s.
"""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("kubernetes")

from bridge.node.launcher import Record, SystemdLauncher, unit_name  # noqa: E402
from bridge.sim.kube.apiserver import StandInApiServer  # noqa: E402
from bridge.core.listen_ports import free_port  # noqa: E402

from ..conftest import eventually_sync  # noqa: E402
from ..nodesim import LoggedProcess, SimJob, SimJobs  # noqa: E402
from .sdns import OPT_VENV, ROOT, Systemd  # noqa: E402

pytestmark = pytest.mark.timeout(400)

NODE_UNIT = "tft-bridge-node.service"
STATE_ROOT = "/var/lib/tft-bridge/node"  # the shipped unit's StateDirectory=, the default


@pytest.fixture
def server() -> Iterator[StandInApiServer]:
    with StandInApiServer() as srv:
        yield srv


@pytest.fixture
def job_and_clusterd(tmp_path: Path) -> Iterator[tuple[SimJob, str, LoggedProcess]]:
    job = SimJob("job-a", pods=2, devices_per_pod=4, ttp_port=free_port())
    port = free_port()
    process = LoggedProcess([sys.executable, "-m", "bridge.cli", "sim-clusterd", "--listen", f"127.0.0.1:{port}",
                             "--job", job.uid, "--world-size", "8", "--devices-per-pod", "4", "--keepalive", "0.5",
                             "--phase-delay", "0.1"], tmp_path / "clusterd.log")
    try:
        process.wait_for("simulated ClusterD")
        yield job, f"127.0.0.1:{port}", process
    finally:
        process.close()


def node_toml(server_url: str, clusterd: str, metrics_port: int) -> str:
    """The node file: the shipped defaults (launcher auto, state_root) but for the API
    server, the stub bridge that lets a test inject a fault, and quick restarts."""
    return f"""log_level = "INFO"
[node]
name = "node-1"
bridge_command = ["{OPT_VENV}/bin/python", "{ROOT / 'tests' / 'node_stub_bridge.py'}"]
restart_delay = 1.0
ranks_leave_wait = 20.0
tick = 0.2
[kubernetes]
server = "{server_url}"
kubeconfig = ""
request_timeout = 2.0
connect_timeout = 1.0
watch_timeout = 30
[metrics]
port = {metrics_port}
[bridge.clusterd]
address = "{clusterd}"
keepalive_interval = 0.5
startup_wait = 1.0
reconnect_max = 2.0
[bridge.controller]
module = "stub"
destroy_timeout = 10.0
"""


def start_node(systemd: Systemd, server: StandInApiServer, clusterd: str) -> int:
    metrics_port = free_port()
    systemd.write("/etc/tft-bridge/node.toml", node_toml(server.url, clusterd, metrics_port))
    systemd.run("systemctl", "start", NODE_UNIT, timeout=120)  # returns at READY=1
    return metrics_port


def samples(port: int, name: str, **labels: str) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return 0.0
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def job_state(systemd: Systemd, job: SimJob) -> dict[str, str]:
    return systemd.show(unit_name(job.uid), "ActiveState", "MainPID", "WatchdogTimestampMonotonic",
                        "WatchdogUSec", "LoadState")


def wait_job_active(systemd: Systemd, job: SimJob) -> dict[str, str]:
    return eventually_sync(lambda: (lambda s: s if s["ActiveState"] == "active" else None)(job_state(systemd, job)),
                           60, f"{unit_name(job.uid)} active", interval=0.3)


def usec(value: str) -> float:
    """``30s``, ``1min``, ``1min 30s`` -> seconds."""
    units = {"min": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "h": 3600.0}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(min|ms|us|s|h)", value))


def test_a_bridge_the_node_service_starts_lives_on_its_own_pings_and_recovers_a_fault(
        systemd: Systemd, server: StandInApiServer, job_and_clusterd: tuple) -> None:
    """On the shipped WatchdogSec (30 s): three periods, the bridge's pings seen."""
    job, clusterd, sim = job_and_clusterd
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})  # the node's kubelet registers its Node
    metrics_port = start_node(systemd, server, clusterd)
    cluster.create(job)
    first = wait_job_active(systemd, job)
    period = usec(first["WatchdogUSec"])
    assert period == 30, first  # the shipped value, no drop-in
    began = time.monotonic()
    eventually_sync(lambda: samples(metrics_port, "tft_bridge_controller_ranks_connected", job=job.uid) > 0, 60,
                    "the simulated ranks connected", interval=0.5)
    systemd.run("sh", "-c", f"echo 3 > {STATE_ROOT}/{job.uid}/inject-fault")
    eventually_sync(lambda: samples(metrics_port, "tft_bridge_recovery_cycles_total", job=job.uid,
                                    outcome="success") >= 1, 90, "the fault recovered", interval=0.5)
    pings: set[str] = set()

    def three_periods() -> bool:
        now = job_state(systemd, job)
        assert now["ActiveState"] == "active" and now["MainPID"] == first["MainPID"], now
        pings.add(now["WatchdogTimestampMonotonic"])
        return time.monotonic() - began > 3 * period

    eventually_sync(three_periods, 4 * period + 30, "three watchdog periods", interval=1.0)
    assert len(pings) >= 3, pings
    assert "Watchdog timeout" not in systemd.journal(unit_name(job.uid))


def test_a_restart_or_a_kill_of_the_node_service_leaves_the_bridge_and_adopts_it_before_ready(
        systemd: Systemd, server: StandInApiServer, job_and_clusterd: tuple) -> None:
    job, clusterd, sim = job_and_clusterd
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})  # the node's kubelet registers its Node
    start_node(systemd, server, clusterd)
    cluster.create(job)
    first = wait_job_active(systemd, job)
    active_since = time.monotonic()
    sim.wait_for("stream-open SubscribeProcessManageSignal", timeout=30)

    def adopted_before_ready(count: int) -> None:
        """The node journal's ``count``-th start: its adoption line precedes systemd's
        "Started" (READY=1) of that start."""
        lines = systemd.run("journalctl", "--no-pager", "-o", "cat", "-u", NODE_UNIT).stdout.splitlines()
        started = [i for i, line in enumerate(lines) if line.startswith("Started tft-bridge-node.service")]
        adopted = [i for i, line in enumerate(lines) if "adopted the running bridge of job " + job.uid in line]
        assert len(started) == count + 1 and len(adopted) == count, (started, adopted, lines[-40:])
        assert started[count - 1] < adopted[count - 1] < started[count], lines[-40:]

    node_pid = systemd.show(NODE_UNIT, "MainPID")["MainPID"]
    systemd.run("systemctl", "restart", NODE_UNIT, timeout=120)
    assert job_state(systemd, job)["MainPID"] == first["MainPID"]
    adopted_before_ready(1)

    systemd.run("systemctl", "kill", "-s", "KILL", NODE_UNIT)
    eventually_sync(lambda: systemd.show(NODE_UNIT, "ActiveState", "MainPID", "NRestarts") ==
                    {"ActiveState": "active", "MainPID": systemd.show(NODE_UNIT, "MainPID")["MainPID"],
                     "NRestarts": "1"}, 60, "the node service restarted after its SIGKILL", interval=0.3)
    assert systemd.show(NODE_UNIT, "MainPID")["MainPID"] not in ("0", node_pid)
    assert job_state(systemd, job)["MainPID"] == first["MainPID"]
    adopted_before_ready(2)
    # The same bridge, past a watchdog period of its own (its pings are what keep it).
    period = usec(first["WatchdogUSec"])

    def past_a_period() -> bool:
        now = job_state(systemd, job)
        assert now["ActiveState"] == "active" and now["MainPID"] == first["MainPID"], now
        return time.monotonic() - active_since > period + 5

    eventually_sync(past_a_period, 2 * period + 30, "a watchdog period with the same bridge", interval=1.0)

    # The pods go: the job's unit stops cleanly (SIGTERM, exit 0) and is unloaded.
    cluster.delete(job)
    eventually_sync(lambda: job_state(systemd, job)["LoadState"] == "not-found" or
                    job_state(systemd, job)["ActiveState"] == "inactive", 90, "the job's unit stopped", interval=0.5)
    exit_record = json.loads(systemd.read(f"{STATE_ROOT}/{job.uid}/exit.json") or "{}")
    assert exit_record.get("code") == 0, exit_record
    assert "Watchdog timeout" not in systemd.journal(unit_name(job.uid))


#: The sandbox and contract properties both units must share (systemctl show's names).
SANDBOX = ("Type", "NotifyAccess", "WatchdogUSec", "TimeoutStopUSec", "KillMode", "KillSignal", "DynamicUser",
           "UMask", "NoNewPrivileges", "CapabilityBoundingSet", "AmbientCapabilities", "ProtectSystem",
           "ProtectHome", "PrivateTmp", "PrivateMounts", "PrivateDevices", "PrivateUsers", "ProtectKernelTunables",
           "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups", "ProtectClock", "ProtectHostname",
           "ProtectProc", "RestrictAddressFamilies", "RestrictNamespaces", "RestrictRealtime", "RestrictSUIDSGID",
           "LockPersonality", "RemoveIPC", "SystemCallArchitectures", "SystemCallFilter", "SystemCallErrorNumber",
           "MemoryDenyWriteExecute", "LimitNOFILE", "LimitRTPRIO")


def test_the_transient_unit_is_as_sandboxed_as_the_per_job_unit(systemd: Systemd, tmp_path: Path) -> None:
    directory = "/var/lib/tft-bridge/node/sandbox-job"
    systemd.run("mkdir", "-p", directory)
    record = Record(job_id="sandbox-job", pod_uid="p", namespace="ns", pod_name="job-master-0", bind_ip="127.0.0.1",
                    port=free_port(), metrics_port=free_port(), launcher="systemd", unit=unit_name("sandbox-job"))
    # The launcher's own command line; the process only has to exist for systemd to show it.
    systemd.run(*SystemdLauncher().command(Path(directory), record, ["/bin/sleep", "600"]))
    transient = systemd.show(record.unit, *SANDBOX)
    shipped = systemd.show("tft-bridge@job1.service", *SANDBOX)
    # An instance that never ran shows WatchdogUSec=infinity: the file's own value instead.
    shipped["WatchdogUSec"] = re.findall(r"^WatchdogSec=(\S+)$", (ROOT / "systemd" / "tft-bridge@.service").read_text(),
                                         re.MULTILINE)[-1]
    weaker = {key: (shipped.get(key), transient.get(key)) for key in SANDBOX if transient.get(key) != shipped.get(key)}
    assert not weaker, "the transient unit differs from tft-bridge@.service (shipped, transient): " + json.dumps(weaker)
