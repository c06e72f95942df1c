"""A cycle report queued behind the request on the wire is chained to it on the report
thread (bridge/rpcthread.py, "Chained calls"; the end-to-end report path under load).

The chain saves two thread wake-ups on the recovery's critical path; it must not change
a single delivery rule: the chained report leaves only after its predecessor answered
code 0, never twice, never after its cycle ended, and ``settle`` (awaited before every
Subscribe) counts it as on the wire. The server here is a synchronous gRPC server on
threads of its own, so a test can hold the event loop still and see what the report
thread does without it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from bridge._proto import recover_pb2 as pb
from bridge.clusterd import ClusterDClient
from bridge.codes import Code
from bridge.config import ClusterDConfig
from bridge.metrics import BridgeMetrics
from bridge.relay import Relay

from .conftest import eventually, eventually_sync

JOB = "job-chain"
CYCLE = "uuid-1"


class ClusterD:
    """The four Report* methods on a synchronous server: each request is logged; the
    fault report waits for ``release`` and answers what ``fault_answers`` says next
    (a code, or a gRPC status to abort with)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.fault_answers: list[int | grpc.StatusCode] = []

    def handler(self, name: str) -> Callable[[bytes, Any], bytes]:
        def answer(request: bytes, context: Any) -> bytes:
            with self.lock:
                self.log.append(name)
            if name == "ReportProcessFault":
                self.release.wait(30)
                outcome = self.fault_answers.pop(0) if self.fault_answers else Code.OK
                if isinstance(outcome, grpc.StatusCode):
                    context.abort(outcome, "refused by the test")
                return pb.Status(code=outcome).SerializeToString()
            return pb.Status(code=Code.OK).SerializeToString()

        return answer

    def seen(self, name: str) -> int:
        with self.lock:
            return self.log.count(name)


class OneCycle:
    """The session as the outbox sees it: a live stream, one cycle until ``end``."""

    def __init__(self) -> None:
        self.live = asyncio.Event()
        self.live.set()
        self.cycle_listeners: list[Callable[[str], None]] = []
        self.alive = True

    def cycle_alive(self, token: str | None) -> bool:
        return self.alive and token == CYCLE

    def end(self) -> None:
        self.alive = False
        for listener in self.cycle_listeners:
            listener(CYCLE)

    def request_resubscribe(self, reason: str) -> None:
        pass


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


@pytest.fixture
def limit() -> int:
    return 10_000  # the outbox's default bound


@dataclass
class Outbox:
    """A running outbox and what it reports through, for one test."""

    client: ClusterDClient
    relay: Relay
    session: OneCycle
    metrics: BridgeMetrics


@asynccontextmanager
async def running_outbox(address: str, limit: int = 10_000) -> AsyncIterator[Outbox]:
    """A ClusterD client with its report thread connected and a relay running over it;
    stopped and closed on the way out (the report lane's tests build on it too)."""
    metrics = BridgeMetrics()
    client = ClusterDClient(ClusterDConfig(address=address, rpc_timeout=10.0, reconnect_initial=0.01,
                                           reconnect_max=0.02), metrics)
    await client.open()
    client._start_rpc_thread()  # as the first subscribe does
    session = OneCycle()
    relay = Relay(JOB, client, session, metrics, limit=limit,  # type: ignore[arg-type]
                  on_drop=lambda kind, cycle, reason: None, on_outcome_unknown=lambda kind: None)
    task = asyncio.create_task(relay.run())
    try:
        await eventually(lambda: client.rpc_thread is not None and client.rpc_thread.ready, 10,
                         what="the report channel connected")
        yield Outbox(client, relay, session, metrics)
    finally:
        relay.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()


@pytest.fixture
async def outbox(clusterd: tuple[ClusterD, str], limit: int) -> AsyncIterator[tuple[Relay, OneCycle, BridgeMetrics]]:
    async with running_outbox(clusterd[1], limit) as running:
        yield running.relay, running.session, running.metrics


async def fault_report_on_the_wire(fake: ClusterD, relay: Relay) -> None:
    """A fault report sent and held by ClusterD: what a cycle report gets chained to."""
    relay.submit_faults({3: 0})
    await eventually(lambda: fake.seen("ReportProcessFault") == 1, 10, "the fault report on the wire")


