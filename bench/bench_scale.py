"""Scale benchmark: very large fault maps and a callback storm through the whole path,
next to a synchronous per-item relay measured in the same run.

    python bench/bench_scale.py [--rounds-10k N] [--rounds-100k N] [--storm N]

The path: controller callback -> hand-off to the event loop -> merge -> encode ->
ReportProcessFault over loopback gRPC -> the simulated ClusterD (in a child process, so it
does not share the bridge's GIL) has decoded the request and merged it into its fault
cache. The baseline is the existing client's way: inside the callback, build the
ProcessFaultRequest item by item with ``FaultRank(rankId=str(r), faultType=str(t))`` and
make a blocking stub call.

Figures:
  * large maps (10 000 and 100 000 ranks, one map per callback): callback block time,
    end-to-end latency (callback -> server decoded), requests sent, ranks delivered;
  * storm: N callbacks (default 10 000) spread over one second from one thread, one new
    rank each: requests sent, ranks delivered, callback block time, latency from each
    callback's scheduled time to the server having decoded its rank, and how long the
    controller's thread took to get through the storm.
Exit status 1 when ranks delivered != ranks reported (the correctness target); the
timings are reported, not gated (bench/bench_relay.py gates the latency targets).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


from bridge.sim.clusterd import SimJob
from bridge.sim.mindio_ttp import FAST_TIMINGS
from bridge.sim.scenario import SimulatedJob

sys.path.insert(0, str(Path(__file__).parent))
from remote_sim import Entry, RemoteSim  # noqa: E402
from baseline import SyncRelay, pct  # noqa: E402
from taps import registered_callback, wire_log  # noqa: E402

JOB = "scale-job"
WORLD = 100_000
#: The controller's wait for ClusterD (MINDIO_WAIT_MINDX_TIME, seconds): the longest the
#: config allows, far beyond a default run (~1 minute; see main_async).
CONTROLLER_WAIT = 3600




@dataclass
class Run:
    """One relay's figures for one workload."""

    blocks: list[float]  # seconds each callback held the controller's thread
    latencies: list[float]  # seconds, callback (or its scheduled time) -> server decoded
    requests: int
    reported: int  # distinct ranks reported
    delivered: int  # distinct reported ranks the server decoded
    wall: float = 0.0  # seconds the controller's thread spent on the whole workload
    on_wire: list[float] = field(default_factory=list)  # bridge only: callback -> request handed to gRPC


async def fresh_clusterd(job: SimulatedJob, sim: RemoteSim) -> None:
    """Make the bridge subscribe again: a subscribe resets ClusterD's job, so its fault
    cache starts empty and every measurement sees the same server-side cost (ClusterD
    de-duplicates its whole cache on every ReportProcessFault)."""
    assert job.bridge is not None and job.bridge.session is not None
    if job.bridge.ended_reason is not None:  # it will never subscribe again: say why, not "timed out"
        raise RuntimeError(f"the bridge stopped itself: the controller counts as ended ({job.bridge.ended_reason})")
    session = job.bridge.session
    # The benchmark calls the bridge's callback without a real controller, so the flow it
    # tracks never moves past "awaiting stop_train", and the bridge would re-report the
    # earlier workloads' faults on the new stream. Forget them: each workload stands alone.
    job.bridge.link.reports.flow_faults.clear()
    streams, mark = session.stream_count, sim.last_seq
    session.request_resubscribe("bench_reset")
    await sim.wait_for(lambda e: e.kind == "stream-open", 10, after=mark)
    deadline = time.monotonic() + 10
    while session.stream_count <= streams or not session.live.is_set():
        if time.monotonic() > deadline:
            raise TimeoutError("the bridge did not subscribe again")
        await asyncio.sleep(0.002)
    del sim.entries[:-1]  # earlier journal lines are not needed any more


def fault_requests(sim: RemoteSim, after: int) -> list[Entry]:
    return [e for e in sim.entries if e.seq > after and e.kind == "rpc" and e.name == "ReportProcessFault"]


async def wait_delivered(sim: RemoteSim, after: int, ranks: set[int], timeout: float) -> dict[int, float]:
    """Rank -> when the server decoded the first request carrying it, for every rank in
    ``ranks`` (or as many as arrived before ``timeout``)."""
    seen: dict[int, float] = {}
    checked = 0
    deadline = time.monotonic() + timeout
    while len(seen) < len(ranks) and time.monotonic() < deadline:
        entries = fault_requests(sim, after)
        for entry in entries[checked:]:
            for rank in entry.detail.get("rank_set", ()):
                if rank in ranks and rank not in seen:
                    seen[rank] = entry.at
        checked = len(entries)
        if len(seen) < len(ranks):
            await asyncio.sleep(0.005)
    return seen


