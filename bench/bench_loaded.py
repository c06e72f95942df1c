"""The report path hop by hop, the bridge side by side with a synchronous client, in the
same run, against a ClusterD that answers like the real one, with and without busy cores.

    python bench/bench_loaded.py [--quick] [--loads 0,2] [--sizes 16,1000] [--rounds N]
                                 [--cycles N] [--phases hops,signals,cycles]

The synchronous client is MindCluster's shape (``baseline.SyncRelay``, ``baseline.SyncClient``):
each callback builds its request and makes a blocking call before it returns to the
controller. Load levels are busy processes (a Python ``while True`` each) the benchmark
starts and always stops; recoveries happen when a node's cores are busy.

Phases:

* ``hops``: one ``report_fault_ranks`` callback at a time, from a controller thread of
  its own, against the fast server (``fast_clusterd.py``: a separate process whose
  handlers only decode, stamp and answer), the bridge and the synchronous client
  alternating round by round, plus a second synchronous client (the A/A control: the
  measurement's own noise floor). Per way: callback block time and callback -> server
  received; for the bridge where the time goes (callback -> the wire takes it, -> the
  request on the wire, -> the loop's bookkeeping; wire -> server received), for the
  synchronous client callback -> send and send -> server received: the server's own
  share, which the real ClusterD takes 0.6-1.1 ms for on loopback, its logging included.
  The event loop, which the benchmark shares with the bridge, sleeps ``HOP_WAIT`` after
  each callback on both sides, so it never wakes while a request travels (``HOP_WAIT``
  says what polling did to the figures).
* ``signals``: ClusterD signal -> controller notify (pause_train -> stop_train(pause)),
  the bridge as configured against the synchronous client's reader (notify inline on
  the stream thread), against the simulated ClusterD (the signal needs its state
  machine), the synchronous client twice (A/A).
* ``cycles``: real pure-retry recovery cycles with the stub controller against the fast
  server playing the cycle: every report hop (callback -> server received) and the
  critical path, the controller's 2nd ``report_fault_ranks`` callback -> server received
  the ``ReportRecoverStrategy`` that follows it; for the bridge, each report's callback ->
  the same places as in ``hops``. ClusterD must have answered the 2nd fault report before the
  strategy report leaves (docs/clusterd.md: a fault report during a cycle joins it, and
  two HTTP/2 streams give no order between their handlers), so that hop counts from the
  later of the strategies callback and that answer reaching the client: the synchronous
  client's callback comes after the answer, the bridge's before it.

Targets, each against the synchronous client measured in the same run (exit status 1
when one is missed):

* callback block p99 <= 50 us (the controller's thread must never wait);
* hops: callback -> server p50 <= sync p50 + 0.2 ms and p99 <= sync p99 + 1 ms at every
  load, max <= 20 ms with two busy processes;
* signals: signal -> notify p99 <= sync p99 + 1 ms, max <= 20 ms with two busy processes;
* cycles: each report hop p50 <= sync p50 + 0.2 ms; the critical path p50 <= sync p50.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bridge.job.reports.kinds import ControllerReport
from bridge.job.sched.grpc_internals import AfterSend
from bridge.job.reports.kinds import REPORT_METHODS
from bridge.sim.clusterd import SimJob
from bridge.sim.mindio_ttp import FAST_TIMINGS
from bridge.sim.scenario import SimulatedJob, free_port

sys.path.insert(0, str(Path(__file__).parent))
from baseline import SyncClient, SyncRelay, p50_gap_interval, pct  # noqa: E402
from bench_relay import JOB, NODE_RANKS, fault_map, signal_pair, until  # noqa: E402
from fast_clusterd import FastClusterD, Stamp  # noqa: E402
from taps import registered_callback, stamp_report_calls  # noqa: E402

if TYPE_CHECKING:  # annotations only (postponed): Python 3.10 has no typing.Self
    from typing_extensions import Self

SLACK_P99 = 1e-3  # p99 no worse than the synchronous client's + 1 ms
SLACK_P50 = 0.2e-3  # a report hop's p50 no worse than the synchronous client's + 0.2 ms
LOADED_MAX = 20e-3  # max <= 20 ms with two busy processes
BLOCK_P99 = 50e-6  # the controller's thread never waits longer than this
CYCLE_WORLD = 16  # ranks of the cycles' job
CYCLE_TIMEOUT = 15.0


class BusyProcesses:
    """``count`` processes spinning on a core each, for as long as the ``with`` lasts;
    killed on exit, on an exception and at interpreter exit."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Self:
        atexit.register(self.stop)
        for _ in range(self.count):
            self.processes.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                                   stdin=subprocess.DEVNULL))
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait(10)
        self.processes.clear()