def dropped(metrics: BridgeMetrics, kind: str, reason: str) -> float:
    return metrics.reports_dropped.labels(kind, reason)._value.get()


async def test_the_strategy_report_follows_the_fault_report_without_the_event_loop(
        clusterd: tuple[ClusterD, str], outbox: tuple[Relay, OneCycle, BridgeMetrics]) -> None:
    fake, _ = clusterd
    relay, _, _ = outbox
    await fault_report_on_the_wire(fake, relay)
    relay.submit_cycle_report("strategy", CYCLE, b"")
    # The loop is held still from here on (a blocking wait on its own thread): only the
    # report thread can send the strategy report once the fault report is answered.
    fake.release.set()
    eventually_sync(lambda: fake.seen("ReportRecoverStrategy") == 1, 10,
                    what="the strategy report sent while the event loop was held")
    assert fake.log == ["ReportProcessFault", "ReportRecoverStrategy"]
    await eventually(lambda: len(relay) == 0, 10, "both reports answered")
    await asyncio.sleep(0.05)  # the behaviour under test: nothing is sent again afterwards
    assert fake.log == ["ReportProcessFault", "ReportRecoverStrategy"]


async def test_a_chained_report_waits_for_its_predecessor_to_be_retried_and_answered(
        clusterd: tuple[ClusterD, str], outbox: tuple[Relay, OneCycle, BridgeMetrics]) -> None:
    fake, _ = clusterd
    relay, _, _ = outbox
    fake.fault_answers = [grpc.StatusCode.INTERNAL]  # the first attempt fails: the fault report is retried
    await fault_report_on_the_wire(fake, relay)
    relay.submit_cycle_report("strategy", CYCLE, b"")
    fake.release.set()
    await eventually(lambda: len(relay) == 0, 10, "both reports answered")
    assert fake.log == ["ReportProcessFault", "ReportProcessFault", "ReportRecoverStrategy"]


async def test_a_chained_report_of_a_cycle_that_ended_is_withdrawn(
        clusterd: tuple[ClusterD, str], outbox: tuple[Relay, OneCycle, BridgeMetrics]) -> None:
    fake, _ = clusterd
    relay, session, metrics = outbox
    await fault_report_on_the_wire(fake, relay)
    relay.submit_cycle_report("stop_complete", CYCLE, b"")
    session.end()  # the stream reset: the stop-complete must never reach the next cycle
    assert dropped(metrics, "stop_complete", "cycle_ended") == 1
    fake.release.set()
    await eventually(lambda: len(relay) == 0, 10, "the fault report answered")
    await asyncio.sleep(0.05)  # the behaviour under test: nothing else goes out
    assert fake.log == ["ReportProcessFault"]


async def test_settle_counts_a_chained_report_as_on_the_wire(
        clusterd: tuple[ClusterD, str], outbox: tuple[Relay, OneCycle, BridgeMetrics]) -> None:
    fake, _ = clusterd
    relay, _, _ = outbox
    await fault_report_on_the_wire(fake, relay)
    assert await relay.settle(0.05)  # a fault report alone never holds a Subscribe back
    relay.submit_cycle_report("stop_complete", CYCLE, b"")
    assert not await relay.settle(0.05)  # chained: it may leave at any moment
    fake.release.set()
    assert await relay.settle(10)
    assert fake.log == ["ReportProcessFault", "ReportStopComplete"]


@pytest.mark.parametrize("limit", [2])
async def test_a_full_outbox_drops_a_waiting_cycle_report_never_the_one_on_the_wire_or_chained(
        clusterd: tuple[ClusterD, str], outbox: tuple[Relay, OneCycle, BridgeMetrics]) -> None:
    fake, _ = clusterd
    relay, _, metrics = outbox
    await fault_report_on_the_wire(fake, relay)
    relay.submit_cycle_report("strategy", CYCLE, b"")  # chained to the fault report
    relay.submit_cycle_report("result", CYCLE, b"")  # one over the bound of 2
    assert dropped(metrics, "result", "outbox_full") == 1
    assert dropped(metrics, "strategy", "outbox_full") == 0
    relay.submit_faults({4: 0})  # fault reports are never dropped: it waits behind the strategy
    fake.release.set()
    await eventually(lambda: len(relay) == 0, 10, "the outbox emptied")
    assert fake.log == ["ReportProcessFault", "ReportRecoverStrategy", "ReportProcessFault"]