async def large_maps(job: SimulatedJob, sim: RemoteSim, callback: Callable[..., int], size: int, rounds: int,
                     salt: int, wire: list[tuple[str, float]] | None = None) -> Run:
    """``rounds`` sequential callbacks, each with a fresh map of ``size`` type-0 ranks,
    each into a fresh ClusterD job. ``wire``: the bridge's Report* calls (``taps.wire_log``), for the
    bridge's own share of the latency (callback -> request handed to gRPC)."""
    blocks: list[float] = []
    latencies: list[float] = []
    on_wire: list[float] = []
    requests = reported = delivered = 0
    for i in range(rounds):
        await fresh_clusterd(job, sim)
        offset = (salt + i * 7919) % WORLD
        faults = {(offset + r) % WORLD: 0 for r in range(size)}
        mark = sim.last_seq
        held: list[float] = []

        def call(faults: dict[int, int] = faults, held: list[float] = held) -> None:  # the controller's thread
            start = time.perf_counter()
            callback(faults, {})
            held.append(time.perf_counter() - start)

        called_at = time.monotonic()
        await asyncio.to_thread(call)
        seen = await wait_delivered(sim, mark, set(faults), 60)
        blocks.append(held[0])
        if seen:
            latencies.append(max(seen.values()) - called_at)
        if wire:
            on_wire.append(wire[-1][1] - called_at)
        requests += len(fault_requests(sim, mark))
        reported += len(faults)
        delivered += len(seen)
    return Run(blocks, latencies, requests, reported, delivered, on_wire=on_wire)


async def storm(job: SimulatedJob, sim: RemoteSim, callback: Callable[..., int], count: int, first_rank: int) -> Run:
    """``count`` callbacks spread over one second (ten per millisecond), each reporting one
    new rank, from one thread, into a fresh ClusterD job; a slow callback delays every
    later one, as it would delay the controller."""
    await fresh_clusterd(job, sim)
    ranks = [(first_rank + i) % WORLD for i in range(count)]
    blocks = [0.0] * count
    scheduled = [0.0] * count
    mark = sim.last_seq
    wall: list[float] = []

    def run() -> None:
        t0 = time.monotonic()
        start_wall = time.perf_counter()
        for i, rank in enumerate(ranks):
            due = t0 + i / count
            if i % 10 == 0:
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # releases the GIL, as the real C++ thread holds none between callbacks
            scheduled[i] = time.monotonic()  # end-to-end counts from the callback's actual start
            start = time.perf_counter()
            callback({rank: 0}, {rank: ""})
            blocks[i] = time.perf_counter() - start
        wall.append(time.perf_counter() - start_wall)

    await asyncio.to_thread(run)
    seen = await wait_delivered(sim, mark, set(ranks), 120)
    latencies = [seen[rank] - scheduled[i] for i, rank in enumerate(ranks) if rank in seen]
    return Run(blocks, latencies, len(fault_requests(sim, mark)), len(set(ranks)), len(seen), wall[0])


def line(label: str, bridge: float, sync: float, unit: float, suffix: str) -> str:
    return f"  {label:<34} {bridge / unit:>12.1f} {sync / unit:>14.1f} {suffix:<3} {ratio(sync, bridge):>10}"


def ratio(sync: float, bridge: float) -> str:
    if bridge <= 0:
        return "-"
    value = sync / bridge
    return f"{value:.1f}x" if value < 10 else f"{value:.0f}x"


def table(title: str, bridge: Run, sync: Run) -> None:
    print(f"\n{title}")
    print(f"  {'':<34} {'bridge':>12} {'sync per-item':>14} {'':<3} {'sync/bridge':>10}")
    print(line("callback block p50", statistics.median(bridge.blocks), statistics.median(sync.blocks), 1e-6, "us"))
    print(line("callback block p99", pct(bridge.blocks, 0.99), pct(sync.blocks, 0.99), 1e-6, "us"))
    if bridge.latencies and sync.latencies:
        print(line("end-to-end p50", statistics.median(bridge.latencies), statistics.median(sync.latencies), 1e-3,
                   "ms"))
        print(line("end-to-end p99", pct(bridge.latencies, 0.99), pct(sync.latencies, 0.99), 1e-3, "ms"))
    if bridge.on_wire:
        print(f"  {'bridge: callback -> on the wire p99':<34} {pct(bridge.on_wire, 0.99) / 1e-3:>12.1f} {'-':>14} ms")
    if bridge.wall or sync.wall:
        print(line("controller thread busy for", bridge.wall, sync.wall, 1e-3, "ms"))
    print(f"  {'requests sent':<34} {bridge.requests:>12} {sync.requests:>14} {'':<3} "
          f"{ratio(sync.requests, bridge.requests):>10}")
    print(f"  {'ranks reported / delivered':<34} {f'{bridge.reported}/{bridge.delivered}':>12} "
          f"{f'{sync.reported}/{sync.delivered}':>14}")


