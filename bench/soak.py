"""Soak: many consecutive recovery cycles through the real bridge, watching for leaks.

    python bench/soak.py [--cycles 1000]

The simulated ClusterD runs in a child process (bench/remote_sim.py), so the bridge
process's resident memory is the bridge's own plus the stub controller it hosts (the real
controller lives in the bridge process too). Cycles alternate between the two recoveries
the simulations support end to end with a live controller afterwards:

* retry: a UCE (type 0) on a rank, reported by the controller; ClusterD's fault centre
  turns that report into a retry cycle by itself; ClusterD chooses retry; ``retry-success``;
* recover: a process fault (type 1) reported by the controller; ClusterD chooses
  recover; ``recover-success``.

Each cycle must end with ClusterD's success annotation and the bridge live again on a new
stream before the next one starts. Reported: cycles/s, resident memory (RSS) before the
first cycle, after a warm-up, at the middle and at the end, open file descriptors and
threads at the same points, every cycle that did not complete, and the bridge's own
counters. Targets (exit status 1 when one is missed): RSS growth from the warm-up mark to
the end < 5 MB, no growth in file descriptors or threads, every cycle completed, no
protocol violation on either side.

The stub controller's observation log (every callback and notify it saw) is test
equipment, not the bridge: it is checked and cleared after each cycle so that it does not
count as the bridge's memory. The child's journal lines are likewise trimmed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bridge.sim.clusterd import SimJob
from bridge.sim.mindio_ttp import FAST_TIMINGS
from bridge.sim.scenario import SimulatedJob

sys.path.insert(0, str(Path(__file__).parent))
from remote_sim import RemoteSim  # noqa: E402

JOB = "soak-job"
WORLD_SIZE = 16
DEVICES_PER_POD = 4
KEEPALIVE = 0.05  # seconds: ClusterD's keep-alive cadence (the real one: 5 s)
PHASE_DELAY = 0.01  # seconds before globalFault (the real one: ~11 s)
CYCLE_TIMEOUT = 10.0
WARMUP = 20
RSS_GROWTH_TARGET_MB = 5.0


@dataclass
class Snapshot:
    label: str
    cycle: int
    rss_kb: int
    fds: int
    threads_py: int
    threads_os: int


@dataclass
class SoakResult:
    cycles: int
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    elapsed: float = 0.0
    cycle_seconds: list[float] = field(default_factory=list)


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def snapshot(label: str, cycle: int) -> Snapshot:
    gc.collect()
    return Snapshot(label, cycle, _status("VmRSS"), len(os.listdir("/proc/self/fd")), threading.active_count(),
                    _status("Threads"))


async def wait_live_on_new_stream(job: SimulatedJob, sim: RemoteSim, after: int, timeout: float) -> None:
    """ClusterD ended the cycle's stream; wait for the bridge to be live on the next one."""
    ended = await sim.wait_for(lambda e: e.kind == "stream-end", timeout, after=after)
    await sim.wait_for(lambda e: e.kind == "stream-open", timeout, after=ended.seq)
    assert job.bridge is not None and job.bridge.session is not None
    session = job.bridge.session
    deadline = time.monotonic() + timeout
    while session.stream_count <= ended.detail.get("stream", 0) or not session.live.is_set():
        if time.monotonic() > deadline:
            raise TimeoutError("the bridge did not re-subscribe")
        await asyncio.sleep(0.002)


async def one_cycle(job: SimulatedJob, sim: RemoteSim, index: int) -> str | None:
    """Run recovery cycle ``index``; None when it completed, else what went wrong."""
    training = job.training
    rank = (index * 5 + 1) % WORLD_SIZE
    kind = "retry" if index % 2 == 0 else "recover"
    expect = f"{kind}-success"
    mark = sim.last_seq
    try:
        training.inject_fault({rank: 0 if kind == "retry" else 1})
        done = await sim.wait_for(lambda e: e.kind == "annotation" and e.name == "ProcessRecoverStatus",
                                  CYCLE_TIMEOUT, after=mark)
        if done.detail.get("value") != expect:
            return f"cycle {index} ({kind}, rank {rank}): ClusterD wrote {done.detail.get('value')!r}, not {expect!r}"
        await wait_live_on_new_stream(job, sim, mark, CYCLE_TIMEOUT)
        # training must be running again before the next fault
        deadline = time.monotonic() + CYCLE_TIMEOUT
        while training.state != "NORMAL":
            if time.monotonic() > deadline:
                return f"cycle {index} ({kind}): the controller is {training.state}, not back to NORMAL"
            await asyncio.sleep(0.002)
        changes = [n.args[0] for n in training.notifies("change_strategy")]
        if changes != [kind] or training.violations or training.job_killed:
            return (f"cycle {index} ({kind}): controller saw change_strategy {changes}, violations "
                    f"{training.violations}, killed {training.job_killed} ({training.exit_reason})")
        return None
    except TimeoutError as error:
        states = training.states()[-4:]
        return f"cycle {index} ({kind}, rank {rank}) did not complete: {error}; controller states {states}"
    finally:
        with training.cond:  # the stub's observation log is test equipment: keep it from growing
            training.events.clear()
            training.callback_durations.clear()
        del sim.entries[:-1]