class ControllerThread:
    """The controller's state-machine thread: it calls a callback when told to and does
    nothing else (the real controller is C++: after a callback returns it touches
    neither Python nor any event loop, so nothing here wakes the loop either)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., int], tuple[Any, ...], list[float]] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bench-controller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            callback, args, result = job
            result.append(time.monotonic())  # the callback starts: latencies count from here
            start = time.perf_counter()
            callback(*args)
            result.append(time.perf_counter() - start)

    def call(self, callback: Callable[..., int], *args: Any) -> list[float]:
        """Start a call; the list gets (started, seconds it blocked) once it returned."""
        result: list[float] = []
        self._jobs.put((callback, args, result))
        return result

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(10)


class StampedSync(SyncRelay):
    """``SyncRelay`` that notes when its request goes to the channel."""

    def __init__(self, address: str, job_id: str) -> None:
        super().__init__(address, job_id)
        self.sent: list[float] = []

    def report_fault_ranks(self, faults: dict[int, int], codes: dict[int, str] | None = None) -> int:
        from bridge._proto import recover_pb2 as pb

        request = pb.ProcessFaultRequest(jobId=self.job_id)
        for rank, fault_type in faults.items():
            request.faultRanks.append(pb.FaultRank(rankId=str(rank), faultType=str(fault_type)))
        self.sent.append(time.monotonic())
        return self.stub.ReportProcessFault(request).code


@dataclass
class BridgeStamps:
    """Where a bridge's report was when: taken by the wire (bridge/job/reports/relay.py: the thread the
    callback puts into), on the wire, then handed to the event loop's bookkeeping."""

    taken: list[tuple[str, float]] = field(default_factory=list)  # (callback, at): the wire took it
    loop: list[tuple[str, float]] = field(default_factory=list)  # (callback, at): the loop's bookkeeping
    wire: list[tuple[str, float]] = field(default_factory=list)  # (method, at)
    started: list[tuple[str, float]] = field(default_factory=list)  # (method, at): gRPC's call start returned
    answered: list[tuple[str, float]] = field(default_factory=list)  # (method, at): the answer is back

    #: the places ``split`` names, in the path's order
    PLACES = ("cb->wire took it", "cb->wire", "cb->loop")

    def clear(self) -> None:
        for stamped in (self.taken, self.loop, self.wire, self.started, self.answered):
            stamped.clear()

    def split(self, callback: str, method: str, called: float) -> dict[str, float]:
        """Callback -> each place the report reached, for those it reached."""
        reached = (after(self.taken, callback, called), after(self.wire, method, called),
                   after(self.loop, callback, called))
        places = dict(zip(self.PLACES, reached))
        return {label: at - called for label, at in places.items() if at is not None}


def stamp_bridge(job: SimulatedJob) -> BridgeStamps:
    """Stamp a started bridge's report path: each report as the wire takes it, each
    report RPC as it goes on the wire (the report channel's callables wrapped), and each
    report as the loop's bookkeeping has it; nothing of the product changes."""
    assert job.bridge is not None
    link = job.bridge.link
    stamps = BridgeStamps()
    wire, reports = link.wire, link.reports
    intake, taken = wire._intake, reports.taken

    def stamped_intake(report: Any) -> Any:  # on the wire's thread
        stamps.taken.append((report.callback, time.monotonic()))
        return intake(report)

    def stamped_taken(batch: list[Any]) -> None:  # on the loop
        now = time.monotonic()
        stamps.loop.extend((taken.report.callback, now) for taken in batch)
        taken(batch)

    wire._intake = stamped_intake  # type: ignore[method-assign]
    reports.taken = stamped_taken  # type: ignore[method-assign]
    stamp_report_calls(job, stamps.wire, stamps.answered,
                       wrap=lambda callable_, name: stamp_call_start(callable_, name, stamps.started))
    return stamps


