"""The report wire (bridge/job/reports/relay.py): one thread owns the outbox and the report channel.

The behaviours the outbox, the report lane and the chained calls were held to, on the
one component that replaces them: callback order, one call at a time, the next report
the moment the one before answered code 0 (the event loop held still meanwhile), never
a resend after code 0, cycle-bound reports dropped when their cycle is gone, fault
reports waiting for a live stream and merging, ``settle`` before a Subscribe, and the
loop's bookkeeping before it reacts to ClusterD.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import pytest
from concurrent import futures
from types import SimpleNamespace

from bridge import faults as codec
from bridge._proto import recover_pb2 as pb
from bridge.core.backoff import Backoff
from bridge.job.session.codes import Code
from bridge.job.metrics import BridgeMetrics
from bridge.sim.scenario import free_port
from bridge.job.reports import relay as wire_module
from bridge.job.cycle_state import Cycles, CycleState, Rebound
from bridge.job.reports.kinds import report_of
from bridge.job.reports.relay import ReportInbox, Taken

from .conftest import eventually, eventually_sync, recover_server
from .wire_rig import NoRpcs, WireRig


JOB = "job-wire"


class ClusterD:
    """The four Report* methods on a synchronous server: each request is logged (its
    method, and its bytes in ``requests``); the fault report waits for ``release`` and
    answers what ``fault_answers`` says next (a code, or a gRPC status to abort with)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.requests: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.fault_answers: list[int | grpc.StatusCode] = []
        self.gated = {"ReportProcessFault"}  # the methods that wait for ``release``

    def handler(self, name: str) -> Callable[[bytes, Any], bytes]:
        def answer(request: bytes, context: Any) -> bytes:
            with self.lock:
                self.log.append(name)
                self.requests.append((name, request))
            if name in self.gated:
                self.release.wait(30)
            if name == "ReportProcessFault":
                outcome = self.fault_answers.pop(0) if self.fault_answers else Code.OK
                if isinstance(outcome, grpc.StatusCode):
                    context.abort(outcome, "refused by the test")
                return pb.Status(code=outcome).SerializeToString()
            return pb.Status(code=Code.OK).SerializeToString()

        return answer

    def seen(self, name: str) -> int:
        with self.lock:
            return self.log.count(name)

    def strategies_offered(self) -> list[list[str]]:
        """The strategies of each ReportRecoverStrategy request, in order."""
        with self.lock:
            return [list(pb.RecoverStrategyRequest.FromString(request).strategies)
                    for name, request in self.requests if name == "ReportRecoverStrategy"]


