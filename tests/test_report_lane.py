"""The report lane (bridge/fastlane.py): a report goes from the hand-off thread to the
report thread before the event loop when the outbox is idle, and the outbox's rules
still hold: callback order, a failure retried, code 0 never resent, nothing sent while
no stream is live, a cycle-bound report only for the live cycle, bad entries and
malformed reports the loop's to count, the same bytes as the loop would send."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from bridge.codes import Code
from bridge.fastlane import LANE_MAX_RANKS, ReportLane, request
from bridge.flow import ControllerFlow
from bridge.metrics import BridgeMetrics
from bridge.relay import Relay
from bridge.reports import ControllerReport, Handoff, ReportPath

from .conftest import eventually, eventually_sync
from .test_report_chain import CYCLE, JOB, ClusterD, OneCycle, clusterd, running_outbox  # noqa: F401 - the fixture


@dataclass
class Bridge:
    fake: ClusterD
    relay: Relay
    session: OneCycle
    metrics: BridgeMetrics
    flow: ControllerFlow
    lane: ReportLane
    handoff: Handoff

    def callback(self, faults: object) -> None:
        """What the controller's report_fault_ranks callback puts (controller.make_callback)."""
        self.handoff.put(("report_fault_ranks", (faults,), 0.0, None))


@pytest.fixture(params=[True, False], ids=["lane", "no-lane"])
async def bridge(request: pytest.FixtureRequest, clusterd: tuple[ClusterD, str]) -> AsyncIterator[Bridge]:  # noqa: F811
    fake, address = clusterd
    async with running_outbox(address) as running:
        relay, session = running.relay, running.session
        flow = ControllerFlow()
        reports = ReportPath(JOB, flow, relay, running.metrics)
        loop = asyncio.get_running_loop()
        lane = ReportLane(JOB, relay, session, running.client, loop, flow)  # type: ignore[arg-type]
        handoff = Handoff(loop, reports.handle, pin_cpu=False, lane=lane if request.param else None)
        try:
            yield Bridge(fake, relay, session, running.metrics, flow, lane, handoff)
        finally:
            handoff.close()


def with_lane(bridge: Bridge) -> bool:
    return bridge.handoff.lane is not None


async def test_a_fault_report_reaches_clusterd_while_the_event_loop_is_held(bridge: Bridge) -> None:
    bridge.fake.release.set()
    bridge.callback({5: 0})
    # The loop is held still (a blocking wait on its own thread): only the lane can send it.
    sent = True
    try:
        eventually_sync(lambda: bridge.fake.seen("ReportProcessFault") == 1, 3, what="the fault report sent")
    except AssertionError:
        sent = False
    assert sent is with_lane(bridge)
    await eventually(lambda: bridge.fake.seen("ReportProcessFault") == 1 and len(bridge.relay) == 0, 10,
                     "the report answered and adopted")
    await asyncio.sleep(0.05)  # the behaviour under test: code 0 is never resent
    assert bridge.fake.log == ["ReportProcessFault"]
    assert bridge.metrics.reports_sent.labels("fault")._value.get() == 1


async def test_a_map_too_large_for_the_lane_is_sent_by_the_loop(bridge: Bridge) -> None:
    """The hand-off thread shares the controller's CPU: a huge map is encoded elsewhere."""
    bridge.fake.release.set()
    bridge.callback({rank: 0 for rank in range(LANE_MAX_RANKS + 1)})
    bridge.callback({rank: 0 for rank in range(LANE_MAX_RANKS)})  # at the limit: the lane's, once the outbox is idle
    await eventually(lambda: bridge.fake.seen("ReportProcessFault") >= 1 and len(bridge.relay) == 0
                     and bridge.metrics.callbacks.labels("report_fault_ranks")._value.get() == 2, 10,
                     "both reports answered")
    assert bridge.lane.taken == 0  # the second came while the first was still the loop's
    bridge.callback({rank: 0 for rank in range(LANE_MAX_RANKS)})
    await eventually(lambda: len(bridge.relay) == 0 and
                     bridge.metrics.callbacks.labels("report_fault_ranks")._value.get() == 3, 10,
                     "the third report answered")
    assert bridge.lane.taken == (1 if with_lane(bridge) else 0)


