"""The re-report of a fault ClusterD answered 0 but started no recovery for (bridge/job/reports/refault.py)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

from bridge.job.reports.controller_flow import ControllerFlow, Step
from bridge.job.metrics import BridgeMetrics
from bridge.job.reports.refault import FaultCentreTimes, FaultFollowUp

from .conftest import eventually

TIMES = FaultCentreTimes(hold=0.2, period=0.02)  # the hold and the tick, shortened


class Outbox:
    """The wire's outbox, recorded."""

    def __init__(self) -> None:
        self.faults: list[tuple[float, dict[int, int]]] = []

    def submit_faults(self, faults: dict[int, int], waiter: Future[int] | None = None) -> None:
        self.faults.append((time.monotonic(), dict(faults)))

    def submit_cycle_report(self, kind: str, cycle: str | None, payload: bytes,
                            waiter: Future[int] | None = None) -> None:
        raise AssertionError("no cycle report is made here")


def follow_up(wait: float = 30.0, running: bool = False) -> tuple[FaultFollowUp, ControllerFlow, Outbox, BridgeMetrics]:
    flow, outbox, metrics = ControllerFlow(wait_timeout=wait), Outbox(), BridgeMetrics()
    return FaultFollowUp(flow, outbox, metrics, TIMES, lambda: running), flow, outbox, metrics


def controller_reports(up: FaultFollowUp, flow: ControllerFlow, faults: dict[int, int]) -> float:
    at = time.monotonic()
    flow.on_callback("report_fault_ranks")
    up.controller_fault(faults, at, first_of_flow=True)
    return at


async def test_a_skipped_uce_is_reported_again_once_after_the_record_expired() -> None:
    up, flow, outbox, metrics = follow_up()
    controller_reports(up, flow, {2: 0})
    delivered = time.monotonic()
    up.delivered({2: 0}, delivered)  # ClusterD answered 0 ... and no stop_train follows
    assert flow.step is Step.AWAIT_STOP
    await eventually(lambda: outbox.faults, 5, what="the re-report")
    sent_at, faults = outbox.faults[0]
    assert faults == {2: 0}
    assert sent_at - delivered >= TIMES.hold + TIMES.period  # not before ClusterD forgot the record
    up.delivered({2: 0}, time.monotonic())  # the re-report's own answer: no third report
    await asyncio.sleep(3 * (TIMES.hold + TIMES.period))  # what the assertion is about: nothing more
    assert len(outbox.faults) == 1
    assert metrics.sample("tft_bridge_fault_rereports_total", {"reason": "record_held"}) == 1


async def test_every_delivery_of_the_rank_moves_the_re_report_later() -> None:
    up, flow, outbox, _ = follow_up()
    controller_reports(up, flow, {2: 0})
    up.delivered({2: 0}, time.monotonic())
    first = up.due
    await asyncio.sleep(TIMES.hold / 2)  # the subject: a later delivery, half a hold later
    up.delivered({2: 0}, time.monotonic())  # e.g. a re-report on a new stream: ClusterD refreshed the record
    assert up.due is not None and first is not None and up.due[0] - first[0] >= TIMES.hold / 2


async def test_no_re_report_once_clusterd_stopped_the_controller() -> None:
    up, flow, outbox, _ = follow_up()
    controller_reports(up, flow, {2: 0})
    up.delivered({2: 0}, time.monotonic())
    flow.notified("stop_train", "uuid-1")  # ClusterD started the cycle
    assert flow.step is not Step.AWAIT_STOP
    await asyncio.sleep(2 * (TIMES.hold + TIMES.period))  # an absence: past the moment a re-report would leave
    assert outbox.faults == []


async def test_no_re_report_while_clusterd_shows_a_running_cycle() -> None:
    up, flow, outbox, _ = follow_up(running=True)
    controller_reports(up, flow, {2: 0})
    up.delivered({2: 0}, time.monotonic())
    await asyncio.sleep(2 * (TIMES.hold + TIMES.period))  # an absence: past the moment a re-report would leave
    assert outbox.faults == []


async def test_a_process_fault_is_never_re_reported_here() -> None:
    up, flow, outbox, _ = follow_up()
    controller_reports(up, flow, {2: 1})
    up.delivered({2: 1}, time.monotonic())
    assert up.due is None


async def test_a_wait_too_short_for_the_hold_reports_the_ranks_as_process_faults() -> None:
    up, flow, outbox, metrics = follow_up(wait=0.1)  # the controller gives up before the record expires
    controller_reports(up, flow, {2: 0, 3: 2})
    delivered = time.monotonic()
    up.delivered({2: 0, 3: 2}, delivered)
    await eventually(lambda: outbox.faults, 5, what="the re-report")
    sent_at, faults = outbox.faults[0]
    assert faults == {2: 1, 3: 1}
    assert sent_at - delivered < TIMES.hold  # at once after a new record's cycle would have started
    assert metrics.sample("tft_bridge_fault_rereports_total", {"reason": "as_process_fault"}) == 1


async def test_a_large_fault_map_is_remembered_whole_and_still_re_reported() -> None:
    up, flow, outbox, _ = follow_up()
    faults = {rank: 0 for rank in range(5000)}
    controller_reports(up, flow, faults)
    delivered = time.monotonic()
    up.delivered(faults, delivered)
    assert up.due is not None and up.due[1] == "record_held" and up.due[0] - delivered >= TIMES.hold
    await eventually(lambda: outbox.faults, 5, what="the re-report")
    assert outbox.faults[0][1] == faults