def stamp_call_start(callable_: Any, name: str, started: list[tuple[str, float]]) -> None:
    """Note in ``started`` when each call of a gRPC callable has been started (the same
    wrapping for the bridge's callables and the synchronous client's). A grpcio without
    the private ``_channel`` leaves the callable as it is, and the split goes without it."""
    holder = callable_
    # The bridge's own proxy (lowlevel.AfterSend) promotes its thread once the call
    # started: the stamp goes inside it, where the synchronous client's goes.
    while callable(getattr(getattr(getattr(holder, "_channel", None), "_channel", None), "segregated_call", None)):
        holder = holder._channel
    inner = getattr(holder, "_channel", None)
    if callable(getattr(inner, "segregated_call", None)):
        # The bridge's own proxy, reused: it tells its callback once segregated_call
        # returned, gRPC's core having created the call and written the request.
        holder._channel = AfterSend(inner, lambda: started.append((name, time.monotonic())))


def gap_line(bridge: list[float], sync: list[float]) -> str:
    """The bridge's p50 minus the client's, with its 95% bootstrap interval."""
    if not bridge or not sync:
        return "gap (no samples)"
    low, high = p50_gap_interval(bridge, sync)
    return (f"gap p50 {(pct(bridge, 0.5) - pct(sync, 0.5)) * 1e3:+8.3f} ms  "
            f"95% interval {low * 1e3:+.3f} .. {high * 1e3:+.3f} ms (bootstrap)")


def stats(values: list[float], unit: float, suffix: str) -> str:
    if not values:
        return "(no samples)"
    return (f"p50 {pct(values, 0.5) / unit:8.3f}  p99 {pct(values, 0.99) / unit:8.3f}  "
            f"max {max(values) / unit:8.3f} {suffix}  (n={len(values)})")


def after(stamps: list[tuple[str, float]] | list[Stamp], name: str, at: float) -> float | None:
    """The first stamp named ``name`` at or after ``at``."""
    for stamp in stamps:
        if isinstance(stamp, Stamp):
            if stamp.name == name and stamp.at >= at:
                return stamp.at
        elif stamp[0] == name and stamp[1] >= at:
            return stamp[1]
    return None


# --------------------------------------------------------------------------- hops

#: How long the hops phase leaves the event loop asleep after each callback, on both
#: sides, before it looks at the outcome (a slower hop is then polled every ms). The loop
#: runs ``SCHED_FIFO`` and is shared with the bridge: polling it every millisecond while
#: the synchronous client's request travelled preempted a busy process each time and
#: gave the server's receipt a free CPU on that side only, and waking it from the
#: client's thread instead left the bridge's next callbacks blocked up to 2 ms, 5% of
#: them. Beyond every hop's p99 (5-10 ms at two busy processes).
HOP_WAIT = 0.010