async def test_a_report_behind_one_in_the_outbox_keeps_its_place(bridge: Bridge) -> None:
    bridge.relay.submit_faults({3: 0})  # on the wire, held by ClusterD
    await eventually(lambda: bridge.fake.seen("ReportProcessFault") == 1, 10, "the first fault report on the wire")
    bridge.relay.submit_cycle_report("stop_complete", CYCLE, b"")
    bridge.callback({4: 0})  # after the stop-complete: it must not overtake it
    await eventually(lambda: len(bridge.relay) == 3, 10, "the callback's report in the outbox")
    bridge.fake.release.set()
    await eventually(lambda: len(bridge.relay) == 0, 10, "every report answered")
    assert bridge.fake.log == ["ReportProcessFault", "ReportStopComplete", "ReportProcessFault"]
    assert bridge.lane.taken == 0


async def test_a_pre_sent_report_that_failed_is_retried_once_answered_never_again(bridge: Bridge) -> None:
    bridge.fake.fault_answers = [grpc.StatusCode.INTERNAL]
    bridge.fake.release.set()
    bridge.callback({6: 1})
    await eventually(lambda: len(bridge.relay) == 0 and bridge.fake.seen("ReportProcessFault") == 2, 10,
                     "the failed report retried and answered")
    await asyncio.sleep(0.05)  # the behaviour under test: nothing is sent again afterwards
    assert bridge.fake.log == ["ReportProcessFault", "ReportProcessFault"]
    assert bridge.lane.taken == (1 if with_lane(bridge) else 0)


async def test_no_report_leaves_while_no_stream_is_live(bridge: Bridge) -> None:
    bridge.fake.release.set()
    bridge.session.live.clear()
    bridge.callback({7: 0})
    await eventually(lambda: len(bridge.relay) == 1, 10, "the report waiting in the outbox")
    await asyncio.sleep(0.05)  # the behaviour under test: it waits for a live stream
    assert bridge.fake.log == []
    bridge.session.live.set()
    bridge.relay._wakeup.set()  # the session wakes the outbox when a stream goes live
    await eventually(lambda: len(bridge.relay) == 0, 10, "the report sent once live")
    assert bridge.fake.log == ["ReportProcessFault"]
    assert bridge.lane.taken == 0


async def test_a_map_with_a_bad_entry_goes_through_the_loop_which_counts_it(bridge: Bridge) -> None:
    bridge.fake.release.set()
    bridge.callback({8: 0, -1: 0})
    await eventually(lambda: bridge.fake.seen("ReportProcessFault") == 1 and len(bridge.relay) == 0, 10,
                     "the good entry sent")
    assert bridge.metrics.bad_inputs.labels("controller_fault_map")._value.get() == 1
    await asyncio.sleep(0.05)  # the behaviour under test: the good entry goes out once
    assert bridge.fake.log == ["ReportProcessFault"]


async def test_back_to_back_callbacks_lose_no_report(bridge: Bridge) -> None:
    bridge.fake.release.set()
    for rank in range(20):
        bridge.callback({rank: 0})

    def sent() -> float:
        return bridge.metrics.reports_sent.labels("fault")._value.get()

    def merged() -> float:
        return bridge.metrics.reports_merged._value.get()

    # every callback's ranks went out, alone or merged into a neighbour
    await eventually(lambda: sent() + merged() == 20 and len(bridge.relay) == 0, 10, "every report answered")
    await asyncio.sleep(0.05)  # the behaviour under test: nothing more goes out
    assert bridge.fake.seen("ReportProcessFault") == sent()


async def test_a_stop_complete_of_the_live_cycle_reaches_clusterd_while_the_event_loop_is_held(bridge: Bridge) -> None:
    bridge.fake.release.set()
    bridge.flow.answering = CYCLE  # the controller accepted this cycle's stop_train
    bridge.handoff.put(("report_stop_complete", (0, "ok", {2: 1}), 0.0, None))
    sent = True
    try:  # the loop is held still (a blocking wait on its own thread): only the lane can send it
        eventually_sync(lambda: bridge.fake.seen("ReportStopComplete") == 1, 3, what="the stop-complete sent")
    except AssertionError:
        sent = False
    assert sent is with_lane(bridge)
    await eventually(lambda: bridge.fake.seen("ReportStopComplete") == 1 and len(bridge.relay) == 0, 10,
                     "the report answered and adopted")
    assert await bridge.relay.settle(1)
    await asyncio.sleep(0.05)  # the behaviour under test: code 0 is never resent
    assert bridge.fake.log == ["ReportStopComplete"]
    assert bridge.metrics.reports_sent.labels("stop_complete")._value.get() == 1


