"""The fault lane (bridge/fastlane.py): a fault report goes from the hand-off thread
straight to the report thread when the outbox is idle, and the outbox's rules still hold:
callback order, a failure retried, code 0 never resent, nothing sent while no stream is
live, bad entries the loop's to count."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from bridge.clusterd import ClusterDClient
from bridge.config import ClusterDConfig
from bridge.fastlane import FaultLane
from bridge.flow import ControllerFlow
from bridge.metrics import BridgeMetrics
from bridge.relay import Relay
from bridge.reports import Handoff, ReportPath

from .conftest import eventually, eventually_sync
from .test_report_chain import CYCLE, JOB, ClusterD, OneCycle, clusterd  # noqa: F401 - the fixture


@dataclass
class Bridge:
    fake: ClusterD
    relay: Relay
    session: OneCycle
    metrics: BridgeMetrics
    lane: FaultLane
    handoff: Handoff

    def callback(self, faults: object) -> None:
        """What the controller's report_fault_ranks callback puts (controller.make_callback)."""
        self.handoff.put(("report_fault_ranks", (faults,), 0.0, None))


@pytest.fixture(params=[True, False], ids=["lane", "no-lane"])
async def bridge(request: pytest.FixtureRequest, clusterd: tuple[ClusterD, str]) -> AsyncIterator[Bridge]:  # noqa: F811
    fake, address = clusterd
    metrics = BridgeMetrics()
    client = ClusterDClient(ClusterDConfig(address=address, rpc_timeout=10.0, reconnect_initial=0.01,
                                           reconnect_max=0.02), metrics)
    await client.open()
    client._start_rpc_thread()  # as the first subscribe does
    session = OneCycle()
    relay = Relay(JOB, client, session, metrics)  # type: ignore[arg-type]
    reports = ReportPath(JOB, ControllerFlow(), relay, metrics)
    loop = asyncio.get_running_loop()
    lane = FaultLane(JOB, relay, session, client, loop)  # type: ignore[arg-type]
    handoff = Handoff(loop, reports.handle, pin_cpu=False, lane=lane if request.param else None)
    task = asyncio.create_task(relay.run())
    try:
        await eventually(lambda: client.rpc_thread is not None and client.rpc_thread.ready, 10,
                         what="the report channel connected")
        yield Bridge(fake, relay, session, metrics, lane, handoff)
    finally:
        handoff.close()
        relay.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()


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