async def hops_phase(loads: list[int], sizes: list[int], rounds: dict[int, int], misses: list[str]) -> None:
    job = SimulatedJob(SimJob(JOB, world_size=100_000, devices_per_pod=8), keepalive_interval=1.0,
                       start_clusterd=False, connected_ranks=NODE_RANKS, wait_time=3600,
                       controller_timings=FAST_TIMINGS)
    server = FastClusterD(job.config.clusterd.address, JOB)
    await server.start()
    controller = ControllerThread()
    sync_controller = ControllerThread()  # the bridge pins the thread of its first callback
    syncs = {"sync": StampedSync(server.address, JOB), "sync (again)": StampedSync(server.address, JOB)}
    try:
        await job.start()
        await job.subscribed()
        assert job.bridge is not None
        link = job.bridge.link
        stamps = stamp_bridge(job)
        registry = job.metrics.registry
        print(f"  bridge: wire SCHED_BATCH {link.wire.batch_policy}, may run SCHED_FIFO {link.wire.realtime}; "
              f"SCHED_FIFO loop {link.loop_priority.realtime}")
        ways: dict[str, Callable[..., int]] = {"bridge": registered_callback(job, "report_fault_ranks")}
        ways.update({name: sync.report_fault_ranks for name, sync in syncs.items()})
        print("controller callback -> fast server received (report_fault_ranks), loopback, server in its own process")
        for load in loads:
            with BusyProcesses(load):
                for size in sizes:
                    blocks: dict[str, list[float]] = {name: [] for name in ways}
                    latency: dict[str, list[float]] = {name: [] for name in ways}
                    split: dict[str, list[float]] = {label: [] for label in (*BridgeStamps.PLACES, "wire->srv",
                                                                              "sync send->srv", "sync cb->send")}
                    await server.dump()
                    for i in range(rounds[size]):
                        for k, (name, callback) in enumerate(ways.items()):  # alternate: same conditions
                            faults = fault_map(size, len(ways) * i + k)
                            if name == "bridge":
                                stamps.clear()
                                before = registry.get_sample_value("tft_bridge_reports_sent_total", {"kind": "fault"}) or 0
                                result = controller.call(callback, faults, {})
                                await asyncio.sleep(HOP_WAIT)
                                if not await until(lambda: (registry.get_sample_value(
                                        "tft_bridge_reports_sent_total", {"kind": "fault"}) or 0) > before, 30):
                                    raise TimeoutError("the bridge did not deliver its report in 30 s")
                            else:
                                result = sync_controller.call(callback, faults, {})
                                await asyncio.sleep(HOP_WAIT)
                                deadline = time.monotonic() + 30
                                while len(result) < 2:
                                    if time.monotonic() > deadline:
                                        raise TimeoutError("the synchronous callback did not return in 30 s")
                                    await asyncio.sleep(0.001)
                            while len(result) < 2:  # the bridge's returned long ago; be sure
                                await asyncio.sleep(0.001)
                            called, block = result
                            received = after(await server.dump(), "ReportProcessFault", called)
                            if received is None:
                                raise RuntimeError(f"{name}: the server logged no ReportProcessFault")
                            blocks[name].append(block)
                            latency[name].append(received - called)
                            if name == "bridge":
                                reached = stamps.split("report_fault_ranks", "ReportProcessFault", called)
                                for label, took in reached.items():
                                    split[label].append(took)
                                if "cb->wire" in reached:
                                    split["wire->srv"].append(received - called - reached["cb->wire"])
                            elif name == "sync":
                                sent = syncs["sync"].sent[-1]
                                split["sync cb->send"].append(sent - called)
                                split["sync send->srv"].append(received - sent)
                            await asyncio.sleep(0.003)
                    print(f"  {load} busy process(es), {size} ranks")
                    for name in ways:
                        print(f"    {name:<14} block  {stats(blocks[name], 1e-6, 'us')}")
                        print(f"    {name:<14} ->srv  {stats(latency[name], 1e-3, 'ms')}")
                    for label, values in split.items():
                        print(f"      {label:<18} {stats(values, 1e-3, 'ms')}")
                    print(f"    A/A sync - sync (again): ->srv p50 "
                          f"{(pct(latency['sync'], 0.5) - pct(latency['sync (again)'], 0.5)) * 1e3:+.3f} ms, "
                          f"p99 {(pct(latency['sync'], 0.99) - pct(latency['sync (again)'], 0.99)) * 1e3:+.3f} ms")
                    what = f"hops, {load} busy, {size} ranks"
                    check_p50(f"{what}, callback -> server", latency["bridge"], latency["sync"], misses)
                    check_p99(f"{what}, callback -> server", latency["bridge"], latency["sync"], load, misses)
                    check_block(what, blocks["bridge"], misses)
    finally:
        await asyncio.to_thread(controller.close)
        await asyncio.to_thread(sync_controller.close)
        for sync in syncs.values():
            sync.close()
        await job.stop()
        await server.stop()


# --------------------------------------------------------------------------- signals

async def signal_phase(loads: list[int], rounds: int, misses: list[str]) -> None:
    """Per load: the bridge as configured, then the synchronous client twice (A/A)."""
    print("\nClusterD signal -> controller notify (pause_train -> stop_train(pause)), loopback, simulated ClusterD")
    for load in loads:
        print(f"  {load} busy process(es)")
        with BusyProcesses(load):
            bridge, baseline = await signal_pair(rounds)
            _, again = await signal_pair(rounds, with_bridge=False)
        print(f"    {'bridge':<14} {stats(bridge, 1e-3, 'ms')}")
        print(f"    {'sync':<14} {stats(baseline, 1e-3, 'ms')}")
        print(f"    {'sync (again)':<14} {stats(again, 1e-3, 'ms')}")
        check_p99(f"signals, {load} busy, signal -> notify", bridge, baseline, load, misses)


