"""The report path under load: the callback waking the event loop itself (``Handoff`` WAKE
mode, opt-in through ``controller.handoff``), and the Report* RPCs go over a synchronous channel on a thread of their own
(``bridge/rpcthread.py``). What must hold whatever the timing: callback order, no loss,
never raise into the controller, never write to a file descriptor that is no longer
ours, deadlines and the delivery classification that never-resend depends on."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator

import grpc
import pytest

from bridge._proto import recover_pb2 as pb
from bridge.clusterd import ClusterDClient, Delivery, RpcFailure
from bridge.config import ClusterDConfig, ControllerConfig
from bridge.controller import make_callback
from bridge.metrics import BridgeMetrics
from bridge.reports import THREAD, WAKE, ControllerReport, Handoff
from bridge.sim.scenario import free_port

from .conftest import eventually, recover_server


class Collected:
    def __init__(self) -> None:
        self.batches: list[list[ControllerReport]] = []

    def handle(self, reports: list[ControllerReport]) -> None:
        self.batches.append(reports)

    @property
    def reports(self) -> list[ControllerReport]:
        return [report for batch in self.batches for report in batch]


async def test_thread_is_the_default_mode_and_wake_is_chosen_by_the_config() -> None:
    """THREAD keeps the callback shortest on a quiet node (docs/performance.md); WAKE is an
    operator's choice for nodes whose cores are busy."""
    assert ControllerConfig().handoff == THREAD
    default = Handoff(asyncio.get_running_loop(), Collected().handle)
    chosen = Handoff(asyncio.get_running_loop(), Collected().handle, ControllerConfig(handoff="wake").handoff)
    try:
        assert default.mode == THREAD and chosen.mode == WAKE
        assert default.alive and chosen.alive
    finally:
        default.close()
        chosen.close()
    assert not default.alive and not chosen.alive


async def test_callbacks_from_several_threads_all_arrive_each_in_its_threads_order() -> None:
    """Four controller-like threads racing the loop's drain: nothing is lost, nothing is
    reordered within a thread, and every callback returned 0."""
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, WAKE)
    callback = make_callback("report_fault_ranks", handoff.put, lambda: None)
    per_thread = 2_000
    returned: list[int] = []

    def controller(thread: int) -> None:
        codes = [callback({thread * per_thread + i: 0}) for i in range(per_thread)]
        returned.extend(codes)

    threads = [threading.Thread(target=controller, args=(n,)) for n in range(4)]
    try:
        for thread in threads:
            thread.start()
        await asyncio.to_thread(lambda: [thread.join(30) for thread in threads])
        await eventually(lambda: len(collected.reports) == 4 * per_thread, 10,
                         what=f"all {4 * per_thread} reports on the loop")
    finally:
        handoff.close()
    assert returned == [0] * (4 * per_thread)
    ranks = [next(iter(report.args[0])) for report in collected.reports]
    assert sorted(ranks) == list(range(4 * per_thread))  # no loss, no duplicate
    for n in range(4):
        mine = [rank for rank in ranks if rank // per_thread == n]
        assert mine == sorted(mine), f"thread {n}'s reports were reordered"


async def test_close_delivers_what_was_put_and_a_later_put_neither_raises_nor_writes_anywhere() -> None:
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, WAKE)
    callback = make_callback("report_fault_ranks", handoff.put, lambda: pytest.fail("the sink raised"))
    old_fd = handoff._fd
    read_end, write_end = os.pipe()  # before the close, so that neither end takes the old number
    for rank in range(10):
        assert callback({rank: 0}) == 0
    await asyncio.to_thread(handoff.close)
    assert [report.args[0] for report in collected.reports] == [{rank: 0} for rank in range(10)]
    # The eventfd's number is free again and another file may get it: here a pipe's
    # writing end does. A put after close must not write into it.
    os.dup2(write_end, old_fd)
    os.set_blocking(read_end, False)
    try:
        assert callback({99: 0}) == 0
        with pytest.raises(BlockingIOError):
            os.read(read_end, 64)
    finally:
        for fd in {read_end, write_end, old_fd}:
            os.close(fd)
    assert len(collected.reports) == 10