async def test_a_strategies_report_the_loop_may_narrow_never_leaves_from_the_lane(bridge: Bridge) -> None:
    """A cycle rebound to the controller's coming strategies (resume.py) may need them
    narrowed to exit and dump, which only the loop does: the lane leaves that report to
    it, and still takes the cycle's other reports."""
    bridge.fake.release.set()
    bridge.flow.answering = CYCLE
    bridge.lane.loop_only_strategies = lambda cycle: cycle == CYCLE
    bridge.handoff.put(("report_stop_complete", (0, "ok", {2: 1}), 0.0, None))
    await eventually(lambda: bridge.fake.seen("ReportStopComplete") == 1 and len(bridge.relay) == 0, 10,
                     "the stop-complete answered")
    taken = bridge.lane.taken
    assert taken == (1 if with_lane(bridge) else 0)
    bridge.handoff.put(("report_strategies", ({2: 1}, ["retry", "exit"]), 0.0, None))
    await eventually(lambda: bridge.fake.seen("ReportRecoverStrategy") == 1 and len(bridge.relay) == 0, 10,
                     "the strategies report answered")
    assert bridge.lane.taken == taken  # sent by the loop
    assert bridge.fake.log == ["ReportStopComplete", "ReportRecoverStrategy"]


async def test_a_report_of_a_cycle_that_is_over_never_leaves(bridge: Bridge) -> None:
    bridge.fake.release.set()
    bridge.flow.answering = "uuid-over"  # not the live cycle
    bridge.handoff.put(("report_result", (0, "ok", {}, "retry"), 0.0, None))
    await eventually(lambda: bridge.metrics.reports_dropped.labels("result", "no_live_cycle")._value.get() == 1,
                     10, "the result dropped")
    await asyncio.sleep(0.05)  # the behaviour under test: nothing goes out
    assert bridge.fake.log == []
    assert bridge.lane.taken == 0


async def test_a_malformed_cycle_report_is_answered_499_and_never_sent(bridge: Bridge) -> None:
    bridge.fake.release.set()
    bridge.flow.answering = CYCLE
    waiter: Future[int] = Future()
    bridge.handoff.put(ControllerReport("report_stop_complete", ("not a code", "ok", {}), 0.0, waiter))
    assert await asyncio.wait_for(asyncio.wrap_future(waiter), 10) == Code.ClientError
    bridge.callback({9: 0})  # the outbox goes on
    await eventually(lambda: bridge.fake.seen("ReportProcessFault") == 1 and len(bridge.relay) == 0, 10,
                     "the next report sent")
    assert bridge.fake.log == ["ReportProcessFault"]