# --------------------------------------------------------------------------- cycles

#: (label, callback, its occurrence in the cycle, the RPC it makes)
REPORT_HOPS = (
    ("fault cb -> srv", "report_fault_ranks", 0, "ReportProcessFault"),
    ("stop cb -> srv", "report_stop_complete", 0, "ReportStopComplete"),
    ("2nd fault cb -> srv", "report_fault_ranks", 1, "ReportProcessFault"),
    ("strategies cb|fault answered -> srv", "report_strategies", 0, "ReportRecoverStrategy"),
    ("result cb -> srv", "report_result", 0, "ReportRecoverStatus"),
)
CRITICAL = "2nd fault cb -> strategy srv"
#: the synchronous client's place before the wire in the cycles phase (its callback makes the call)
SYNC_PLACES = ("cb->send",)
#: after the wire, both sides: gRPC's call start (Python and C-core, on the calling thread,
#: until the request is written), then the rest to the server's stamp
WIRE_PLACES = ("wire->srv", "wire->started", "started->srv")


@dataclass
class SyncStamps:
    """The synchronous client's: each Report* call as it starts (``SyncClient.sent``: its
    place on the wire, as ``BridgeStamps.wire`` is the bridge's), and as gRPC's call start
    returns (``stamp_call_start``)."""

    wire: list[tuple[str, float]]
    started: list[tuple[str, float]] = field(default_factory=list)

    def clear(self) -> None:
        self.wire.clear()
        self.started.clear()


@dataclass
class CycleFigures:
    hops: dict[str, list[float]] = field(default_factory=lambda: {label: [] for label, *_ in REPORT_HOPS})
    split: dict[str, list[float]] = field(default_factory=dict)  # "<callback> #<n> <place>" (bridge, BridgeStamps.PLACES)
    critical: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def extend(self, other: CycleFigures) -> None:
        """Add another block's figures to these."""
        for label, values in other.hops.items():
            self.hops[label].extend(values)
        for label, values in other.split.items():
            self.split.setdefault(label, []).extend(values)
        self.critical.extend(other.critical)
        self.failures.extend(other.failures)


#: Rounds per load and size in the hops phase (up to 1 000 ranks). Two of its targets
#: are p99s: of 100 rounds that is the second-worst sample, so two stalls of this VM's
#: hypervisor (bench/README.md, bench_relay.py) decided the block target (two recorded
#: runs: 35 and 57 us at no load); of 300 rounds it is the fourth-worst.
HOP_ROUNDS = 300

#: how often the cycles phase looks again at what it waits for between cycles, seconds
POLL = 0.002

#: how long after the loop goes back to waiting a cycle's fault comes (``one_cycle``)
INJECT_DELAY = 0.005

#: The fast server's keep-alive in the cycles phase, seconds. Each side's next cycle
#: starts once its new stream has delivered a first message, a keep-alive (the bridge's
#: subscription is live only then, and the client's is held to the same): at the
#: server's default of 1 s a cycle took about a second, and a shorter wait only makes the
#: phase quicker. Keep-alives go out only after this much silence, so none comes during
#: a cycle, whose signals are milliseconds apart.
CYCLE_KEEPALIVE = 0.25

#: Measured cycles per load and side. The hop targets compare two medians with 0.2 ms of
#: slack; at 40 cycles a side the gap's 95% bootstrap interval was 0.05-0.4 ms wide on
#: the 2-core machine, so a verdict rode on the noise; 80 narrow it by about a third.
CYCLES = 80
CYCLES_QUICK = 10
#: cycles per block of one side in the cycles phase (``cycles_phase``)
CYCLE_BLOCK = 10


def _blocks(cycles: int) -> list[int]:
    """``cycles`` cut into blocks of at most CYCLE_BLOCK."""
    return [min(CYCLE_BLOCK, cycles - start) for start in range(0, cycles, CYCLE_BLOCK)]