async def test_a_put_from_the_loop_thread_itself_is_delivered() -> None:
    """The seed API may submit from anywhere, the loop's own thread included."""
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, WAKE)
    try:
        handoff.put(ControllerReport("report_result", (0, "ok", {}, "retry"), 1.0, None))
        await eventually(lambda: collected.reports, 5, what="the report put on the loop's thread")
    finally:
        handoff.close()
    assert collected.reports[0].callback == "report_result"


async def test_a_malformed_item_costs_only_itself() -> None:
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, WAKE)
    try:
        # one batch (the loop cannot run between these puts): the good neighbours survive
        handoff.put(("report_fault_ranks", ({1: 0},), 0.0, None))
        handoff.put(("report_fault_ranks", "not", "a", "report", "tuple"))  # type: ignore[arg-type]
        handoff.put(("report_fault_ranks", ({2: 0},), 0.0, None))
        await eventually(lambda: len(collected.reports) == 2, 5, what="both good reports")
        handoff.put(("report_fault_ranks", ({3: 0},), 0.0, None))
        await eventually(lambda: len(collected.reports) == 3, 5, what="the next report")
    finally:
        handoff.close()
    assert [report.args for report in collected.reports] == [({1: 0},), ({2: 0},), ({3: 0},)]


# --------------------------------------------------------------------------- the RPC thread

REPORT = "/Recover/ReportProcessFault"


@pytest.fixture
async def clusterd_that_never_answers() -> AsyncIterator[str]:
    """A server whose ReportProcessFault never returns: only the deadline ends the call."""
    release = asyncio.Event()

    async def report(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await release.wait()
        return pb.Status(code=0).SerializeToString()

    async with recover_server("ReportProcessFault", report) as address:
        try:
            yield address
        finally:
            release.set()


async def test_a_report_that_reached_a_server_that_never_answers_ends_at_its_deadline_outcome_unknown(
        clusterd_that_never_answers: str) -> None:
    client = ClusterDClient(ClusterDConfig(address=clusterd_that_never_answers, rpc_timeout=0.5), BridgeMetrics())
    await client.open()
    client._start_rpc_thread()  # as the first subscribe does
    try:
        assert client.rpc_thread is not None
        await eventually(lambda: client.rpc_thread is not None and client.rpc_thread.ready, 10,
                         what="the report channel connected")
        with pytest.raises(RpcFailure) as failure:
            await asyncio.wait_for(client.call(REPORT, b""), 10)  # the outer bound only guards the test
    finally:
        await client.close()
    assert failure.value.status == "DEADLINE_EXCEEDED"
    assert failure.value.delivery is Delivery.UNKNOWN  # it may have been read: never resend


async def test_a_report_to_nobody_provably_never_arrived() -> None:
    address = f"127.0.0.1:{free_port()}"  # a port nothing listens on
    client = ClusterDClient(ClusterDConfig(address=address, rpc_timeout=2.0), BridgeMetrics())
    await client.open()
    client._start_rpc_thread()
    try:
        with pytest.raises(RpcFailure) as failure:
            await client.call(REPORT, b"")
    finally:
        await client.close()
    assert failure.value.status == "UNAVAILABLE"
    assert failure.value.delivery is Delivery.NOT_DELIVERED


async def test_the_rpc_thread_starts_with_the_first_subscribe_and_ends_with_close() -> None:
    client = ClusterDClient(ClusterDConfig(address="127.0.0.1:1", rpc_timeout=1.0), BridgeMetrics())
    await client.open()
    assert client.rpc_thread is None  # a client that never subscribes (the rank table's) has none
    client.subscribe("job", "role").cancel()
    rpc_thread = client.rpc_thread
    assert rpc_thread is not None and rpc_thread.alive
    await client.close()
    assert not rpc_thread.alive and client.rpc_thread is None


def test_other_methods_stay_on_the_aio_channel() -> None:
    """Init/Register and the stream never queue behind a report on the RPC thread."""
    from bridge.rpcthread import THREADED

    assert THREADED == {"/Recover/ReportProcessFault", "/Recover/ReportStopComplete",
                        "/Recover/ReportRecoverStrategy", "/Recover/ReportRecoverStatus"}