class Capture:
    """The outbox as ReportPath sees it: what it would send."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.faults: list[dict[int, int]] = []

    def submit_cycle_report(self, kind: str, cycle: str | None, payload: bytes, waiter: Any = None,
                            presend: Any = None) -> None:
        self.payloads.append(payload)

    def submit_faults(self, faults: dict[int, int], waiter: Any = None, presend: Any = None) -> None:
        self.faults.append(faults)


ARGS = [
    ("report_stop_complete", (0, "stopped", {1: 1, 3: 0})),
    ("report_stop_complete", (404, "not ready", {})),
    ("report_strategies", ({4: 1}, ["retry", "recover"])),
    ("report_result", (0, "ok", {5: 1}, "recover")),
    ("report_result", (201, "downgrade", {7: 1, 2: 1}, "recover")),
]


@pytest.mark.parametrize(("callback", "args"), ARGS)
def test_the_lane_encodes_each_report_as_the_event_loop_does(callback: str, args: tuple[Any, ...]) -> None:
    capture = Capture()
    path = ReportPath(JOB, ControllerFlow(), capture, BridgeMetrics())  # type: ignore[arg-type]
    path.on_report(ControllerReport(callback, args, 0.0))
    assert capture.payloads == [request(JOB, callback, args)]


def test_the_lane_encodes_a_fault_report_as_the_event_loop_does() -> None:
    from bridge import faults as codec

    capture = Capture()
    path = ReportPath(JOB, ControllerFlow(), capture, BridgeMetrics())  # type: ignore[arg-type]
    path.on_report(ControllerReport("report_fault_ranks", ({3: 0, 9: 1},), 0.0))
    assert request(JOB, "report_fault_ranks", ({3: 0, 9: 1},)) == codec.encode_process_fault_request(
        JOB, capture.faults[0])


async def test_a_cycle_report_behind_the_lanes_call_goes_out_the_moment_it_answers(bridge: Bridge) -> None:
    bridge.flow.answering = CYCLE
    bridge.callback({2: 0})  # held by ClusterD
    bridge.handoff.put(("report_strategies", ({2: 0}, ["retry", "exit"]), 0.0, None))
    await eventually(lambda: bridge.fake.seen("ReportProcessFault") == 1, 10, "the fault report on the wire")
    if with_lane(bridge):  # chained to the lane's call on the report thread
        await eventually(lambda: bridge.lane.chained == 1, 10, "the strategy report chained")
    else:  # chained by the outbox (relay.py)
        await eventually(lambda: len(bridge.relay) == 2 and bridge.relay._queue[1].chained is not None, 10,
                         "the strategy report chained")
    assert bridge.fake.log == ["ReportProcessFault"]  # not before its predecessor is answered
    bridge.fake.release.set()
    # The loop is held still (a blocking wait on its own thread): the report thread sends it alone.
    eventually_sync(lambda: bridge.fake.seen("ReportRecoverStrategy") == 1, 5, what="the strategy report sent")
    await eventually(lambda: len(bridge.relay) == 0, 10, "both answered and adopted")
    await asyncio.sleep(0.05)  # the behaviour under test: code 0 is never resent
    assert bridge.fake.log == ["ReportProcessFault", "ReportRecoverStrategy"]
    assert bridge.metrics.reports_sent.labels("strategy")._value.get() == 1
    assert await bridge.relay.settle(1)


async def test_a_cycle_report_that_comes_during_the_lanes_call_goes_out_the_moment_it_answers(bridge: Bridge) -> None:
    bridge.flow.answering = CYCLE
    bridge.callback({2: 0})  # held by ClusterD
    await eventually(lambda: bridge.fake.seen("ReportProcessFault") == 1, 10, "the fault report on the wire")
    bridge.handoff.put(("report_strategies", ({2: 0}, ["retry", "exit"]), 0.0, None))  # while the call is out
    await asyncio.sleep(0.05)  # the behaviour under test: nothing leaves before its predecessor is answered
    assert bridge.fake.log == ["ReportProcessFault"]
    bridge.fake.release.set()
    # The loop is held still (a blocking wait on its own thread): with the lane, the
    # hand-off thread sends it right after the answer; without, the report thread does
    # (the outbox chained it while the call was out).
    eventually_sync(lambda: bridge.fake.seen("ReportRecoverStrategy") == 1, 5, what="the strategy report sent")
    if with_lane(bridge):
        assert bridge.lane.chained == 1
    await eventually(lambda: len(bridge.relay) == 0, 10, "both answered and adopted")
    await asyncio.sleep(0.05)  # the behaviour under test: code 0 is never resent
    assert bridge.fake.log == ["ReportProcessFault", "ReportRecoverStrategy"]
    assert bridge.metrics.reports_sent.labels("strategy")._value.get() == 1


async def test_a_cycle_report_chained_to_a_failed_report_goes_after_its_retry(bridge: Bridge) -> None:
    bridge.flow.answering = CYCLE
    bridge.fake.fault_answers = [grpc.StatusCode.INTERNAL]
    bridge.callback({4: 0})
    bridge.handoff.put(("report_stop_complete", (0, "stopped", {}), 0.0, None))
    await eventually(lambda: bridge.fake.seen("ReportProcessFault") == 1, 10, "the fault report on the wire")
    if with_lane(bridge):
        await eventually(lambda: bridge.lane.chained == 1, 10, "the stop-complete chained")
    bridge.fake.release.set()
    await eventually(lambda: len(bridge.relay) == 0 and bridge.fake.seen("ReportStopComplete") == 1, 10,
                     "the fault report retried, then the stop-complete sent")
    await asyncio.sleep(0.05)  # the behaviour under test: nothing is sent twice
    assert bridge.fake.log == ["ReportProcessFault", "ReportProcessFault", "ReportStopComplete"]
    assert bridge.metrics.reports_sent.labels("stop_complete")._value.get() == 1


async def test_a_lane_report_reaches_the_loop_when_it_catches_up_and_is_never_resent(bridge: Bridge) -> None:
    def handled() -> float:
        return bridge.metrics.callbacks.labels("report_fault_ranks")._value.get()

    bridge.callback({6: 0})  # held by ClusterD
    await eventually(lambda: bridge.fake.seen("ReportProcessFault") == 1, 10, "the fault report on the wire")
    if with_lane(bridge):  # the loop learns of it once the call is over, unless it catches up first
        await asyncio.sleep(0.05)  # the behaviour under test: the call is out, the loop not told
        assert handled() == 0 and len(bridge.relay) == 0
        bridge.lane.flush()  # what the session does before it reacts to ClusterD
    else:
        await eventually(lambda: handled() == 1, 10, "the report handled by the loop")
    assert handled() == 1 and len(bridge.relay) == 1  # the outbox's head: on the wire, not sent again
    bridge.fake.release.set()
    await eventually(lambda: len(bridge.relay) == 0, 10, "the report answered")
    await asyncio.sleep(0.05)  # the behaviour under test: code 0 is never resent
    assert bridge.fake.log == ["ReportProcessFault"]
    assert handled() == 1 and bridge.metrics.reports_sent.labels("fault")._value.get() == 1


async def test_a_lane_batch_on_its_way_to_the_loop_is_handled_when_it_catches_up_and_only_once(
        bridge: Bridge) -> None:
    """The hand-off thread took the lane's batch to post it, and the loop reads
    ClusterD's answer (a changeStrategy right behind the strategies report) before the
    post's run: catching up must hand the loop that batch, or the dispatcher meets the
    answer with the flow a step behind and refuses it, and the controller, never told,
    gives the job up (seen on the real peers). The post's own run then does nothing."""
    if not with_lane(bridge):
        pytest.skip("the lane's hand-over only")

    def handled() -> float:
        return bridge.metrics.callbacks.labels("report_fault_ranks")._value.get()

    taken, go, posted = threading.Event(), threading.Event(), threading.Event()
    post = bridge.handoff._post

    def late_post(reports: list[ControllerReport]) -> None:  # on the hand-off thread
        if reports[0].presend is None:  # not the lane's batch
            post(reports)
            return
        taken.set()  # release took it: held here until the test lets it go
        go.wait(30)
        post(reports)
        posted.set()

    bridge.handoff._post = late_post  # type: ignore[method-assign]
    bridge.fake.release.set()
    bridge.callback({6: 0})
    await eventually(taken.is_set, 10, "the lane's batch taken by release, not posted yet")
    assert handled() == 0
    bridge.lane.flush()  # what the session does before it reacts to ClusterD's answer
    assert handled() == 1 and bridge.lane.unhandled == 0
    go.set()
    await eventually(posted.is_set, 10, "the lane's batch posted")
    after_post = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon_threadsafe(after_post.set_result, None)  # runs after the post's run
    await after_post
    assert handled() == 1 and bridge.lane.unhandled == 0
    bridge.callback({7: 0})  # the lane is open again: nothing is counted as still on its way
    await eventually(lambda: bridge.fake.seen("ReportProcessFault") == 2 and len(bridge.relay) == 0, 10,
                     "the next report answered")
    assert bridge.lane.taken == 2 and handled() == 2