async def run_cycles(server: FastClusterD, training: Any, cycles: int,
                     ready: Callable[[int], Awaitable[None]], stamps: BridgeStamps | SyncStamps) -> CycleFigures:
    """One warm-up cycle, then ``cycles`` measured; gives up after three failures."""
    figures = CycleFigures()
    for index in range(cycles + 1):
        try:
            await one_cycle(server, training, index, ready, stamps, figures if index else None)
        except (TimeoutError, asyncio.TimeoutError, RuntimeError) as error:
            figures.failures.append(f"cycle {index}: {error or type(error).__name__}; controller {training.state}")
            if len(figures.failures) >= 3:
                break
    return figures


async def one_cycle(server: FastClusterD, training: Any, index: int, ready: Callable[[int], Awaitable[None]],
                    stamps: BridgeStamps | SyncStamps, figures: CycleFigures | None) -> None:
    """One cycle; ``stamps``: the bridge's, or the synchronous client's."""
    with training.cond:  # the stub's log is per cycle
        training.events.clear()
        training.callback_durations.clear()
    stamps.clear()
    await server.dump()
    mark = len(server.events)
    # The fault comes from a thread of its own, a moment after the loop has gone back to
    # waiting: on a node the controller learns of a fault from a rank, never from the
    # bridge's event loop, which is then idle. Injected from the loop here, the loop (the
    # bridge's, realtime) would still be running the benchmark's own code while the
    # report travels, on a core the server needs.
    injector = threading.Timer(INJECT_DELAY, training.inject_fault, ({(index * 5 + 1) % CYCLE_WORLD: 0},))
    injector.start()
    done = await server.wait_event(lambda e: e.kind == "cycle-done", CYCLE_TIMEOUT, after=mark)
    if done.detail.get("code") != 0:
        raise RuntimeError(f"the result report carried code {done.detail.get('code')}, not 0")
    await ready(mark)
    if not await until(lambda: training.state == "NORMAL", CYCLE_TIMEOUT, POLL):
        raise RuntimeError(f"the controller is {training.state}, not back to NORMAL")
    received = await server.dump()
    if figures is None:
        return
    for label, callback, nth, rpc in REPORT_HOPS:
        calls = training.callbacks(callback)
        if len(calls) <= nth:
            raise RuntimeError(f"{len(calls)} {callback} callback(s)")
        at = calls[nth].t
        if callback == "report_strategies":
            # It may only leave once the 2nd fault report is answered (ClusterD's order):
            # the synchronous client's callback comes after that answer, the bridge's
            # before it; both hops count from the later of the two.
            fault_cb = training.callbacks("report_fault_ranks")[1].t
            answered = after(stamps.answered, "ReportProcessFault", fault_cb) if isinstance(stamps, BridgeStamps) else None
            at = max(at, answered or at)
        got = after(received, rpc, at)
        if got is None:
            raise RuntimeError(f"no {rpc} after the {callback} callback")
        figures.hops[label].append(got - at)
        called = calls[nth].t
        sent = after(stamps.wire, rpc, called)
        split = stamps.split(callback, rpc, called) if isinstance(stamps, BridgeStamps) else (
            {"cb->send": sent - called} if sent is not None else {})
        if sent is not None:
            split["wire->srv"] = got - sent
            started = after(stamps.started, rpc, sent)
            if started is not None:
                split["wire->started"], split["started->srv"] = started - sent, got - started
        for place, took in split.items():
            figures.split.setdefault(f"{callback} #{nth + 1} {place}", []).append(took)
    second = training.callbacks("report_fault_ranks")[1].t
    strategy = after(received, "ReportRecoverStrategy", second)
    assert strategy is not None
    figures.critical.append(strategy - second)


def _stream_reopened(server: FastClusterD) -> Callable[[int], Awaitable[int]]:
    async def reopened(mark: int) -> int:
        ended = await server.wait_event(lambda e: e.kind == "stream-end", CYCLE_TIMEOUT, after=mark)
        start = server.events.index(ended)
        opened = await server.wait_event(lambda e: e.kind == "stream-open", CYCLE_TIMEOUT, after=start)
        return int(opened.detail.get("stream", 0))
    return reopened