@pytest.fixture
async def clusterd() -> AsyncIterator[tuple[ClusterD, str]]:
    fake = ClusterD()
    names = ("ReportProcessFault", "ReportStopComplete", "ReportRecoverStrategy", "ReportRecoverStatus")
    handlers = {name: grpc.unary_unary_rpc_method_handler(fake.handler(name)) for name in names}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("Recover", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        fake.release.set()
        server.stop(None)


LIVE = Cycles(live=True, running="uuid-1", stream="stream:1", answering="uuid-1")


def retry_later() -> Backoff:
    """A retry long after the test: a fault report that failed stays at the outbox's head."""
    return Backoff(30.0, 30.0)


@dataclass
class Listener:
    """The loop's side, recorded."""

    taken: list[Taken] = field(default_factory=list)
    drops: list[tuple[str, str | None, str]] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    rpcs: list[tuple[str, object]] = field(default_factory=list)
    reports_before_rpc: list[int] = field(default_factory=list)  # how many reports the loop had at each RPC told
    reports_before_drop: list[int] = field(default_factory=list)  # ... at each drop told
    delivered: list[dict[int, int]] = field(default_factory=list)  # fault reports ClusterD answered 0

    def taken_(self, reports: list[Taken]) -> None:
        self.taken.extend(reports)

    def dropped(self, kind: str, cycle: str | None, reason: str) -> None:
        self.drops.append((kind, cycle, reason))
        self.reports_before_drop.append(len(self.taken))

    def outcome_unknown(self, kind: str) -> None:
        self.unknown.append(kind)

    def faults_delivered(self, faults: dict[int, int], at: float) -> None:
        self.delivered.append(faults)

    def observe_rpc(self, method: str, code: int | str, started: float, seconds: float) -> None:
        self.rpcs.append((method, code))
        self.reports_before_rpc.append(len(self.taken))


class _Adapter:
    def __init__(self, listener: Listener) -> None:
        self.l = listener
        self.taken = listener.taken_
        self.dropped = listener.dropped
        self.outcome_unknown = listener.outcome_unknown
        self.faults_delivered = listener.faults_delivered


@asynccontextmanager
async def running_wire(address: str, cycles: Cycles = LIVE, limit: int = 10_000, rpc_timeout: float = 10.0,
                       metrics: BridgeMetrics | None = None, channel: grpc.Channel | None = None,
                       backoff: Backoff | None = None) -> AsyncIterator[tuple[WireRig, Listener]]:
    listener = Listener()
    channel = channel or grpc.insecure_channel(address)
    wire = WireRig(JOB, channel, asyncio.get_running_loop(), _Adapter(listener), metrics or BridgeMetrics(),  # type: ignore[arg-type]
                   rpcs=listener, rpc_timeout=rpc_timeout, backoff=backoff or Backoff(0.01, 0.02), limit=limit)
    wire.publish(cycles)
    wire.start()
    try:
        yield wire, listener
    finally:
        await asyncio.to_thread(wire.stop, 5.0)


def callback(wire: WireRig | ReportInbox, name: str, *args: object) -> Future[int]:
    """A callback's put from a thread of its own, as the controller's; its outcome."""
    waiter: Future[int] = Future()
    thread = threading.Thread(target=wire.put, args=(report_of(name, args, time.monotonic(), waiter),))
    thread.start()
    thread.join(5)
    return waiter


async def test_the_strategies_report_leaves_the_moment_the_fault_report_answers_with_the_loop_held(
        clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    async with running_wire(address) as (wire, listener):
        fault = callback(wire, "report_fault_ranks", {3: 0}, {})
        eventually_sync(lambda: fake.seen("ReportProcessFault") == 1, 10, "the fault report on the wire")
        strategies = callback(wire, "report_strategies", {3: 0}, ["retry", "exit"])
        assert fake.seen("ReportRecoverStrategy") == 0  # never beside the fault report
        fake.release.set()
        # The event loop is held still (no await): the wire sends the strategies by itself.
        eventually_sync(lambda: fake.seen("ReportRecoverStrategy") == 1, 10, "the strategies after the answer")
        assert fake.log == ["ReportProcessFault", "ReportRecoverStrategy"]
        assert fault.result(5) == Code.OK and strategies.result(5) == Code.OK
        await eventually(lambda: len(listener.taken) == 2, what="the loop told, in callback order")
        assert [t.report.callback for t in listener.taken] == ["report_fault_ranks", "report_strategies"]
        assert listener.taken[1].cycle == "uuid-1"


async def test_the_loop_takes_what_the_wire_took_before_it_reacts(clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    fake.release.set()
    async with running_wire(address) as (wire, listener):
        callback(wire, "report_stop_complete", 0, "ok", {})
        eventually_sync(lambda: fake.seen("ReportStopComplete") == 1, 10, "the stop-complete sent")
        wire.catch_up()  # what Session does before it handles ClusterD's next message
        assert [t.report.callback for t in listener.taken] == ["report_stop_complete"]


async def test_a_report_clusterd_has_is_the_loops_before_it_reacts_to_the_answer_and_only_once(
        clusterd: tuple[ClusterD, str]) -> None:
    """ClusterD may send its answer to a report on the stream before the report's own
    call returns (the changeStrategy right behind the strategies report): once ClusterD
    has the report, catching up must hand it to the loop, or the dispatcher meets the
    answer with the flow at global_sent and refuses it as unexpected_step, and the
    controller, never told, gives the job up (seen on the real peers with a design that
    handed reports over by a posted run). The wire's own hand-over afterwards adds nothing."""
    fake, address = clusterd
    fake.gated = {"ReportRecoverStrategy"}  # ClusterD holds the call: its answer comes by the stream
    async with running_wire(address) as (wire, listener):
        callback(wire, "report_fault_ranks", {3: 0}, {})
        strategies = callback(wire, "report_strategies", {3: 0}, ["retry", "exit"])
        # The event loop is held still (no await): only catching up can hand reports over.
        eventually_sync(lambda: fake.seen("ReportRecoverStrategy") == 1, 10, "ClusterD has the strategies")
        wire.catch_up()  # what Session does before it handles ClusterD's changeStrategy
        assert [t.report.callback for t in listener.taken] == ["report_fault_ranks", "report_strategies"]
        fake.release.set()
        assert await asyncio.wrap_future(strategies) == Code.OK
        await eventually(wire.handed_all, what="the wire idle, everything handed over")
        idle = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon_threadsafe(idle.set_result, None)  # after the wire's posted runs
        await idle
        assert [t.report.callback for t in listener.taken] == ["report_fault_ranks", "report_strategies"]


async def test_the_loop_has_a_report_before_it_learns_of_its_rpc(clusterd: tuple[ClusterD, str]) -> None:
    """An RPC's answer is ClusterD's, so the loop takes the reports first: the flight
    recorder closes a cycle on the ReportRecoverStatus call only once it has the result
    report (told the call first, it left the cycle open for its grace, and the real-peer
    scenarios read no outcome)."""
    fake, address = clusterd
    fake.release.set()
    async with running_wire(address) as (wire, listener):
        assert await asyncio.wrap_future(callback(wire, "report_result", 0, "ok", {}, "retry")) == Code.OK
        await eventually(lambda: listener.rpcs == [("ReportRecoverStatus", 0)], what="the RPC told")
        assert listener.reports_before_rpc == [1]


async def test_a_fault_report_waits_for_a_live_stream_and_merges_meanwhile(clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    fake.release.set()
    async with running_wire(address, Cycles()) as (wire, listener):
        first, second = callback(wire, "report_fault_ranks", {1: 0}, {}), callback(wire, "report_fault_ranks", {2: 2}, {})
        await eventually(lambda: len(wire) == 1, what="one merged report queued")
        assert fake.seen("ReportProcessFault") == 0
        wire.publish(LIVE)
        assert await asyncio.wrap_future(first) == Code.OK and await asyncio.wrap_future(second) == Code.OK
        assert fake.seen("ReportProcessFault") == 1


async def test_reports_of_a_cycle_that_is_over_never_leave(clusterd: tuple[ClusterD, str]) -> None:
    """The strategies and the result wait behind a fault report to be retried; their
    cycle ends meanwhile: both are dropped, in their order, and never sent."""
    fake, address = clusterd
    fake.release.set()
    fake.fault_answers = [grpc.StatusCode.UNAVAILABLE]  # not delivered: retried, long after
    async with running_wire(address, backoff=retry_later()) as (wire, listener):
        callback(wire, "report_fault_ranks", {3: 0}, {})
        eventually_sync(lambda: fake.seen("ReportProcessFault") == 1, 10, "the fault report's first try")
        strategies = callback(wire, "report_strategies", {3: 0}, ["retry", "exit"])
        result = callback(wire, "report_result", 0, "ok", {}, "retry")
        await eventually(lambda: len(wire) == 3, what="the strategies and the result queued behind the fault report")
        wire.publish(Cycles(live=True, running="uuid-2", stream="stream:1", answering="uuid-1"))  # uuid-1 is over
        assert await asyncio.wrap_future(strategies) == Code.OrderMix
        assert await asyncio.wrap_future(result) == Code.OrderMix
        await eventually(lambda: len(listener.drops) == 2, what="both drops told")
        assert listener.drops == [("strategy", "uuid-1", "cycle_ended"), ("result", "uuid-1", "cycle_ended")]
        assert fake.log == ["ReportProcessFault"]


#: ClusterD's new cycle uuid-2, rebound at GLOBAL_SENT: its globalFault named rank 9 beside the controller's 3.
REBOUND = Cycles(live=True, running="uuid-2", stream="stream:1", answering="uuid-2",
                 rebound=Rebound("uuid-2", frozenset({3, 9})))


async def test_a_rebound_cycles_strategies_leave_narrowed_from_the_wire_alone_with_the_loop_held(
        clusterd: tuple[ClusterD, str]) -> None:
    """The controller's strategies for ranks it offered, answering a cycle whose globalFault
    named rank 9 too: the wire sends exit and dump only, by itself, the moment it takes
    the report; the loop learns afterwards what was sent."""
    fake, address = clusterd
    async with running_wire(address, REBOUND) as (wire, listener):
        strategies = callback(wire, "report_strategies", {3: 0}, ["retry", "dump", "exit"])
        # The event loop is held still (no await): only the wire's thread can send it.
        eventually_sync(lambda: fake.seen("ReportRecoverStrategy") == 1, 10, "the narrowed strategies sent")
        assert fake.requests == [("ReportRecoverStrategy",
                                  codec.encode_recover_strategy_request(JOB, {3: 0}, ["dump", "exit"]))]
        assert strategies.result(5) == Code.OK
        await eventually(lambda: len(listener.taken) == 1, what="the loop told")
        taken = listener.taken[0]
        assert (taken.cycle, taken.strategies, taken.offered) == ("uuid-2", ["retry", "dump", "exit"], ["dump", "exit"])
        assert taken.beyond == {9}


async def test_strategies_of_another_cycle_or_naming_no_rank_beyond_leave_as_the_controller_offered(
        clusterd: tuple[ClusterD, str]) -> None:
    """A report made before the rebind answers the cycle before it, even when the wire
    takes it after the rebind was published: never narrowed. One answering the rebound
    cycle for every rank its globalFault named: not narrowed either."""
    fake, address = clusterd
    async with running_wire(address) as (wire, listener):
        callback(wire, "report_fault_ranks", {3: 0}, {})  # holds the wire: the server waits for release
        eventually_sync(lambda: fake.seen("ReportProcessFault") == 1, 10, "the fault report on the wire")
        before = callback(wire, "report_strategies", {3: 0}, ["retry", "dump", "exit"])  # answers uuid-1
        wire.publish(Cycles(live=True, running="uuid-1", stream="stream:1", answering="uuid-2",
                            rebound=Rebound("uuid-2", frozenset({3, 9}))))
        fake.release.set()
        assert await asyncio.wrap_future(before) == Code.OK
        wire.publish(REBOUND)
        every_rank = callback(wire, "report_strategies", {3: 0, 9: 0}, ["retry", "dump", "exit"])
        assert await asyncio.wrap_future(every_rank) == Code.OK
        assert fake.strategies_offered() == [["retry", "dump", "exit"], ["retry", "dump", "exit"]]
        await eventually(lambda: len(listener.taken) == 3, what="the loop told")
        assert [(t.cycle, t.offered, bool(t.beyond)) for t in listener.taken[1:]] == [
            ("uuid-1", ["retry", "dump", "exit"], False), ("uuid-2", ["retry", "dump", "exit"], False)]


@pytest.mark.parametrize("named", [{3: 1, 9: 1}, {3: 1}], ids=["beyond", "within"])
async def test_the_loop_counts_and_logs_exactly_what_the_wire_sent(
        clusterd: tuple[ClusterD, str], named: dict[int, int], caplog: pytest.LogCaptureFixture) -> None:
    """The parts as the daemon builds them (``assembly.Link``): the resume rebinds the new
    cycle's globalFault at GLOBAL_SENT; the controller's strategies then leave from the
    wire (narrowed when the globalFault named rank 9 beyond them), and the loop's
    bookkeeping counts ``answered_without_repair`` and logs the operators' line exactly
    when the request it was told of was narrowed, and clears the rebound cycle."""
    from bridge.job.reports.controller_flow import ControllerFlow, Step
    from bridge.job.reports.ledger import ReportPath
    from bridge.job.reports.relay import Wire
    from bridge.job.session.resume import RESUMED

    fake, address = clusterd
    fake.release.set()
    metrics, flow, inbox = BridgeMetrics(), ControllerFlow(), ReportInbox()
    cycles = CycleState(flow, inbox.wake)
    path = ReportPath(JOB, flow, inbox, cycles, metrics)
    wire = Wire(JOB, grpc.insecure_channel(address), asyncio.get_running_loop(), inbox, cycles, path, NoRpcs(),
                metrics, rpc_timeout=10.0, backoff=Backoff(0.01, 0.02))
    cycles.stream_opening(lambda: None)
    cycles.subscribe_sent()
    cycles.heard("uuid-2")
    flow.step = Step.GLOBAL_SENT  # the controller had on_global_rank; ClusterD's job was reset since
    path.resume.pending = "global"
    assert path.resume.intercept("on_global_rank", named, "uuid-2") == RESUMED
    assert cycles.snapshot.rebound == Rebound("uuid-2", frozenset(named)) and cycles.snapshot.answering == "uuid-2"
    wire.start()
    try:
        strategies = callback(inbox, "report_strategies", {3: 0}, ["retry", "dump", "exit"])
        assert await asyncio.wrap_future(strategies) == Code.OK
        await eventually(wire.handed_all, what="the report handed to the loop")
        await eventually(lambda: path.resume.rebound_global is None, what="the loop's bookkeeping done")
    finally:
        await asyncio.to_thread(wire.stop, 5.0)
    narrowed = 9 in named
    assert fake.strategies_offered() == [["dump", "exit"] if narrowed else ["retry", "dump", "exit"]]
    assert metrics.sample("tft_bridge_cycle_resumes_total", {"result": "answered_without_repair"}) == narrowed
    lines = [r.getMessage() for r in caplog.records if "did not offer its strategies for" in r.getMessage()]
    assert lines == ([("the new cycle's globalFault (uuid-2) names 1 rank(s) the controller did not offer its "
                       "strategies for (e.g. [9]) and cannot be told of now: a repair would hang on them, so the "
                       "cycle is offered ['dump', 'exit'] only")] if narrowed else [])
    assert cycles.snapshot.rebound is None and flow.step is Step.AWAIT_STRATEGY


async def test_a_report_bound_to_no_live_cycle_is_dropped_at_once(clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    async with running_wire(address, Cycles(live=True, running="uuid-1", stream="stream:1", answering=None)) as (
            wire, listener):
        assert await asyncio.wrap_future(callback(wire, "report_stop_complete", 0, "", {})) == Code.OrderMix
        await eventually(lambda: listener.drops == [("stop_complete", None, "no_live_cycle")], what="the drop told")
        assert fake.seen("ReportStopComplete") == 0
        assert listener.reports_before_drop == [1], "the loop learnt of the drop before of the report"


async def test_settle_waits_for_the_cycle_report_on_the_wire(clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    async with running_wire(address) as (wire, listener):
        callback(wire, "report_fault_ranks", {3: 0}, {})  # holds the wire: the server waits for release
        callback(wire, "report_stop_complete", 0, "", {})
        eventually_sync(lambda: fake.seen("ReportProcessFault") == 1, 10, "the fault report on the wire")
        assert await wire.settle(0.05)  # the stop-complete waits behind it: nothing cycle-bound out
        fake.release.set()
        await eventually(lambda: fake.seen("ReportStopComplete") == 1, what="the stop-complete sent")
        assert await wire.settle(5.0)


async def test_a_report_answers_the_cycle_of_its_callback_not_the_one_current_when_the_wire_takes_it(
        clusterd: tuple[ClusterD, str]) -> None:
    """The controller reports stop-complete for uuid-1 while the wire is busy; ClusterD
    replaces the cycle (uuid-2) before the wire takes the report: it is dropped, never sent
    into uuid-2's one-slot buffer before the controller stopped for uuid-2."""
    fake, address = clusterd
    async with running_wire(address) as (wire, listener):
        callback(wire, "report_fault_ranks", {3: 0}, {})  # holds the wire: the server waits for release
        eventually_sync(lambda: fake.seen("ReportProcessFault") == 1, 10, "the fault report on the wire")
        stop_complete = callback(wire, "report_stop_complete", 0, "", {})  # answers uuid-1
        wire.publish(Cycles(live=True, running="uuid-2", stream="stream:1", answering="uuid-2"))
        fake.release.set()
        assert await asyncio.wrap_future(stop_complete) == Code.OrderMix  # the caller learns it first ...
        await eventually(lambda: listener.drops == [("stop_complete", "uuid-1", "no_live_cycle")],
                         what="the drop told")  # ... the loop once the wire has handed the report over
        assert fake.seen("ReportStopComplete") == 0


async def test_a_fault_report_ranks_are_never_lost_past_the_bound(clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    async with running_wire(address, Cycles(), limit=2) as (wire, listener):
        waiters = [callback(wire, "report_fault_ranks", {rank: 0}, {}) for rank in range(5)]
        await eventually(lambda: len(wire) == 1, what="merged into one")
        fake.release.set()
        wire.publish(LIVE)
        assert [await asyncio.wrap_future(w) for w in waiters] == [Code.OK] * 5


async def test_a_malformed_report_is_handed_to_the_loop_and_never_sent(clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    fake.release.set()
    async with running_wire(address) as (wire, listener):
        callback(wire, "report_stop_complete", "not a code", "", {})
        await eventually(lambda: len(listener.taken) == 1, what="the loop told")
        assert "status code" in listener.taken[0].problem
        assert fake.seen("ReportStopComplete") == 0


async def test_the_strategies_report_waits_for_its_fault_report_to_be_retried_and_answered(
        clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    fake.fault_answers = [grpc.StatusCode.UNAVAILABLE]  # the first try fails: a fault report is retried
    async with running_wire(address) as (wire, listener):
        callback(wire, "report_fault_ranks", {3: 0}, {})
        eventually_sync(lambda: fake.seen("ReportProcessFault") == 1, 10, "the fault report on the wire")
        strategies = callback(wire, "report_strategies", {3: 0}, ["retry", "exit"])
        fake.release.set()
        assert await asyncio.wrap_future(strategies) == Code.OK
        assert fake.log == ["ReportProcessFault", "ReportProcessFault", "ReportRecoverStrategy"]


async def test_a_full_outbox_drops_the_oldest_waiting_cycle_report_never_the_head(
        clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    fake.release.set()
    fake.fault_answers = [grpc.StatusCode.UNAVAILABLE]  # the head stays: retried, long after
    async with running_wire(address, limit=2, backoff=retry_later()) as (wire, listener):
        callback(wire, "report_fault_ranks", {3: 0}, {})
        eventually_sync(lambda: fake.seen("ReportProcessFault") == 1, 10, "the fault report's first try")
        first = callback(wire, "report_result", 0, "ok", {}, "retry")
        second = callback(wire, "report_result", 0, "ok", {}, "retry")
        assert await asyncio.wrap_future(first) == Code.EventQueueBusy
        await eventually(lambda: listener.drops == [("result", "uuid-1", "outbox_full")], what="the drop told")
        assert len(wire) == 2 and not second.done()


@pytest.fixture
async def clusterd_that_never_answers() -> AsyncIterator[str]:
    """A server whose ReportStopComplete never returns: only the deadline ends the call."""
    release = asyncio.Event()

    async def report(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await release.wait()
        return pb.Status(code=0).SerializeToString()

    async with recover_server("ReportStopComplete", report) as address:
        try:
            yield address
        finally:
            release.set()


async def test_a_report_that_reached_a_server_that_never_answers_is_dropped_at_its_deadline_never_resent(
        clusterd_that_never_answers: str) -> None:
    metrics = BridgeMetrics()
    async with running_wire(clusterd_that_never_answers, rpc_timeout=0.5, metrics=metrics) as (wire, listener):
        outcome = callback(wire, "report_stop_complete", 0, "", {})
        assert await asyncio.wrap_future(outcome) == Code.ServerInnerError
        await eventually(lambda: listener.unknown == ["stop_complete"], what="the unknown outcome told")
        assert listener.drops == [("stop_complete", "uuid-1", "outcome_unknown_deadline_exceeded")]
        assert metrics.sample("tft_bridge_clusterd_rpcs_total",
                              {"method": "ReportStopComplete", "code": "DEADLINE_EXCEEDED"}) == 1
        assert len(wire) == 0


async def test_a_report_to_nobody_provably_never_arrived_and_waits_to_be_sent() -> None:
    metrics = BridgeMetrics()
    async with running_wire(f"127.0.0.1:{free_port()}", rpc_timeout=2.0, metrics=metrics) as (wire, listener):
        outcome = callback(wire, "report_stop_complete", 0, "", {})
        await eventually(lambda: metrics.sample("tft_bridge_clusterd_rpcs_total",
                                                {"method": "ReportStopComplete", "code": "UNAVAILABLE"}) >= 2,
                         what="the report retried")
        assert not outcome.done() and listener.drops == [] and len(wire) == 1


async def test_settle_waits_while_a_cycle_report_is_on_the_wire(clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    fake.gated = {"ReportStopComplete"}
    async with running_wire(address) as (wire, listener):
        assert await wire.settle(0.1)  # nothing on the wire yet
        callback(wire, "report_stop_complete", 0, "", {})
        eventually_sync(lambda: fake.seen("ReportStopComplete") == 1, 10, "the report on the wire")
        assert not await wire.settle(0.05)  # still on the wire: not settled
        settled = asyncio.create_task(wire.settle(5.0))
        await asyncio.sleep(0)  # the behaviour under test: settle must still be waiting here
        assert not settled.done()
        fake.release.set()
        assert await settled


async def test_the_wire_is_realtime_from_the_write_until_it_waits_for_callbacks_again(
        clusterd: tuple[ClusterD, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Promoted once the request is written (ClusterD can read it: promoted before the
    write, a realtime writer kept ClusterD's receiving thread off its CPU), on the wire's
    own thread, and back under SCHED_BATCH before it waits for the next callback (whose
    wake-up must never preempt the controller's thread)."""
    fake, address = clusterd
    fake.release.set()
    events: list[tuple[str, int]] = []
    calling = threading.Event()

    def promote(priority: int, thread: str) -> bool:
        if calling.is_set():
            # Blocks the call until ClusterD has the request: were it run before the write,
            # ClusterD would never see it and this would give up after 10 s.
            eventually_sync(lambda: fake.seen("ReportStopComplete") == 1, 10, "ClusterD has the request")
        events.append(("promote", threading.get_ident()))
        return True

    monkeypatch.setattr("bridge.job.reports.relay.realtime.promote", promote)
    monkeypatch.setattr("bridge.job.reports.relay.realtime.batch_policy", lambda: events.append(("batch", threading.get_ident())) or True)
    async with running_wire(address) as (wire, listener):
        assert wire.wire.after_send, "this grpcio has no channel object to wrap: the wire is promoted before the write"
        me = wire.wire._thread.ident
        # Whether it may run realtime is known at its start; it then waits under SCHED_BATCH.
        await eventually(lambda: events == [("promote", me), ("batch", me)], what="the wire waiting under SCHED_BATCH")
        assert wire.wire.realtime
        calling.set()
        assert await asyncio.wrap_future(callback(wire, "report_stop_complete", 0, "", {})) == Code.OK
        await eventually(lambda: len(events) == 4, what="back under SCHED_BATCH")
        assert events[2:] == [("promote", me), ("batch", me)]


async def test_a_report_that_is_never_sent_never_promotes_the_wire(
        clusterd: tuple[ClusterD, str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake, address = clusterd
    promoted: list[int] = []
    monkeypatch.setattr("bridge.job.reports.relay.realtime.promote", lambda priority, thread: promoted.append(priority) or True)
    async with running_wire(address) as (wire, listener):
        await eventually(lambda: wire.wire.batch_policy, what="the wire started")
        callback(wire, "report_stop_complete", "not a code", "", {})  # malformed: not sent
        await eventually(lambda: len(listener.taken) == 1, what="the loop told")
        assert len(promoted) == 1 and fake.log == []  # the start's probe only


async def test_a_fault_map_with_a_bad_entry_goes_out_without_it_and_the_loop_counts_it(
        clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    fake.release.set()
    async with running_wire(address) as (wire, listener):
        assert await asyncio.wrap_future(callback(wire, "report_fault_ranks", {1: 0, -5: 0}, {})) == Code.OK
        await eventually(lambda: len(listener.taken) == 1, what="the loop told")
        (taken,) = listener.taken
        assert taken.cleaned.faults == {1: 0} and taken.cleaned.bad == 1 and taken.cleaned.error and not taken.problem


async def test_back_to_back_callbacks_lose_no_report(clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    fake.release.set()
    async with running_wire(address) as (wire, listener):
        waiters: list[Future[int]] = []

        def controller() -> None:  # one thread, callback after callback
            for rank in range(200):
                waiter: Future[int] = Future()
                waiters.append(waiter)
                wire.put(report_of("report_fault_ranks", ({rank: 0},), time.monotonic(), waiter))

        await asyncio.to_thread(controller)
        assert [await asyncio.wrap_future(w) for w in waiters] == [Code.OK] * 200
        await eventually(lambda: len(listener.taken) == 200, what="every report handed to the loop")
        assert [t.report.faults for t in listener.taken] == [{rank: 0} for rank in range(200)]
        assert 1 <= fake.seen("ReportProcessFault") <= 200  # merged while one was on the wire


def test_the_loop_answers_a_malformed_report_499_and_counts_it() -> None:
    from bridge.job.reports.controller_flow import ControllerFlow
    from bridge.job.reports.ledger import ReportPath

    metrics = BridgeMetrics()
    flow = ControllerFlow()
    inbox = ReportInbox()
    path = ReportPath(JOB, flow, inbox, CycleState(flow, inbox.wake), metrics)
    waiter: Future[int] = Future()
    report = report_of("report_stop_complete", ("not a code", "", {}), 0.0, waiter)
    path.taken([Taken(report, "uuid-1", codec.CleanFaults({}, 0, ""), [],
                      "status code must be an int, got 'not a code'", [], frozenset())])
    assert waiter.result(0) == Code.ClientError
    assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "controller_report_stop_complete"}) == 1


async def test_the_wire_looks_at_its_connectivity_itself_and_counts_a_loss_while_idle(
        clusterd: tuple[ClusterD, str]) -> None:
    """gRPC's ``Channel.subscribe`` keeps a thread re-arming a 0.2 s watch, each with a
    timer in gRPC's event engine, for as long as anyone is subscribed: it woke an idle
    bridge more than MindCluster's whole synchronous client. The wire never subscribes:
    it connects before the first report, and a connection that ClusterD closes while
    the wire waits (here its server stops) is still logged and counted."""
    fake, address = clusterd
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    subscribed: list[object] = []
    channel.subscribe = lambda *args, **kwargs: subscribed.append(args)  # type: ignore[method-assign]
    metrics = BridgeMetrics()
    lost = lambda: metrics.sample("tft_bridge_clusterd_connection_lost_total", {"channel": "report"})  # noqa: E731
    try:
        async with running_wire(address, metrics=metrics, channel=channel) as (wire, listener):
            await eventually(lambda: wire.wire._ready, what="connected before any report")
            assert lost() == 0
            server.stop(None)
            await eventually(lambda: lost() == 1, timeout=10 * wire_module.CONNECTIVITY_LOOK,
                             what="the idle channel's lost connection counted")
            assert not wire.wire._ready
        assert subscribed == []
        assert wire_module.CONNECTIVITY_LOOK >= 1.0  # an idle wake-up a second at most
    finally:
        server.stop(None)


async def test_without_the_private_check_the_wire_falls_back_to_grpcs_subscription(
        clusterd: tuple[ClusterD, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A grpcio whose channel cannot be asked (lowlevel's guard test fails there) still
    gets the connectivity the delivery rules need, from gRPC's own subscription."""
    fake, address = clusterd
    fake.release.set()
    monkeypatch.setattr(wire_module.grpc_internals, "connectivity_check", lambda channel: None)
    async with running_wire(address) as (wire, listener):
        await eventually(lambda: wire.wire._ready, what="connected, told by gRPC's connectivity thread")
        assert callback(wire, "report_stop_complete", 0, "ok", {}).result(10) == Code.OK


class _MadeCallables:
    """A real channel that records every method a callable is made for."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._inner = channel
        self.made: list[str] = []

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.made.append(method)
        return self._inner.unary_unary(method, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_the_wire_makes_its_four_callables_before_the_first_report(clusterd: tuple[ClusterD, str]) -> None:
    """Made inside a job's first report of each kind, a callable held that report back
    on the real peers: the wire makes all four as it starts, and none while it reports."""
    from bridge.job.reports.kinds import REPORT_METHODS

    fake, address = clusterd
    fake.release.set()
    channel = _MadeCallables(grpc.insecure_channel(address))
    try:
        async with running_wire(address, channel=channel) as (wire, listener):  # type: ignore[arg-type]
            await eventually(lambda: wire.handed_all(), what="the wire waiting for its first callback")
            assert sorted(channel.made) == sorted(REPORT_METHODS) and fake.log == []
            assert await asyncio.wrap_future(callback(wire, "report_stop_complete", 0, "ok", {})) == Code.OK
            assert await asyncio.wrap_future(callback(wire, "report_fault_ranks", {1: 0}, {})) == Code.OK
            assert sorted(channel.made) == sorted(REPORT_METHODS)  # none made on the way
    finally:
        channel._inner.close()
