"""Run the benchmarks and write docs/performance.md: today's figures, each table with the
command that produced it and the machine it ran on.

    python bench/report.py [--quick] [--out docs/performance.md] [--only NAME,...]

Each benchmark runs as its own process, one after the other (they start busy processes
and servers of their own; two at once would measure each other). Its printed tables go
into the file verbatim under the exact command, with its exit status: every benchmark
exits 1 when one of its targets is missed, and the file says so next to its tables.
The machine (host, cores, CPU model, Python, load average before and after each run)
is written at the top and under each table, since figures from a shared machine are
only read with its load. ``--quick`` runs each benchmark's short form (the whole report
in a few minutes); without it the full report takes about 22 minutes on a quiet
2-core machine (the footprint's idle windows are half of it). ``--only`` reruns the named
benchmarks and keeps every other benchmark's section of the file as it was; every
section's command line says when it ran.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


@dataclass(frozen=True)
class Benchmark:
    name: str
    what: str  # one line: what its tables show
    args: tuple[str, ...]  # the full run
    quick: tuple[str, ...]  # the short run
    reading: str = ""  # how to read its tables: what the figures are measured against


BENCHMARKS = (
    Benchmark("report path", "every report hop and the recovery's critical path, the bridge against a synchronous "
              "client, against a ClusterD that answers like the real one, at 0 and 2 busy processes",
              ("bench_loaded.py",), ("bench_loaded.py", "--quick"),
              "The fast server (`bench/fast_clusterd.py`) only decodes, stamps and answers; its share of a hop is "
              "the `sync send->srv` row, against 0.6-1.1 ms from a synchronous client's send to the real Go "
              "ClusterD's log line on a loopback node (its logging included). In the cycles phase the controller "
              "is the stub (`bridge/sim/mindio_ttp`), a Python thread in the bridge's process (the real one is "
              "C++); the bridge and the client take turns in blocks of 10 cycles, and each cycle's fault comes "
              "from a thread of its own, as from a rank, never from the bridge's event loop; `wire->srv` is "
              "each side's own send -> server received."),
    Benchmark("real report path", "the report hops and the critical path against the real peers (ClusterD's "
              "service code, a real MindIO TFT controller), the bridge against a synchronous client in the same run",
              ("bench_conformance.py",), ("bench_conformance.py", "--quick"),
              "Each cycle is a job of its own on the real peers (tests/conformance): a UCE on one of four fake "
              "ranks, a retry; the bridge (`tft-bridge run`) and MindCluster's synchronous client shape "
              "(`bench/sync_launcher.py`) take turns. Times are the peers' own log stamps (microseconds, one "
              "wall clock): the controller's `do action` line just before each callback, ClusterD's `receive` "
              "line as each handler starts; both peers' logging is inside every hop, on both ways alike. Read "
              "beside the fast server's figures above, which leave the real server's share out."),
    Benchmark("fault after a recovery", "fault -> ClusterD received for a UCE 0-5 s after a recovery's stream "
              "ended, the bridge against a synchronous client on the simulated ClusterD",
              ("bench_refault.py",), ("bench_refault.py", "--quick"),
              "The simulated ClusterD with its real 5 s keep-alive (its other delays a hundred times shorter) and "
              "the stub controller, both clients in the same process in turns; each point is a fault x seconds "
              "after the stream's end, the time from the controller's callback to ClusterD's journal entry."),
    Benchmark("fault codec", "ns per rank of the fault-map codec (C and Python) and of the per-item protobuf "
              "baseline", ("bench_faults.py",), ("bench_faults.py", "--quick")),
    Benchmark("relay", "callback block time up to 100 000 ranks, callback -> simulated ClusterD, signal -> notify",
              ("bench_relay.py",), ("bench_relay.py", "--quick"),
              "Each burst's `floor` row is the same thread making only the hand-off's put, which wakes a thread "
              "blocked on its CPU, at the burst's spacing, in chunks taken between the bridge's, without the "
              "bridge: every callback needs that one wake-up, so the row after it says how far above this "
              "machine's floor the bridge's p99 is."),
    Benchmark("scale and storm", "10 000- and 100 000-rank fault maps and a one-second callback storm through the "
              "whole path", ("bench_scale.py",), ("bench_scale.py", "--rounds-10k", "5", "--rounds-100k", "2",
                                                  "--storm", "2000")),
    Benchmark("footprint", "CPU, memory, threads and descriptors of the process hosting the controller, idle, with "
              "every rank connected and through a recovery, at 16, 1 000 and 10 000 ranks, the bridge against the "
              "synchronous client", ("bench_footprint.py",), ("bench_footprint.py", "--quick"),
              "Both sides host the same stub controller, whose ranks are Python objects in the measured process and "
              "whose NORMAL loop polls every 20 ms (the real one every 2 s): the `bridge-sync` rows are the "
              "bridge's own share. One TCP connection per rank is held open to the controller's port; the stub "
              "reads nothing from it."),
    Benchmark("soak", "consecutive recovery cycles: memory, descriptors and threads", ("soak.py", "--cycles", "200"),
              ("soak.py", "--cycles", "40")),
    Benchmark("start latency", "a job's bridge under the node service on a real systemd (transient units): pod 0 "
              "Running with its host IP -> the controller listening on TTP_PORT, against tft-bridge run started "
              "directly", ("bench_start_latency.py", "--jobs", "24"), ("bench_start_latency.py", "--jobs", "20"),
              "systemd 252 booted as PID 1 of a namespace of its own (`../shared/systemd`), "
              "`tft-bridge-node.service` installed verbatim; the stand-in API server and the simulated ClusterD "
              "on the host. The clock starts at the kubelet's status write (phase Running, hostIP) and stops at "
              "the first connect the controller's port accepts; each start is a new incarnation of one job, after "
              "the previous bridge is gone. The anchor is the same bridge forked directly, interleaved job by job."),
    Benchmark("node footprint", "the node service's own CPU, memory, threads and descriptors, idle with its pod "
              "watch open, under its shipped unit on a real systemd", ("bench_node_footprint.py",),
              ("bench_node_footprint.py", "--window", "20", "--settle", "5"),
              "The anchor is the same venv's interpreter with the same modules imported (the Kubernetes client, "
              "grpc, prometheus_client, the service's own), asleep: the difference is what the service itself "
              "holds and spends."),
)


def machine() -> str:
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{platform.node()}: {os.cpu_count()} cores ({model}), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run(bench: Benchmark, quick: bool) -> tuple[str, str, int, float, str, str]:
    """(command as written, output, exit status, seconds, load before, load after)."""
    args = bench.quick if quick else bench.args
    command = "python bench/" + " ".join(args)
    before = loadavg()
    start = time.monotonic()
    print(f"== {bench.name}: {command}", flush=True)
    process = subprocess.run([sys.executable, str(BENCH / args[0]), *args[1:]], cwd=ROOT, capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    seconds = time.monotonic() - start
    output = process.stdout
    if process.returncode not in (0, 1):  # 1: a target missed; anything else: the run itself failed
        output += "\n" + process.stderr[-4000:]
    print(f"   exit {process.returncode} after {seconds:.0f} s", flush=True)
    return command, output, process.returncode, seconds, before, loadavg()


#: The hand-written section of docs/performance.md: the measurements behind the design's
#: choices (the modules' docstrings point here), carried over verbatim by every rewrite.
DESIGN_HEADING = "## Measurements behind the design"


def design_section(path: Path) -> str:
    """The hand-written section of the file being rewritten, from its heading to the end
    ("" when the file or the section is missing)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return ""
    at = text.find("\n" + DESIGN_HEADING + "\n")
    return text[at + 1:] if at >= 0 else ""


