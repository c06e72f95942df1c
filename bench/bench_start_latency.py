"""Start latency of a job's bridge under the node service on a real systemd: from pod 0
Running with its host IP to the controller listening on ``TTP_PORT``.

    python bench/bench_start_latency.py [--jobs 20] [--target-p95 2.0]

Needs root, ``../shared/systemd`` (the systemd tier's ``systemd-ns.sh``) and a built tree,
as ``tests/systemd`` does. One systemd 252 is booted as PID 1 of a namespace of its own,
``tft-bridge-node.service`` installed verbatim with the default launcher (transient
units), the stand-in API server and one simulated ClusterD on the host. Each job's
pods (the same job id each time: a new incarnation) are created and bound as the API
server sees them (no status), then their kubelet writes ``phase: Running`` and ``hostIP``; the clock runs from
that write to the first TCP connect that the controller's port accepts (polled every
5 ms). The job's pods are then deleted and its unit awaited gone before the next.

The anchor, in the same run and interleaved job by job: the same bridge (``tft-bridge run``
with the same kind of file, stub controller, the same simulated ClusterD) started
directly as a child process, from its fork to the controller listening: what a start
costs without the pod watch, the node service and systemd. Prints p50/p95 of both and
their ratio; exits 1 when the p95 misses ``--target-p95`` seconds.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bridge.node.launcher import unit_name  # noqa: E402
from bridge.sim.kube.apiserver import StandInApiServer  # noqa: E402
from bridge.sim.kube.ascendjob import SimJob, SimJobs  # noqa: E402
from bridge.core.listen_ports import free_port  # noqa: E402
from tests.systemd.sdns import Systemd, ensure_venv, missing  # noqa: E402

NODE = "node-1"


def listening(port: int, deadline: float) -> float:
    """Monotonic time of the first accepted connect to 127.0.0.1:``port``."""
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            probe.settimeout(0.5)
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return time.monotonic()
        time.sleep(0.005)
    raise TimeoutError(f"nothing listened on {port}")


def wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def clusterd(job: SimJob, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    output = open(log, "wb")
    process = subprocess.Popen([sys.executable, "-m", "bridge.cli", "sim-clusterd", "--listen", f"127.0.0.1:{port}",
                                "--job", job.uid, "--world-size", "8", "--devices-per-pod", "4", "--keepalive",
                                "0.5"], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT)
    wait(lambda: b"simulated ClusterD" in log.read_bytes(), 30, "the simulated ClusterD")
    return process, f"127.0.0.1:{port}"


def direct_start(job: SimJob, address: str, work: Path) -> float:
    """The anchor: ``tft-bridge run`` as a child, fork -> listening (seconds)."""
    port = free_port()
    config = work / f"direct-{job.uid}.toml"
    config.write_text(f'job_id = "{job.uid}"\n[clusterd]\naddress = "{address}"\nkeepalive_interval = 0.5\n'
                      f'startup_wait = 1.0\n[controller]\nmodule = "stub"\nbind_ip = "127.0.0.1"\nport = {port}\n'
                      f'world_size = 8\ndestroy_timeout = 10.0\nstate_directory = "{work}"\n'
                      f'[recorder]\ndirectory = "{work}"\n[metrics]\nport = {free_port()}\n')
    with open(work / "direct.log", "ab") as output:
        began = time.monotonic()
        process = subprocess.Popen([sys.executable, "-m", "bridge.cli", "run", "--config", str(config)], cwd=ROOT,
                                   stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT)
        try:
            return listening(port, began + 60) - began
        finally:
            process.terminate()
            process.wait(timeout=90)


def node_start(systemd: Systemd, cluster: SimJobs, job: SimJob) -> float:
    """Pods created and bound, without status; then their kubelet's status write (Running,
    hostIP): that write -> listening."""
    cluster.create(job, run=False)
    began = time.monotonic()
    for index in range(job.pods):
        cluster.run(job, index)
    took = listening(job.ttp_port, began + 60) - began
    cluster.delete(job)
    unit = unit_name(job.uid)
    wait(lambda: systemd.show(unit, "ActiveState")["ActiveState"] in ("inactive", "failed"), 120, f"{unit} gone")
    return took


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--target-p95", type=float, default=2.0)
    args = parser.parse_args()
    why = missing()
    if why:
        print(f"bench_start_latency: cannot run: {why}")
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-start-"))
    systemd = Systemd(work / "systemd-ns")
    load_before = os.getloadavg()
    node_times: list[float] = []
    direct_times: list[float] = []
    uid = "0b7e5c9a-start-latency"
    process, address = clusterd(SimJob("lat", uid=uid), work / "clusterd.log")
    with StandInApiServer() as server:
        cluster = SimJobs(server.store, {NODE: "127.0.0.1"})  # the node's kubelet registers its Node
        try:
            systemd.boot(ensure_venv())
            systemd.write("/etc/tft-bridge/node.toml", f"""log_level = "INFO"
[node]
name = "{NODE}"
[kubernetes]
server = "{server.url}"
kubeconfig = ""
[metrics]
port = {free_port()}
[bridge.clusterd]
address = "{address}"
keepalive_interval = 0.5
startup_wait = 1.0
[bridge.controller]
module = "stub"
destroy_timeout = 10.0
""")
            systemd.run("systemctl", "start", "tft-bridge-node.service", timeout=120)
            for number in range(args.jobs):
                # The same job id each time (ClusterD knows one job): each set of pods is a
                # new incarnation, started once the previous bridge is gone.
                job = SimJob("lat", uid=uid, pods=2, devices_per_pod=4, ttp_port=free_port(), version=number)
                direct_times.append(direct_start(job, address, work))
                node_times.append(node_start(systemd, cluster, job))
                print(f"job {number:2d}: node service + systemd {node_times[-1]:.3f} s, "
                      f"direct {direct_times[-1]:.3f} s", flush=True)
        finally:
            systemd.stop(work / "journal.txt")
            process.terminate()
            process.wait(timeout=30)
    load_after = os.getloadavg()
    p50, p95 = percentile(node_times, 0.5), percentile(node_times, 0.95)
    d50, d95 = percentile(direct_times, 0.5), percentile(direct_times, 0.95)
    print()
    print(f"| path | jobs | p50 s | p95 s | max s |")
    print(f"|---|---:|---:|---:|---:|")
    print(f"| pod 0 Running -> controller listening (node service, transient unit) | {len(node_times)} | {p50:.2f} | "
          f"{p95:.2f} | {max(node_times):.2f} |")
    print(f"| anchor: fork -> controller listening (tft-bridge run directly) | {len(direct_times)} | {d50:.2f} | "
          f"{d95:.2f} | {max(direct_times):.2f} |")
    print(f"ratio node/direct: p50 {p50 / d50:.2f}, p95 {p95 / d95:.2f}; mean {statistics.mean(node_times):.2f} s")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f}; journal in {work / 'journal.txt'}")
    if p95 > args.target_p95:
        print(f"p95 {p95:.2f} s misses the target {args.target_p95:.2f} s")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