async def soak(cycles: int) -> SoakResult:
    result = SoakResult(cycles)
    job = SimulatedJob(SimJob(JOB, world_size=WORLD_SIZE, devices_per_pod=DEVICES_PER_POD), keepalive_interval=KEEPALIVE,
                       global_fault_delay=PHASE_DELAY, wait_time=5.0, start_clusterd=False,
                       config_overrides={"clusterd": {"watchdog_intervals": 20.0}},
                       controller_timings=FAST_TIMINGS)  # memory per cycle is measured: cycles at a faster pace
    sim = RemoteSim(job._clusterd_address, JOB, WORLD_SIZE, DEVICES_PER_POD, keepalive=KEEPALIVE,
                    phase_delay=PHASE_DELAY, strategies=("retry", "recover", "dump", "exit"))
    await sim.start()
    result.snapshots.append(snapshot("before start", 0))
    await job.start()
    try:
        await sim.wait_for(lambda e: e.kind == "signal" and e.name == "keep-alive", 10)
        assert job.bridge is not None and job.bridge.session is not None
        while not job.bridge.session.live.is_set():
            await asyncio.sleep(0.01)
        result.snapshots.append(snapshot("bridge ready", 0))
        started = time.monotonic()
        warmup = min(WARMUP, max(1, cycles // 10))
        middle = cycles // 2
        for index in range(cycles):
            t0 = time.monotonic()
            problem = await one_cycle(job, sim, index)
            result.cycle_seconds.append(time.monotonic() - t0)
            if problem is None:
                result.completed += 1
            else:
                result.failures.append(problem)
                print("  " + problem, flush=True)
                if len(result.failures) >= 10:
                    print("  ten cycles failed: stopping the soak", flush=True)
                    break
            done = index + 1
            if done == warmup:
                result.snapshots.append(snapshot("after warm-up", done))
            if done == middle and middle > warmup:
                result.snapshots.append(snapshot("middle", done))
            if done % 100 == 0:
                print(f"  {done} cycles, {done / (time.monotonic() - started):.1f}/s, "
                      f"RSS {_status('VmRSS') / 1024:.1f} MB", flush=True)
        result.elapsed = time.monotonic() - started
        result.snapshots.append(snapshot("end", result.completed + len(result.failures)))
        result.metrics = job.metrics  # type: ignore[attr-defined]
    finally:
        await job.stop()
        await sim.stop()
    result.sim_violations = list(sim.violations)  # type: ignore[attr-defined]
    return result


def counters(metrics, name: str) -> str:  # type: ignore[no-untyped-def]
    parts = []
    for family in metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and sample.value:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                parts.append(f"{labels or '-'}: {sample.value:g}")
    return "; ".join(parts) or "none"


def report(result: SoakResult) -> int:
    misses: list[str] = []
    print(f"\nsoak: {result.cycles} recovery cycles (alternating retry / recover), ClusterD in its own process")
    rate = result.completed / result.elapsed if result.elapsed else 0.0
    ordered = sorted(result.cycle_seconds) or [0.0]
    print(f"  completed {result.completed}/{result.cycles} in {result.elapsed:.1f} s: {rate:.2f} cycles/s "
          f"(cycle p50 {ordered[len(ordered) // 2] * 1e3:.0f} ms, "
          f"p99 {ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3:.0f} ms)")
    print(f"  {'point':<14} {'cycle':>6} {'RSS MB':>8} {'fds':>5} {'py threads':>11} {'OS threads':>11}")
    for s in result.snapshots:
        print(f"  {s.label:<14} {s.cycle:>6} {s.rss_kb / 1024:8.1f} {s.fds:>5} {s.threads_py:>11} {s.threads_os:>11}")
    base = next((s for s in result.snapshots if s.label == "after warm-up"), result.snapshots[1])
    end = result.snapshots[-1]
    growth = (end.rss_kb - base.rss_kb) / 1024
    print(f"  RSS growth from {base.label} to end: {growth:+.2f} MB (target < {RSS_GROWTH_TARGET_MB:g} MB); "
          f"fds {end.fds - base.fds:+d}; threads {end.threads_os - base.threads_os:+d} (target: no growth)")
    metrics = getattr(result, "metrics", None)
    if metrics is not None:
        print(f"  bridge: recovery cycles {counters(metrics, 'tft_bridge_recovery_cycles_total')}")
        print(f"  bridge: reports dropped {counters(metrics, 'tft_bridge_reports_dropped_total')}")
        print(f"  bridge: signals refused {counters(metrics, 'tft_bridge_signals_refused_total')}")
        print(f"  bridge: reconnects {counters(metrics, 'tft_bridge_subscription_reconnects_total')}")
    violations = getattr(result, "sim_violations", [])
    print(f"  simulated ClusterD protocol violations: {len(violations)}")
    if result.completed != result.cycles:
        misses.append(f"{result.cycles - result.completed} cycle(s) did not complete")
        for failure in result.failures:
            print("  FAILED " + failure)
    if growth >= RSS_GROWTH_TARGET_MB:
        misses.append(f"RSS grew {growth:.2f} MB (target < {RSS_GROWTH_TARGET_MB:g} MB)")
    if end.fds > base.fds:
        misses.append(f"open file descriptors grew by {end.fds - base.fds}")
    if end.threads_os > base.threads_os:
        misses.append(f"threads grew by {end.threads_os - base.threads_os}")
    if violations:
        misses.append(f"{len(violations)} protocol violation(s): {violations[:3]}")
    print()
    if misses:
        print("targets MISSED:\n  " + "\n  ".join(misses))
        return 1
    print("targets met: every cycle completed; RSS growth < 5 MB; no growth in fds or threads; no violations")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000, help="recovery cycles to run (default 1000)")
    args = parser.parse_args()
    if args.cycles < 2:
        parser.error("--cycles must be at least 2")
    logging.basicConfig(level=logging.ERROR)
    return report(asyncio.run(soak(args.cycles)))


if __name__ == "__main__":
    sys.exit(main())