async def cycles_bridge(cycles: int) -> CycleFigures:
    job = SimulatedJob(SimJob(JOB, world_size=CYCLE_WORLD, devices_per_pod=4), keepalive_interval=1.0,
                       start_clusterd=False, controller_timings=FAST_TIMINGS)
    server = FastClusterD(job.config.clusterd.address, JOB, keepalive=CYCLE_KEEPALIVE)
    await server.start()
    await server.command("cycles on")
    try:
        await job.start()
        await job.subscribed()
        assert job.bridge is not None
        stamps = stamp_bridge(job)
        reopened = _stream_reopened(server)
        session = job.bridge.session

        async def ready(mark: int) -> None:
            await reopened(mark)
            count = session.stream_count
            if not await until(lambda: session.live.is_set() and session.stream_count >= count, CYCLE_TIMEOUT, POLL):
                raise RuntimeError("the bridge did not subscribe again")

        figures = await run_cycles(server, job.training, cycles, ready, stamps)
        return figures
    finally:
        await job.stop()
        await server.stop()


async def cycles_sync(cycles: int) -> CycleFigures:
    from bridge.sim import mindio_ttp
    from bridge.sim.mindio_ttp import controller_ttp as ttp

    server = FastClusterD(f"127.0.0.1:{free_port()}", JOB, keepalive=CYCLE_KEEPALIVE)
    await server.start()
    await server.command("cycles on")
    mindio_ttp.install()
    training = mindio_ttp.training
    training.reset()
    training.use_timings(FAST_TIMINGS)  # as for the bridge's job
    training.auto_step = True
    client = SyncClient(server.address, JOB)
    try:
        client.register()
        ttp.tft_init_controller(-1, CYCLE_WORLD, False, True, False)
        ttp.tft_start_controller("127.0.0.1", free_port(), False, "")
        training.connect_ranks(range(CYCLE_WORLD))
        client.start_reader()
        await server.wait_event(lambda e: e.kind == "stream-open", 10)
        reopened = _stream_reopened(server)

        async def ready(mark: int) -> None:
            # As for the bridge: the new stream has delivered its first message. Started
            # once the server saw the stream open, the client's cycles came ~0.1 s apart
            # and the bridge's ~1 s (the server's keep-alive then came after 1 s); with
            # the client paced like the bridge (two alternated pairs of runs), the cold
            # reports' wire -> server received gap between the two fell by 0.03-0.04 ms
            # at the median.
            opened = await reopened(mark)
            if not await until(lambda: client.streams_heard >= opened, CYCLE_TIMEOUT, POLL):
                raise RuntimeError("the synchronous client's new stream delivered nothing")

        stamps = SyncStamps(client.sent)
        for method in REPORT_METHODS:
            name = method.rsplit("/", 1)[1]
            stamp_call_start(getattr(client.report_stub.stub, name), name, stamps.started)
        figures = await run_cycles(server, training, cycles, ready, stamps)
        figures.failures += [f"client: {error}" for error in client.errors]
        return figures
    finally:
        await asyncio.to_thread(client.close)
        training.reset()
        await server.stop()


async def cycles_phase(loads: list[int], cycles: int, misses: list[str]) -> None:
    print(f"\nrecovery cycles (pure retry, {CYCLE_WORLD} ranks, stub controller) against the fast server playing "
          "the cycle: callback -> server received, per report")
    for load in loads:
        print(f"  {load} busy process(es)")
        bridge, sync = CycleFigures(), CycleFigures()
        with BusyProcesses(load):
            # In blocks, the two in turn: a machine's speed drifts over a minute (the
            # synchronous client's fault hop alone moved 0.44-0.83 ms between runs), and
            # one side measured entirely before the other would carry the drift.
            for block in _blocks(cycles):
                bridge.extend(await cycles_bridge(block))
                sync.extend(await cycles_sync(block))
        for label, *_ in REPORT_HOPS:
            print(f"    {label:<36} bridge {stats(bridge.hops[label], 1e-3, 'ms')}")
            print(f"    {'':<36} sync   {stats(sync.hops[label], 1e-3, 'ms')}")
            print(f"    {'':<36} {gap_line(bridge.hops[label], sync.hops[label])}")
            check_p50(f"cycles, {load} busy, {label}", bridge.hops[label], sync.hops[label], misses)
        print(f"    {CRITICAL:<36} bridge {stats(bridge.critical, 1e-3, 'ms')}")
        print(f"    {'':<36} sync   {stats(sync.critical, 1e-3, 'ms')}")
        print(f"    {'':<36} {gap_line(bridge.critical, sync.critical)}")
        for _, callback, nth, _ in REPORT_HOPS:  # in the cycle's order of reports, then the path's
            for name, figures, places in (("bridge", bridge, BridgeStamps.PLACES), ("sync", sync, SYNC_PLACES)):
                for place in (*places, *WIRE_PLACES):
                    label = f"{callback} #{nth + 1} {place}"
                    if label in figures.split:
                        print(f"      {name:<6} {label:<42} {stats(figures.split[label], 1e-3, 'ms')}")
        for name, figures in (("bridge", bridge), ("sync", sync)):
            for failure in figures.failures:
                print(f"    {name}: FAILED {failure}")
                misses.append(f"cycles, {load} busy, {name}: {failure}")
        if bridge.critical and sync.critical and pct(bridge.critical, 0.5) > pct(sync.critical, 0.5):
            misses.append(f"cycles, {load} busy, {CRITICAL}: p50 {pct(bridge.critical, 0.5) * 1e3:.3f} ms > sync "
                          f"{pct(sync.critical, 0.5) * 1e3:.3f} ms")