def _fifo_allowed() -> bool:
    """Whether this process may put a thread under SCHED_FIFO (root, or RLIMIT_RTPRIO)."""
    outcome: list[bool] = []

    def attempt() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
            outcome.append(True)
        except OSError:
            outcome.append(False)

    worker = threading.Thread(target=attempt)
    worker.start()
    worker.join()
    return outcome[0]


async def test_the_hand_off_thread_is_realtime_only_while_it_makes_the_lanes_call(bridge: Bridge) -> None:
    """Woken by a callback it must never preempt the controller's thread (SCHED_BATCH);
    waiting for ClusterD's answer it must wake at once on busy cores (SCHED_FIFO)."""
    if not with_lane(bridge) or not hasattr(os, "SCHED_BATCH") or not _fifo_allowed():
        pytest.skip("needs the lane and SCHED_FIFO")
    thread = bridge.handoff._thread
    assert thread is not None and thread.native_id is not None

    def policy() -> int:
        return os.sched_getscheduler(thread.native_id) & ~os.SCHED_RESET_ON_FORK  # type: ignore[arg-type]

    await eventually(lambda: policy() == os.SCHED_BATCH, 10, "the hand-off thread under SCHED_BATCH")
    bridge.lane.client.realtime_priority = 1
    bridge.callback({3: 0})  # held by ClusterD
    await eventually(lambda: bridge.fake.seen("ReportProcessFault") == 1, 10, "the fault report on the wire")
    # Promoted once the request is written (rpcthread.py), so possibly a moment after
    # ClusterD has it; it stays so while ClusterD holds the call.
    await eventually(lambda: policy() == os.SCHED_FIFO, 10, "SCHED_FIFO while ClusterD holds the call")
    bridge.fake.release.set()
    await eventually(lambda: len(bridge.relay) == 0, 10, "the report answered and adopted")
    await eventually(lambda: policy() == os.SCHED_BATCH, 10, "back under SCHED_BATCH before the next callback")