async def main_async(rounds_10k: int, rounds_100k: int, storm_count: int) -> int:
    # One node's ranks connect to the stub controller: it would check all 100 000 in Python
    # every 20 ms under the GIL, which the real (C++) controller never takes from the bridge.
    # The callbacks are synthetic: no stopTrain ever follows them. The bridge's flow tracker
    # rightly takes a fault report as the controller now waiting for ClusterD, after
    # wait_mindx_time as the controller gone to EXIT, and after that wait again (+5 s) as
    # the controller ended, which stops the bridge with exit 76 (daemon.py: the controller ending on its own).
    # At the default 5 s that happened ~15 s into the run, in the 10 000-rank phase, and
    # the next re-subscription timed out. The controller's wait must outlast the run.
    job = SimulatedJob(SimJob(JOB, world_size=WORLD, devices_per_pod=8), keepalive_interval=0.1, start_clusterd=False,
                       connected_ranks=8, config_overrides={"clusterd": {"watchdog_intervals": 50.0}},
                       wait_time=CONTROLLER_WAIT,
                       controller_timings=FAST_TIMINGS)  # the bridge's cost is measured, not the controller's pace
    sim = RemoteSim(job._clusterd_address, JOB, WORLD, keepalive=0.1)
    await sim.start()
    await job.start()
    misses: list[str] = []
    try:
        await job.subscribed()
        assert job.bridge is not None and job.bridge.controller is not None
        bridge_callback = registered_callback(job, "report_fault_ranks")
        wire = wire_log(job)
        sync = SyncRelay(job.config.clusterd.address, JOB)
        print("fault reports through the whole path (callback -> merge -> encode -> RPC -> server decoded), "
              "loopback, ClusterD in its own process; type-0 ranks")
        try:
            for size, rounds in ((10_000, rounds_10k), (100_000, rounds_100k)):
                if rounds <= 0:  # e.g. --rounds-10k 0: run only the other workload
                    continue
                ours = await large_maps(job, sim, bridge_callback, size, rounds, 0, wire)
                theirs = await large_maps(job, sim, sync.report_fault_ranks, size, rounds, 50_000)
                table(f"{size:,} ranks per callback, {rounds} callbacks each", ours, theirs)
                for name, run in (("bridge", ours), ("sync", theirs)):
                    if run.delivered != run.reported:
                        misses.append(f"{size} ranks, {name}: {run.delivered} delivered of {run.reported}")
            ours = await storm(job, sim, bridge_callback, storm_count, 0)
            theirs = await storm(job, sim, sync.report_fault_ranks, storm_count, 50_000)
            table(f"storm: {storm_count:,} callbacks of one rank each, scheduled over one second", ours, theirs)
            for name, run in (("bridge", ours), ("sync", theirs)):
                if run.delivered != run.reported:
                    misses.append(f"storm, {name}: {run.delivered} delivered of {run.reported}")
            if job.bridge.ended_reason is not None:
                misses.append(f"the bridge stopped itself during the run: {job.bridge.ended_reason}")
            merged = job.metrics.sample("tft_bridge_fault_reports_merged_total")
            print(f"  bridge: {merged:.0f} callback reports merged into a neighbour before sending "
                  f"(tft_bridge_fault_reports_merged_total, whole run)")
        finally:
            sync.close()
    finally:
        await job.stop()
        await sim.stop()
    if sim.violations:
        misses.append(f"protocol violations: {sim.violations[:3]}")
    print()
    if misses:
        print("target MISSED (ranks delivered must equal ranks reported):\n  " + "\n  ".join(misses))
        return 1
    print("target met: ranks delivered == ranks reported, for every workload and both relays")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds-10k", type=int, default=20, help="callbacks with 10 000 ranks (default 20)")
    parser.add_argument("--rounds-100k", type=int, default=5, help="callbacks with 100 000 ranks (default 5)")
    parser.add_argument("--storm", type=int, default=10_000, help="callbacks in the one-second storm (default 10 000)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    # The callbacks are called directly, outside any ClusterD cycle, so the bridge's flow
    # tracker rightly concludes the controller gave up waiting for stop_train: not news here.
    logging.getLogger("bridge.job.daemon").setLevel(logging.CRITICAL)
    return asyncio.run(main_async(args.rounds_10k, args.rounds_100k, args.storm))


if __name__ == "__main__":
    sys.exit(main())