# --------------------------------------------------------------------------- targets

def check_p50(what: str, bridge: list[float], sync: list[float], misses: list[str]) -> None:
    if bridge and sync and pct(bridge, 0.5) > pct(sync, 0.5) + SLACK_P50:
        misses.append(f"{what}: p50 {pct(bridge, 0.5) * 1e3:.3f} ms > sync {pct(sync, 0.5) * 1e3:.3f} ms + 0.2 ms")


def check_p99(what: str, bridge: list[float], sync: list[float], load: int, misses: list[str]) -> None:
    if bridge and sync and pct(bridge, 0.99) > pct(sync, 0.99) + SLACK_P99:
        misses.append(f"{what}: p99 {pct(bridge, 0.99) * 1e3:.2f} ms > sync {pct(sync, 0.99) * 1e3:.2f} ms + 1 ms")
    if load == 2 and bridge and max(bridge) > LOADED_MAX:
        misses.append(f"{what}: max {max(bridge) * 1e3:.2f} ms > 20 ms with two busy processes")


def check_block(what: str, blocks: list[float], misses: list[str]) -> None:
    if blocks and pct(blocks, 0.99) > BLOCK_P99:
        misses.append(f"{what}: callback block p99 {pct(blocks, 0.99) * 1e6:.1f} us > 50 us")


def machine() -> str:
    return (f"{platform.node()}, {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
            f"load average {_loadavg()}")


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


async def main_async(args: argparse.Namespace) -> int:
    loads = [int(n) for n in args.loads.split(",")]
    sizes = [int(n) for n in args.sizes.split(",")]
    rounds = {size: args.rounds or (HOP_ROUNDS if size <= 1_000 else 30) // (4 if args.quick else 1)
              for size in sizes}
    misses: list[str] = []
    print(f"machine: {machine()}; load levels {loads} busy processes")
    if "hops" in args.phases:
        await hops_phase(loads, sizes, rounds, misses)
    if "signals" in args.phases:
        await signal_phase(loads, 20 if args.quick else 100, misses)
    if "cycles" in args.phases:
        await cycles_phase(loads, args.cycles or (CYCLES_QUICK if args.quick else CYCLES), misses)
    print(f"\nload average after: {_loadavg()}")
    if misses:
        print("targets MISSED:\n  " + "\n  ".join(misses))
        return 1
    print("targets met: block p99 <= 50 us; report hops p50 <= sync p50 + 0.2 ms and p99 <= sync p99 + 1 ms; "
          "signal -> notify p99 <= sync p99 + 1 ms; max <= 20 ms at two busy processes; critical path p50 <= sync p50")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the rounds and cycles")
    parser.add_argument("--loads", default="0,2", help="busy-process counts (default 0,2)")
    parser.add_argument("--sizes", default="16,1000", help="fault-map sizes of the hops phase")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per load and size in the hops phase "
                        f"(default {HOP_ROUNDS}, 30 above 1 000 ranks; a quarter with --quick)")
    parser.add_argument("--cycles", type=int, default=0, help="measured cycles per load and client (default "
                        f"{CYCLES}, {CYCLES_QUICK} with --quick)")
    parser.add_argument("--phases", default="hops,signals,cycles", help="any of hops, signals, cycles")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
