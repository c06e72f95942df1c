"""The node service (``tft-bridge node``): its own footprint, what its one metrics endpoint
costs a scrape against a bridge's own endpoint, and how soon a bridge follows its pod.

    python bench/bench_node.py [--jobs 3] [--idle 10] [--scrapes 30] [--cycles 3]

One ``tft-bridge node`` process (session launcher, as in a container; the ``systemd``
launcher's units are not measured here) against the stand-in API server in this process,
each job with a simulated ClusterD of its own (``tft-bridge sim-clusterd`` on
127.0.0.<10+i>:8899, as ``MINDX_SERVER_IP`` points a job at port 8899) and the stub
controller. Phases, read from ``/proc/PID`` of the node service only (its bridges are
processes of their own, measured by ``bench/bench_footprint.py``):

1. ``0 jobs``: the service watching an empty node for ``--idle`` seconds: CPU (% of one
   core), context switches per second, RSS, threads, descriptors;
2. ``N jobs``: the same window with ``--jobs`` bridges running;
3. scrapes: ``--scrapes`` GETs of the node endpoint (every bridge's series relayed)
   against the same number of GETs of one bridge's own endpoint, the baseline: p50 and
   p99 of each and their ratio;
4. latency: for ``--cycles`` jobs one after the other, from the pod's creation (bound and
   its status written by the stand-in's kubelet) to its bridge's record with a live pid,
   and from the pod's deletion to the bridge's exit (no rank is connected, so the stop
   does not wait).

Nothing is gated: the figures size a node (docs/operations.md, "Footprint") and say what
the relay adds to a scrape.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bridge.node.launcher import records
from bridge.node.procs import alive
from bridge.sim.kube.apiserver import StandInApiServer
from bridge.sim.kube.ascendjob import SimJob, SimJobs
from bridge.sim.scenario import free_port

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
from bench_footprint import sample  # noqa: E402  # the same /proc reading as the bridge's footprint

NODE = "node-1"


def wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.01)  # polling another process's state; the bench's own resolution


def node_toml(state_root: Path, server_url: str) -> str:
    return f"""
