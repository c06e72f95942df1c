"""The node service's own footprint, idle, under its shipped unit on a real systemd:
resident memory, CPU per minute, threads and descriptors, with the Kubernetes client
loaded and its pod watch open.

    python bench/bench_node_footprint.py [--window 60] [--settle 10]

Needs what ``tests/systemd`` needs (root, ``../shared/systemd``, a built tree).
``tft-bridge-node.service`` is installed verbatim and pointed at the stand-in API
server on the host, with no job: after ``--settle`` seconds, ``/proc/PID`` of its main
process is read at the start and end of a ``--window`` seconds window. The anchor, read
the same way in the same run: a bare ``python3.11 -c`` of the same venv that imports the
same modules (the Kubernetes client, grpc, prometheus_client) and sleeps, i.e. what the
interpreter and its libraries cost before the service does anything. Exits 1 when idle
CPU exceeds 0.1 s per minute or RSS 80 MB.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bridge.sim.kube.apiserver import StandInApiServer  # noqa: E402
from bridge.sim.kube.ascendjob import SimJobs  # noqa: E402
from bridge.core.listen_ports import free_port  # noqa: E402
from tests.systemd.sdns import OPT_VENV, Systemd, ensure_venv, missing  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
ANCHOR = "import kubernetes, grpc, prometheus_client, bridge.node.service, time; time.sleep(100000)"


def sample(systemd: Systemd, pid: str) -> dict[str, float]:
    stat = systemd.read(f"/proc/{pid}/stat")
    fields = stat[stat.rindex(")") + 2:].split()
    status = dict(line.split(":", 1) for line in systemd.read(f"/proc/{pid}/status").splitlines() if ":" in line)
    descriptors = systemd.run("sh", "-c", f"ls /proc/{pid}/fd | wc -l").stdout.strip()
    return {"cpu": (int(fields[11]) + int(fields[12])) / TICKS, "rss": int(status["VmRSS"].split()[0]) / 1024,
            "threads": int(status["Threads"]), "fds": int(descriptors), "at": time.monotonic()}


def measure(systemd: Systemd, pid: str, settle: float, window: float) -> dict[str, float]:
    time.sleep(settle)  # the benchmark's settle window, not a wait for a condition
    first = sample(systemd, pid)
    time.sleep(window)  # the measured window
    last = sample(systemd, pid)
    minutes = (last["at"] - first["at"]) / 60
    return {"cpu_per_min": (last["cpu"] - first["cpu"]) / minutes, "rss": last["rss"], "threads": last["threads"],
            "fds": last["fds"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=10.0)
    args = parser.parse_args()
    why = missing()
    if why:
        print(f"bench_node_footprint: cannot run: {why}")
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench-node-"))
    systemd = Systemd(work / "systemd-ns")
    load_before = os.getloadavg()
    with StandInApiServer() as server:
        SimJobs(server.store, {"node-1": "127.0.0.1"})  # the node's kubelet registers its Node
        try:
            systemd.boot(ensure_venv())
            systemd.write("/etc/tft-bridge/node.toml", f'[node]\nname = "node-1"\n[kubernetes]\nserver = "{server.url}"\n'
                                                       f'kubeconfig = ""\n[metrics]\nport = {free_port()}\n')
            systemd.run("systemctl", "start", "tft-bridge-node.service", timeout=120)
            node = systemd.show("tft-bridge-node.service", "MainPID")["MainPID"]
            systemd.run("systemd-run", "--unit=anchor", f"{OPT_VENV}/bin/python", "-c", ANCHOR)
            anchor = systemd.show("anchor.service", "MainPID")["MainPID"]
            service = measure(systemd, node, args.settle, args.window)
            bare = measure(systemd, anchor, 0, args.window)
        finally:
            systemd.stop(work / "journal.txt")
    load_after = os.getloadavg()
    print("| process | CPU s/min idle | RSS MiB | threads | descriptors |")
    print("|---|---:|---:|---:|---:|")
    for name, row in (("tft-bridge node (pod watch open, no job)", service),
                      ("anchor: the same imports, asleep", bare)):
        print(f"| {name} | {row['cpu_per_min']:.3f} | {row['rss']:.1f} | {row['threads']:.0f} | {row['fds']:.0f} |")
    print(f"service - anchor: RSS {service['rss'] - bare['rss']:+.1f} MiB, threads "
          f"{service['threads'] - bare['threads']:+.0f}; load average before {load_before[0]:.1f}, "
          f"after {load_after[0]:.1f}")
    return 0 if service["cpu_per_min"] <= 0.1 and service["rss"] <= 80 else 1


if __name__ == "__main__":
    sys.exit(main())
