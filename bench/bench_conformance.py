"""Real hop times: the report hops and the critical path against the real ClusterD service
code and a real MindIO TFT controller, the bridge beside a synchronous client in the same run.

    python bench/bench_conformance.py [--quick] [--cycles N] [--kind uce|hccl]

Each cycle is one job on the real peers (tests/conformance/peers.py: ClusterD's
unmodified Recover service in the harness, a real MindIO TFT build, four fake ranks on
the real processor library): a UCE (or HCCL) fault on rank 2, a retry. The two ways take
turns, cycle by cycle, so a machine's drift falls on both:

* ``bridge``: ``tft-bridge run`` hosting the controller (its default settings);
* ``sync``: MindCluster's client shape (``baseline.SyncClient``: each callback makes its
  blocking Report* call before it returns) hosting the same controller
  (bench/sync_launcher.py).

Times come from the two peers' own logs, both stamped in microseconds from the machine's
wall clock (the controller's without leading zeros, read as such): the controller logs each callback just before it calls it
(``ttp_mindx_api.py`` ``do action report_...``), ClusterD each report as its handler
starts (``receive ReportProcessFault`` ...). Hops: callback -> ClusterD received, for
the first fault report, the stop-complete, the second fault report, the strategies and
the result; the critical path: the second ``report_fault_ranks`` callback -> ClusterD
received the ``ReportRecoverStrategy`` (between them the synchronous client waits for
ClusterD's answer to the fault report; the bridge's lane sends both in order). The
strategies hop is therefore not like for like: the synchronous client's callback comes
after ClusterD answered the second fault report, the bridge's before it (its lane holds
the strategies until that answer, docs/clusterd.md); the critical path is. Each
figure: the median over the cycles (min-max), and the ratio bridge / sync of the medians.
Both logs are written by the peers themselves (their logging's cost is in every figure,
on both ways alike). Exit status 2 when the real peers are not here (said in one line).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from baseline import pct  # noqa: E402

from bench_footprint import sample, switches_by_name  # noqa: E402

from tests.conformance import peers as real_peers  # noqa: E402
from tests.conformance.peers import Entry, HarnessOptions, LogLine, find_real_peers, unavailable  # noqa: E402
from tests.conformance.realjob import RealJob  # noqa: E402

#: The report each callback makes, and the hops measured (label, callback, its n-th call).
RPC_OF = {"report_fault_ranks": "ReportProcessFault", "report_stop_complete": "ReportStopComplete",
          "report_strategies": "ReportRecoverStrategy", "report_result": "ReportRecoverStatus"}
HOPS = (("fault report #1", "report_fault_ranks", 0), ("stop-complete", "report_stop_complete", 0),
        ("fault report #2", "report_fault_ranks", 1), ("strategies", "report_strategies", 0),
        ("result", "report_result", 0))
CRITICAL = "critical path: 2nd fault callback -> strategy received"
WAYS = ("bridge", "sync")
ENTRY_OF = {"bridge": "daemon", "sync": "sync"}  # tests/conformance/peers.py ENTRIES
#: The real controller's log line for a callback (TTP_LOG_STDOUT=1), and ClusterD's for a report.
#: The controller writes the microseconds of its stamps without leading zeros
#: (``15:53:00.893`` is 893 us past the second, ``.15765`` 15 765 us); ClusterD pads them
#: to six digits. Both are read as a count of microseconds.
_CALLBACK = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{1,6}) .*\[PYH ttp_mindx_api\.py:\d+\] do action (report_\w+),")
_RECEIVED = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{6})\]\[\w+\].*\breceive (Report\w+)")


class SyncEntry(Entry):
    """The synchronous client hosting the real controller (bench/sync_launcher.py)."""

    name = "sync"

    def argv(self) -> list[str]:
        return [sys.executable, str(Path(__file__).parent / "sync_launcher.py"), "--clusterd", self.clusterd.address,
                "--job", self.clusterd.options.job_uid, "--world-size", str(self.clusterd.options.world_size),
                "--port", str(self.ttp_port)]

    def bridge_events(self) -> list[dict[str, Any]]:
        return []


real_peers.ENTRIES.setdefault("sync", SyncEntry)  # RealJob builds its entry from this table


def _stamp(seconds: str, micros: str) -> float:
    return datetime.strptime(seconds, "%Y-%m-%d %H:%M:%S").timestamp() + int(micros) * 1e-6


def stamped(lines: Sequence[LogLine], pattern: re.Pattern[str]) -> list[tuple[str, float]]:
    """(name, wall time) of every line matching ``pattern`` (groups: the time to the
    second, its microseconds, the name)."""
    return [(m.group(3), _stamp(m.group(1), m.group(2))) for line in lines if (m := pattern.search(line.text))]


def nth(stamps: list[tuple[str, float]], name: str, index: int) -> float | None:
    times = [t for n, t in stamps if n == name]
    return times[index] if index < len(times) else None


def hops_of(callbacks: list[tuple[str, float]], received: list[tuple[str, float]]) -> dict[str, float]:
    """One cycle's hops in seconds: the n-th callback of a kind to the n-th report of its
    RPC at ClusterD (one cycle per job: no report is dropped or resent in between)."""
    figures: dict[str, float] = {}
    for label, callback, index in HOPS:
        start = nth(callbacks, callback, index)
        arrived = nth(received, RPC_OF[callback], index)
        if start is not None and arrived is not None:
            figures[label] = arrived - start
    start, arrived = nth(callbacks, "report_fault_ranks", 1), nth(received, "ReportRecoverStrategy", 0)
    if start is not None and arrived is not None:
        figures[CRITICAL] = arrived - start
    return figures


def one_cycle(peers: Path, way: str, index: int, kind: str, workdir: Path) -> dict[str, float]:
    """One job, one retry cycle, on ``way``; its hops, read once ClusterD has the result."""
    folder = workdir / f"{way}-{index}"
    folder.mkdir()
    options = HarnessOptions(job_uid=f"bench-{way}-{index}", keepalive=1)
    with RealJob(peers, folder, ENTRY_OF[way], options, wait_mindx_time=20, node_agent=False) as job:
        job.start(fault_rank=2, fault_step=6, fault_kind=kind)
        job.clusterd.wait_log(r"receive ReportRecoverStatus", 0, 90, "ClusterD receiving the result")
        job.entry.log.wait_for(r"do action report_result,", 0, 10, "the controller's log of its result callback")
        callbacks, received = stamped(job.entry.log.lines(), _CALLBACK), stamped(job.clusterd.log.lines(), _RECEIVED)
    figures = hops_of(callbacks, received)
    missing = [label for label in (*(label for label, _, _ in HOPS), CRITICAL) if label not in figures]
    if missing:  # said, not hidden: the medians below then have fewer samples on this way
        print(f"bench_conformance: cycle {index} ({way}) has no {', '.join(missing)}: callbacks "
              f"{[n for n, _ in callbacks]}, ClusterD received {[n for n, _ in received]}", file=sys.stderr)
    return figures


#: ClusterD's own keep-alive interval on the signal stream (seconds), for the idle phase:
#: the hop phase's 1 s would wake both ways five times as often as a real ClusterD does.
IDLE_KEEPALIVE = 5
IDLE_SETTLE = 5.0  # seconds after every rank registered, before a window
#: The idle window's per-thread-name context switches are keyed by this prefix + name.
BY_THREAD = "switches of "


def idle_window(peers: Path, way: str, index: int, seconds: float, workdir: Path) -> dict[str, float]:
    """One job training without a fault on ``way``: what the process hosting the
    controller costs the node in a window of ``seconds`` (its CPU time, the context
    switches of all its threads, its threads and resident memory at the end)."""
    folder = workdir / f"idle-{way}-{index}"
    folder.mkdir()
    options = HarnessOptions(job_uid=f"idle-{way}-{index}", keepalive=IDLE_KEEPALIVE)
    with RealJob(peers, folder, ENTRY_OF[way], options, node_agent=False) as job:
        job.start()
        process = job.entry.process
        assert process is not None
        time.sleep(IDLE_SETTLE)  # the window is the thing measured: a fixed length, not a wait
        before, named = sample(process.pid), switches_by_name(process.pid)
        time.sleep(seconds)
        after = sample(process.pid)
        named = switches_by_name(process.pid) - named
    by_thread: dict[str, float] = {}
    for name, count in named.items():  # the controller's AccWrk:0..N as one
        key = f"{BY_THREAD}{name.split(':')[0]}"
        by_thread[key] = by_thread.get(key, 0.0) + count
    return {"cpu seconds": after.cpu - before.cpu, "context switches": float(after.switches - before.switches),
            "threads": float(after.threads), "rss MiB": after.rss / 1024, **by_thread}


def idle_phase(peers: Path, windows: int, seconds: float, workdir: Path) -> None:
    """Both ways idle with 4 ranks training, windows alternated; sums over the windows."""
    totals: dict[str, dict[str, list[float]]] = {way: {} for way in WAYS}
    for index in range(windows):
        for way in (WAYS if index % 2 == 0 else WAYS[::-1]):
            for label, value in idle_window(peers, way, index, seconds, workdir).items():
                totals[way].setdefault(label, []).append(value)
    print(f"idle, 4 ranks training, no fault: {windows} window(s) of {seconds:.0f} s per way, alternated "
          f"(ClusterD keep-alive every {IDLE_KEEPALIVE} s); the process hosting the controller")
    for label in ("cpu seconds", "context switches"):
        bridge, sync = sum(totals["bridge"][label]), sum(totals["sync"][label])
        print(f"  {label:17} bridge {bridge:10.2f}   sync {sync:10.2f}   bridge / sync {bridge / sync if sync else 0:.2f}")
    for label in ("threads", "rss MiB"):
        print(f"  {label:17} bridge {max(totals['bridge'][label]):10.1f}   sync {max(totals['sync'][label]):10.1f}")
    # Which threads wake the node (thread names: gRPC's event_engine, Python's python,
    # the controller's AccWrk), per second of the windows: where a ratio comes from.
    names = sorted({label for way in WAYS for label in totals[way] if label.startswith(BY_THREAD)})
    span = windows * seconds
    print("  context switches per second, by thread name")
    for label in sorted(names, key=lambda n: -sum(totals["bridge"].get(n, [])) - sum(totals["sync"].get(n, []))):
        bridge, sync = (sum(totals[way].get(label, [])) / span for way in WAYS)
        print(f"    {label[len(BY_THREAD):]:17} bridge {bridge:8.1f}   sync {sync:8.1f}")


def median_line(values: list[float]) -> str:
    if not values:
        return "no samples"
    return f"p50 {pct(values, 0.5) * 1e3:8.3f} ms  (min {min(values) * 1e3:.3f}, max {max(values) * 1e3:.3f}, n={len(values)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two cycles per way: checks that it runs")
    parser.add_argument("--cycles", type=int, default=10, help="retry cycles per way (default 10)")
    parser.add_argument("--kind", choices=("uce", "hccl"), default="uce", help="the fault rank 2 raises")
    parser.add_argument("--idle", type=float, default=0.0, metavar="SECONDS",
                        help="then each way idle for 2 windows of SECONDS (CPU, context switches; 0: not measured)")
    parser.add_argument("--hops", type=int, choices=(0, 1), default=1, help="0: the idle phase only")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"bench_conformance: cannot run: {reason}", file=sys.stderr)
        return 2
    peers = find_real_peers()
    assert peers is not None
    cycles = 2 if args.quick else args.cycles
    if not args.hops:
        with tempfile.TemporaryDirectory(prefix="bench-conformance-") as scratch:
            idle_phase(peers, 2, args.idle or 60.0, Path(scratch))
        return 0
    figures: dict[str, dict[str, list[float]]] = {way: {} for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="bench-conformance-") as scratch:
        for index in range(cycles):
            order = WAYS if index % 2 == 0 else WAYS[::-1]  # alternated: neither way always goes first
            for way in order:
                for label, seconds in one_cycle(peers, way, index, args.kind, Path(scratch)).items():
                    figures[way].setdefault(label, []).append(seconds)
    print(f"real peers ({peers}): {cycles} {args.kind.upper()} retry cycle(s) per way, 4 ranks; "
          "callback (controller's log) -> ClusterD received (its log)")
    misses = 0
    for label in [label for label, _, _ in HOPS] + [CRITICAL]:
        bridge, sync = figures["bridge"].get(label, []), figures["sync"].get(label, [])
        print(f"  {label}")
        print(f"    bridge {median_line(bridge)}")
        print(f"    sync   {median_line(sync)}")
        if bridge and sync:
            print(f"    bridge / sync (p50) {pct(bridge, 0.5) / pct(sync, 0.5):.2f}")
            if label == "strategies":
                print("    (not like for like: the sync client's callback comes after ClusterD answered the 2nd "
                      "fault report, the bridge's before; compare the critical path)")
        else:
            misses += 1
    if args.idle:
        with tempfile.TemporaryDirectory(prefix="bench-conformance-") as scratch:
            idle_phase(peers, 2, args.idle, Path(scratch))
    if misses:
        print(f"bench_conformance: {misses} figure(s) had no samples on a way (logs changed?)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
