"""``tft-bridge-node.service`` on a real systemd when something is wrong: a state root the
units' sandbox hides (refused at start, naming the setting), a node service that hangs
(killed by its own watchdog and restarted, two jobs' bridges untouched and adopted), a
bridge that hangs (killed by its unit's watchdog, its exit recorded, a fresh one started),
a bridge unit that keeps failing (given up at the start limit, with an Event on the pod).

The node service's watchdog is shortened to 5 s by a drop-in in the hang test (the
shipped 60 s would only make it longer), and the transient units' to 5 s by a prefix
drop-in (``tft-bridge-job-.service.d``) in the hung bridge's; the failing bridge is made by a drop-in for
every transient unit (``tft-bridge-job-.service.d``: an ``ExecStartPre=`` that fails).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("kubernetes")

from bridge.node.launcher import unit_name  # noqa: E402
from bridge.sim.kube.apiserver import StandInApiServer  # noqa: E402
from bridge.core.listen_ports import free_port  # noqa: E402

from ..conftest import eventually_sync  # noqa: E402
from ..nodesim import SimJob, SimJobs, events  # noqa: E402
from .sdns import Systemd  # noqa: E402
from .test_node_unit import NODE_UNIT, job_and_clusterd, job_state, node_toml, server, wait_job_active  # noqa: E402,F401

pytestmark = pytest.mark.timeout(300)


def test_a_state_root_the_sandbox_hides_is_refused_naming_the_setting(systemd: Systemd,
                                                                      server: StandInApiServer) -> None:
    text = node_toml(server.url, "127.0.0.1:1", free_port()).replace('name = "node-1"',
                                                                      'name = "node-1"\nstate_root = "/tmp/state"')
    systemd.write("/etc/tft-bridge/node.toml", text)
    assert systemd.run("systemctl", "start", NODE_UNIT, check=False, timeout=120).returncode != 0
    shown = systemd.show(NODE_UNIT, "ExecMainStatus", "NRestarts", "ActiveState")
    assert shown["ExecMainStatus"] == "2" and shown["NRestarts"] == "0", shown  # RestartPreventExitStatus=2
    assert "node.state_root /tmp/state is hidden from the units by PrivateTmp=yes (it hides /tmp)" in \
        systemd.journal(NODE_UNIT)


def test_a_hung_node_service_is_restarted_by_its_watchdog_and_two_bridges_stay(
        systemd: Systemd, server: StandInApiServer, job_and_clusterd: tuple) -> None:
    job_a, clusterd, _ = job_and_clusterd
    job_b = SimJob("job-b", pods=2, devices_per_pod=4, ttp_port=free_port())
    systemd.drop_in(NODE_UNIT, "watchdog", "[Service]\nWatchdogSec=5s\n")
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})  # the node's kubelet registers its Node
    systemd.write("/etc/tft-bridge/node.toml", node_toml(server.url, clusterd, free_port()))
    systemd.run("systemctl", "start", NODE_UNIT, timeout=120)
    cluster.create(job_a)
    cluster.create(job_b)
    a, b = wait_job_active(systemd, job_a), wait_job_active(systemd, job_b)
    assert a["MainPID"] != b["MainPID"]
    # Healthy: three of its own watchdog periods without a restart.
    began = time.monotonic()
    eventually_sync(lambda: systemd.show(NODE_UNIT, "NRestarts")["NRestarts"] == "0" and
                    time.monotonic() - began > 15, 40, "three node watchdog periods", interval=0.5)
    hung = systemd.show(NODE_UNIT, "MainPID")["MainPID"]
    systemd.run("systemctl", "kill", "--kill-who=main", "-s", "SIGSTOP", NODE_UNIT)
    eventually_sync(lambda: (lambda s: s["NRestarts"] == "1" and s["ActiveState"] == "active" and
                             s["MainPID"] not in ("0", hung))(systemd.show(NODE_UNIT, "NRestarts", "ActiveState",
                                                                             "MainPID")),
                    60, "the node service killed by its watchdog and restarted", interval=0.3)
    assert "tft-bridge-node.service: Watchdog timeout (limit 5s)!" in systemd.journal(NODE_UNIT)
    assert job_state(systemd, job_a)["MainPID"] == a["MainPID"]
    assert job_state(systemd, job_b)["MainPID"] == b["MainPID"]
    node_log = systemd.run("journalctl", "--no-pager", "-o", "cat", "-u", NODE_UNIT).stdout
    assert f"adopted the running bridge of job {job_a.uid}" in node_log
    assert f"adopted the running bridge of job {job_b.uid}" in node_log


def test_a_bridge_unit_that_keeps_failing_is_given_up_with_an_event(
        systemd: Systemd, server: StandInApiServer, job_and_clusterd: tuple) -> None:
    job, clusterd, _ = job_and_clusterd
    systemd.write("/etc/systemd/system/tft-bridge-job-.service.d/fail.conf", "[Service]\nExecStartPre=/bin/false\n")
    text = node_toml(server.url, clusterd, free_port()).replace("restart_delay = 1.0",
                                                                "restart_delay = 0.5\nstart_limit_burst = 3")
    systemd.write("/etc/tft-bridge/node.toml", text)
    systemd.run("systemctl", "daemon-reload")
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})  # the node's kubelet registers its Node
    systemd.run("systemctl", "start", NODE_UNIT, timeout=120)
    pod = cluster.create(job)[0]
    refused = eventually_sync(lambda: [e for e in events(server, pod, "TftBridgeRefused")
                                       if "bridge_failing" in e["message"]], 90, "the refusal Event", interval=0.5)
    assert refused
    starts = systemd.run("journalctl", "--no-pager", "-o", "cat", "-u", NODE_UNIT).stdout.count(
        f"job {job.uid} (default/job-a-master-0): bridge started")
    assert starts == 3, starts  # the start limit, then no more
    assert systemd.show(unit_name(job.uid), "ActiveState")["ActiveState"] != "active"


def test_a_hung_bridge_under_the_node_service_is_killed_by_its_watchdog_and_started_again(
        systemd: Systemd, server: StandInApiServer, job_and_clusterd: tuple) -> None:
    """The transient unit's watchdog protects: a SIGSTOPped bridge is killed within
    WatchdogSec (shortened to 5 s for every transient unit by a prefix drop-in), its exit
    recorded as the watchdog's, and the service starts a fresh one (a failure restart)."""
    job, clusterd, _ = job_and_clusterd
    systemd.write("/etc/systemd/system/tft-bridge-job-.service.d/watchdog.conf", "[Service]\nWatchdogSec=5s\n")
    systemd.run("systemctl", "daemon-reload")
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})  # the node's kubelet registers its Node
    systemd.write("/etc/tft-bridge/node.toml", node_toml(server.url, clusterd, free_port()))
    systemd.run("systemctl", "start", NODE_UNIT, timeout=120)
    cluster.create(job)
    first = wait_job_active(systemd, job)
    assert first["WatchdogUSec"] == "5s", first
    systemd.run("systemctl", "kill", "--kill-who=main", "-s", "SIGSTOP", unit_name(job.uid))
    stopped = time.monotonic()
    eventually_sync(lambda: systemd.run("test", "-e", f"/proc/{first['MainPID']}", check=False).returncode != 0,
                    5 + 10, "the hung bridge killed", interval=0.2)
    killed_after = time.monotonic() - stopped
    assert killed_after < 5 + 5, killed_after  # WatchdogSec, and the poll's own slack
    assert f"{unit_name(job.uid)}: Watchdog timeout (limit 5s)!" in systemd.journal(unit_name(job.uid))
    second = eventually_sync(lambda: (lambda s: s if s["ActiveState"] == "active" and
                                      s["MainPID"] not in ("0", first["MainPID"]) else None)(job_state(systemd, job)),
                             60, "a fresh bridge", interval=0.3)
    assert second["MainPID"] != first["MainPID"]
    node_log = systemd.run("journalctl", "--no-pager", "-o", "cat", "-u", NODE_UNIT).stdout
    assert f"job {job.uid}: its bridge ended on its own with exit 134" in node_log, node_log[-2000:]
    # Only the service itself notifies on its socket (systemctl and systemd-run get none of it).
    assert "Got notification message from PID" not in node_log, node_log[-2000:]
