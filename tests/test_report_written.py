"""A report call's ``on_sent`` runs once gRPC has written the request, before the wait
for the answer (bridge/rpcthread.py, "Once the request is written"), and the report lane
promotes its thread there, or before encoding a big fault map (bridge/fastlane.py).

The report lane promotes the hand-off thread to ``SCHED_FIFO`` there: promoted before
the write, the thread kept ClusterD's receiving thread off its CPU. Where the request
goes out is gRPC's internal structure, so these tests hold it to the installed grpcio:
on a release where the hook cannot be placed, ``after_send`` is False and the first
test fails, instead of the lane silently promoting before the write again.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import grpc

from bridge._proto import recover_pb2 as pb
from bridge.codes import Code
from bridge.fastlane import WRITE_FIRST_MAX_RANKS, ReportLane
from bridge.rpcthread import Call, ChainBroken, RpcThread

from .conftest import eventually_sync
from .test_report_chain import ClusterD, clusterd  # noqa: F401 - the fixture

STOP_COMPLETE = "/Recover/ReportStopComplete"
PAYLOAD = pb.StopCompleteRequest(jobId="job", status=pb.Status(code=0)).SerializeToString()


def report_thread(address: str) -> RpcThread:
    return RpcThread(grpc.insecure_channel(address), pb.Status.FromString)


async def test_on_sent_runs_on_the_calling_thread_once_clusterd_can_read_the_request(
        clusterd: tuple[ClusterD, str]) -> None:
    fake, address = clusterd
    rpc = report_thread(address)
    runs: list[int] = []  # the threads on_sent ran on, once ClusterD had the request

    def on_sent() -> None:
        # Blocks the call until ClusterD has the request: were it run before the write,
        # ClusterD would never see it, this would give up after 10 s (raising, which the
        # report thread logs) and record nothing.
        eventually_sync(lambda: fake.seen("ReportStopComplete") == 1, 10, "ClusterD has the request")
        runs.append(threading.get_ident())

    loop = asyncio.get_running_loop()
    call = Call.blank(loop).fill(STOP_COMPLETE, 10.0, None, lambda: PAYLOAD)
    try:
        made_on = await asyncio.to_thread(lambda: (rpc.make(call, on_sent), threading.get_ident())[1])
        answer = await call.future
    finally:
        rpc.close()
    assert rpc.after_send, "this grpcio has no channel object to wrap: on_sent runs before the write"
    assert runs == [made_on]
    assert answer.code == Code.OK


async def test_on_sent_does_not_run_for_a_call_that_is_never_made(clusterd: tuple[ClusterD, str]) -> None:
    _, address = clusterd
    rpc = report_thread(address)
    runs: list[str] = []
    loop = asyncio.get_running_loop()
    first = Call.blank(loop).fill(STOP_COMPLETE, 10.0, None, lambda: None)  # a bad argument: not sent
    chained = Call.blank(loop).fill(STOP_COMPLETE, 10.0, first, lambda: PAYLOAD)
    try:
        for call in (first, chained):
            await asyncio.to_thread(rpc.make, call, lambda: runs.append("sent"))
        for call in (first, chained):
            try:
                await call.future
            except ChainBroken:
                pass
            else:
                raise AssertionError("a call that was never made answered")
    finally:
        rpc.close()
    assert runs == []


class _PlainChannel:
    """A channel whose callables have no channel object inside (a gRPC release built
    otherwise): records what happened in which order."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        callback(grpc.ChannelConnectivity.READY)

    def unsubscribe(self, callback: Any) -> None:
        pass

    def unary_unary(self, method: str, **_: Any) -> Any:
        def call(payload: bytes, timeout: float) -> pb.Status:
            self.events.append("written")
            return pb.Status(code=Code.OK)
        return call

    def close(self) -> None:
        pass


async def test_without_a_channel_object_to_wrap_on_sent_runs_just_before_the_call() -> None:
    events: list[str] = []
    rpc = RpcThread(_PlainChannel(events), pb.Status.FromString)  # type: ignore[arg-type]
    call = Call.blank(asyncio.get_running_loop()).fill(STOP_COMPLETE, 10.0, None, lambda: PAYLOAD)
    try:
        await asyncio.to_thread(rpc.make, call, lambda: events.append("on_sent"))
        assert (await call.future).code == Code.OK
    finally:
        rpc.close()
    assert not rpc.after_send
    assert events == ["on_sent", "written"]


class _RecordingRpc:
    """``RpcThread.make`` as the lane sees it: notes whether the lane had promoted its
    thread before the call and whether it asked for the promotion after the write, then
    "writes" (runs ``on_sent``)."""

    def __init__(self, lane: ReportLane) -> None:
        self.lane = lane
        self.made: list[tuple[bool, bool]] = []  # (promoted before the call, promotion asked after the write)

    def make(self, call: Call, on_sent: Any = None) -> bool:
        self.made.append((self.lane._boosted, on_sent is not None))
        if on_sent is not None:
            on_sent()
        return True


def test_a_big_fault_map_is_encoded_and_written_under_fifo_a_small_one_written_first(monkeypatch: Any) -> None:
    """Encoding a map over WRITE_FIRST_MAX_RANKS takes long enough that, under
    SCHED_BATCH, the controller's thread preempted the hand-off thread holding the GIL;
    a small map's request is written first and the thread promoted right after."""
    promotions: list[int] = []
    monkeypatch.setattr("bridge.fastlane.realtime.promote", lambda priority, thread: promotions.append(priority) or True)
    monkeypatch.setattr("bridge.fastlane.realtime.batch_policy", lambda: True)
    for ranks, expected in ((WRITE_FIRST_MAX_RANKS, (False, True)), (WRITE_FIRST_MAX_RANKS + 1, (True, False))):
        lane = ReportLane("job", SimpleNamespace(lane_lock=threading.Lock()), None,  # type: ignore[arg-type]
                          SimpleNamespace(realtime_priority=1), None, None,  # type: ignore[arg-type]
                          deliver=lambda reports: None, loop_only_strategies=lambda cycle: False)
        rpc = _RecordingRpc(lane)
        lane._send([(rpc, None, ranks)])  # type: ignore[list-item]
        assert rpc.made == [expected], ranks
        assert lane._boosted
        lane.release()
        assert not lane._boosted
    assert promotions == [1, 1]