def benchmark_sections(path: Path) -> dict[str, str]:
    """The benchmark sections of the file being rewritten by name, each from its heading
    to the next one, as written; a section's Command line without the date it ran gets
    the file's date when the file is a full report (its sections all ran then), never
    an ``--only`` run's, which dates only the sections it ran."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    header = re.search(r"(?m)^Written by `bench/report.py`(.*)$", text)
    full_report = header is not None and " --only " not in header.group(1)
    dated = re.search(r" on (\d{4}-\d\d-\d\d \d\d:\d\d UTC)", header.group(1)) if full_report else None
    design_at = text.find("\n" + DESIGN_HEADING + "\n")
    body = text[:design_at + 1] if design_at >= 0 else text
    names = {bench.name for bench in BENCHMARKS}
    sections: dict[str, str] = {}
    for part in re.split(r"(?m)^(?=## )", body):
        name = part[3:part.find("\n")] if part.startswith("## ") else ""
        if name in names:
            if dated and "` (run " not in part:
                part = re.sub(r"(?m)^(Command: `[^`]*` \()", rf"\g<1>run {dated.group(1)}, ", part, count=1)
            sections[name] = part.rstrip("\n") + "\n"
    return sections


def write(path: Path, quick: bool, results: list[tuple[Benchmark, tuple[str, str, int, float, str, str]]],
          keep_others: bool = False) -> None:
    """Rewrite ``path`` with ``results``; ``keep_others``: the sections of the benchmarks
    not run are carried over from the file as it was, each saying when it ran."""
    design = design_section(path)
    kept = benchmark_sections(path) if keep_others else {}
    ran = {bench.name for bench, _ in results}
    kept = {name: text for name, text in kept.items() if name not in ran}
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    total = sum(result[3] for _, result in results)
    written = f" on {now}, in {total / 60:.1f} minutes"
    if kept:
        written = (f" --only {','.join(b.name for b in BENCHMARKS if b.name in ran)}{written} (the other "
                   "sections carried over from earlier runs, each with the date it ran)")
    lines = [
        "# Performance",
        "",
        "Written by `bench/report.py`" + (" --quick" if quick else "") + f"{written}; "
        "do not edit by hand but its last section (measurements behind the design, which a rewrite keeps): run it "
        "again. What each benchmark measures and its targets: `bench/README.md`.",
        "",
        f"Machine: {machine()}.",
        "",
        "Every figure is read against its baseline measured in the same run; a shared machine's load (the load "
        "average before and after each run is given under its tables) moves both.",
        "",
    ]
    fresh = {bench.name: result for bench, result in results}
    for bench in BENCHMARKS:
        if bench.name in kept:
            lines += [kept[bench.name]]
            continue
        if bench.name not in fresh:
            continue
        command, output, status, seconds, before, after = fresh[bench.name]
        verdict = {0: "targets met", 1: "targets MISSED (listed at the end of the output)"}.get(
            status, f"the run FAILED (exit {status})")
        lines += [
            f"## {bench.name}",
            "",
            f"{bench.what}.",
            "",
            f"Command: `{command}` (run {now}, {seconds:.0f} s; {verdict}). Load average before {before}, after "
            f"{after}.",
            "",
            *([bench.reading, ""] if bench.reading else []),
            "```",
            output.rstrip(),
            "```",
            "",
        ]
    path.write_text("\n".join(lines) + (("\n" + design) if design else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's short form")
    parser.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    parser.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    args = parser.parse_args()
    chosen = [b for b in BENCHMARKS if not args.only or b.name in args.only.split(",")]
    results = [(bench, run(bench, args.quick)) for bench in chosen]
    write(Path(args.out), args.quick, results, keep_others=bool(args.only))
    print(f"wrote {args.out}")
    return max(result[2] for _, result in results) if results else 0


if __name__ == "__main__":
    sys.exit(main())