[node]
name = "{NODE}"
state_root = "{state_root}"
launcher = "session"
restart_delay = 0.5
ranks_leave_wait = 5.0
[kubernetes]
server = "{server_url}"
[metrics]
port = 0
[bridge]
log_level = "WARNING"
[bridge.clusterd]
keepalive_interval = 5.0
[bridge.controller]
module = "stub"
"""


def window(pid: int, seconds: float) -> dict[str, float]:
    before, started = sample(pid), time.monotonic()
    time.sleep(seconds)  # the measured window itself
    after, took = sample(pid), time.monotonic() - started
    return {"cpu_percent": 100 * (after.cpu - before.cpu) / took,
            "switches_per_s": (after.switches - before.switches) / took,
            "rss_mib": after.rss / 1024, "threads": after.threads, "fds": after.fds}


def timed_gets(url: str, count: int) -> list[float]:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as response:
            response.read()
        times.append((time.perf_counter() - started) * 1000)
    return times


def quantiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def running(state_root: Path) -> dict[str, dict[str, Any]]:
    return {r.job_id: vars(r) for _, r in records(state_root) if r.pid and alive(r.pid, r.start)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--scrapes", type=int, default=30)
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-node-"))
    state_root = work / "state"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    clusterds: list[subprocess.Popen[bytes]] = []
    node: subprocess.Popen[bytes] | None = None
    jobs = [SimJob(f"job-{i}", pods=1, devices_per_pod=8, ttp_port=free_port(), clusterd_ip=f"127.0.0.{10 + i}")
            for i in range(max(args.jobs, args.cycles))]
    results: dict[str, Any] = {"jobs": args.jobs}
    with StandInApiServer() as server:
        cluster = SimJobs(server.store, {NODE: "127.0.0.1"})
        try:
            for job in jobs:
                log = open(work / f"clusterd-{job.name}.log", "wb")
                clusterds.append(subprocess.Popen(
                    [sys.executable, "-m", "bridge.cli", "sim-clusterd", "--listen", f"{job.clusterd_ip}:8899",
                     "--job", job.uid, "--world-size", "8", "--devices-per-pod", "8", "--log-level", "WARNING"],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            config = work / "node.toml"
            config.write_text(node_toml(state_root, server.url))
            node_log = work / "node.log"
            with node_log.open("wb") as out:
                node = subprocess.Popen([sys.executable, "-m", "bridge.cli", "node", "--config", str(config)],
                                        cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
            found = wait(lambda: re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", node_log.read_text()), 60,
                         "the node endpoint")
            endpoint = f"http://127.0.0.1:{found.group(1)}/metrics"
            time.sleep(2.0)  # let the start settle before the first window
            results["idle_0_jobs"] = window(node.pid, args.idle)

            # latency: one job at a time, created then deleted
            starts, stops = [], []
            for job in jobs[:args.cycles]:
                created = time.monotonic()
                cluster.create(job)
                wait(lambda: job.uid in running(state_root), 60, f"the bridge of {job.name}")
                starts.append((time.monotonic() - created) * 1000)
                record = running(state_root)[job.uid]
                deleted = time.monotonic()
                cluster.delete(job)
                wait(lambda: not alive(record["pid"], record["start"]), 60, f"the bridge of {job.name} stopped")
                stops.append((time.monotonic() - deleted) * 1000)
            results["start_ms"], results["stop_ms"] = starts, stops
            wait(lambda: not running(state_root), 60, "every bridge stopped")

            for job in jobs[:args.jobs]:
                cluster.create(job)
            wait(lambda: len(running(state_root)) == args.jobs, 120, "every bridge running")
            one = running(state_root)[jobs[0].uid]["metrics_port"]
            wait(lambda: all(f'tft_job="{job.uid}"' in urllib.request.urlopen(endpoint, timeout=10).read().decode()
                             for job in jobs[:args.jobs]), 60, "every bridge relayed")
            time.sleep(2.0)
            results[f"idle_{args.jobs}_jobs"] = window(node.pid, args.idle)
            bridge_times = timed_gets(f"http://127.0.0.1:{one}/metrics", args.scrapes)
            node_times = timed_gets(endpoint, args.scrapes)
            results["scrape_bridge_ms"], results["scrape_node_ms"] = quantiles(bridge_times), quantiles(node_times)
            for job in jobs[:args.jobs]:
                cluster.delete(job)
            wait(lambda: not running(state_root), 60, "every bridge stopped")
        finally:
            if node is not None:
                node.terminate()
                node.wait(timeout=30)
            for job_id, data in running(state_root).items():
                os.kill(data["pid"], 15)
            for process in clusterds:
                process.terminate()
                process.wait(timeout=30)
    print_results(results, args)
    return 0


def print_results(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"tft-bridge node, session launcher, stand-in API server, {os.cpu_count()} cores, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for phase in ("idle_0_jobs", f"idle_{args.jobs}_jobs"):
        r = results[phase]
        print(f"  {phase:12s} CPU {r['cpu_percent']:5.2f} %  switches {r['switches_per_s']:6.1f}/s  RSS "
              f"{r['rss_mib']:5.1f} MiB  threads {r['threads']:3d}  descriptors {r['fds']:4d}")
    (b50, b99), (n50, n99) = results["scrape_bridge_ms"], results["scrape_node_ms"]
    print(f"  scrape, one bridge's own endpoint (baseline)  p50 {b50:6.2f} ms  p99 {b99:6.2f} ms  (n={args.scrapes})")
    print(f"  scrape, node endpoint, {args.jobs} bridges relayed   p50 {n50:6.2f} ms  p99 {n99:6.2f} ms  "
          f"(n={args.scrapes})")
    print(f"  node / bridge (p50) {n50 / b50:.2f}")
    print(f"  pod created -> bridge running  {' '.join(f'{v:.0f}' for v in results['start_ms'])} ms")
    print(f"  pod deleted -> bridge ended    {' '.join(f'{v:.0f}' for v in results['stop_ms'])} ms")
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
