"""A report of an ended stream never reaches ClusterD after the next Subscribe.

ClusterD's Subscribe resets the job's cycle and empties its one-slot report buffers; a
stop-complete still on the wire when the stream ended (it crossed the server's end of
stream) would otherwise land in the *new* cycle's buffer and be consumed as
its answer. The Report* calls travel on a connection of their own, so only the bridge
can order the two: the session awaits the outbox's ``settle`` before every Subscribe.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc

from bridge._proto import recover_pb2 as pb
from bridge.clusterd import Session
from bridge.codes import Code
from bridge.config import ClusterDConfig
from bridge.metrics import BridgeMetrics
from bridge.relay import Relay

from .conftest import eventually

JOB = "job-order"


@dataclass
class GatedClient:
    """A ClusterD client whose Report* calls wait for the test's gate, and which writes
    every call and every Subscribe into one ordered log."""

    config: ClusterDConfig = field(default_factory=ClusterDConfig)
    log: list[str] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def call(self, method: str, payload: bytes, timeout: float | None = None) -> int:
        name = method.rsplit("/", 1)[-1]
        if name.startswith("Report"):
            self.log.append(f"{name} sent")
            await self.gate.wait()
            self.log.append(f"{name} answered")
        return Code.OK

    def submit(self, method: str, payload: bytes, after: Any = None) -> None:
        return None  # no report thread: every call goes through ``call``

    def unchain(self, call: Any) -> bool:
        return False

    def subscribe(self, job_id: str, role: str) -> Any:
        self.log.append("Subscribe")
        return EndedStream()


class EndedStream:
    """A stream ClusterD ends at once (the routine end of a cycle)."""

    async def read(self) -> Any:
        return grpc.aio.EOF

    def cancel(self) -> None:
        pass


class LiveCycle:
    """The session as the outbox sees it: one live cycle, ``uuid-1``."""

    def __init__(self) -> None:
        self.live = asyncio.Event()
        self.live.set()
        self.cycle_listeners: list[Any] = []

    def cycle_alive(self, token: str | None) -> bool:
        return token == "uuid-1"

    def request_resubscribe(self, reason: str) -> None:
        pass


def outbox(client: GatedClient, session: LiveCycle, metrics: BridgeMetrics) -> Relay:
    """An outbox over the test's client and session, its drops and unknown outcomes unheard."""
    return Relay(JOB, client, session, metrics, on_drop=lambda kind, cycle, reason: None,  # type: ignore[arg-type]
                 on_outcome_unknown=lambda kind: None)


async def settled() -> bool:
    """``before_subscribe`` with no report on the wire."""
    return True


async def test_settle_waits_while_a_cycle_report_is_on_the_wire() -> None:
    client = GatedClient()
    relay = outbox(client, LiveCycle(), BridgeMetrics())
    task = asyncio.create_task(relay.run())
    try:
        assert await relay.settle(0.1)  # nothing on the wire yet
        relay.submit_cycle_report("stop_complete", "uuid-1", b"payload")
        await eventually(lambda: "ReportStopComplete sent" in client.log, what="the report on the wire")
        assert not await relay.settle(0.05)  # still on the wire: not settled
        settled = asyncio.create_task(relay.settle(5.0))
        await asyncio.sleep(0)  # the behaviour under test: settle must still be waiting here
        assert not settled.done()
        client.gate.set()
        assert await settled
        assert client.log == ["ReportStopComplete sent", "ReportStopComplete answered"]
    finally:
        relay.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_next_subscribe_waits_for_the_report_of_the_ended_stream() -> None:
    client = GatedClient(config=ClusterDConfig(reconnect_initial=0.01, reconnect_max=0.02))
    metrics = BridgeMetrics()
    relay = outbox(client, LiveCycle(), metrics)
    session = Session(JOB, client, metrics, on_signal=lambda *args: None,  # type: ignore[arg-type]
                      catch_up=lambda: None, before_subscribe=lambda: relay.settle(5.0))
    relay_task = asyncio.create_task(relay.run())
    relay.submit_cycle_report("stop_complete", "uuid-1", b"payload")
    await eventually(lambda: "ReportStopComplete sent" in client.log, what="the report on the wire")
    session_task = asyncio.create_task(session.run())
    try:
        # The session would subscribe at once (Init and Register answer 0); it must not
        # while the report is on the wire. Waiting for the session to reach its hook:
        await eventually(lambda: session.state.value == "connecting", what="the session connecting")
        for _ in range(20):
            await asyncio.sleep(0)  # the behaviour under test: no Subscribe happens meanwhile
        assert "Subscribe" not in client.log
        client.gate.set()
        await eventually(lambda: "Subscribe" in client.log, what="the Subscribe after the report")
        assert client.log.index("ReportStopComplete answered") < client.log.index("Subscribe")
    finally:
        session.stop()
        relay.stop()
        for task in (session_task, relay_task):
            task.cancel()
        await asyncio.gather(session_task, relay_task, return_exceptions=True)


class OneSignalStream:
    """A stream that carries one signal, then ends; each read logged."""

    def __init__(self, log: list[str], signal: pb.ProcessManageSignal) -> None:
        self.log = log
        self.items: list[Any] = [(signal, signal.SerializeToString()), grpc.aio.EOF]

    async def read(self) -> Any:
        self.log.append("read")
        return self.items.pop(0) if self.items else grpc.aio.EOF

    def cancel(self) -> None:
        pass


async def test_the_session_catches_up_with_the_reports_before_it_reacts_to_clusterd() -> None:
    """The report lane sends a report before the loop knows it (bridge/fastlane.py); the
    loop must know it before it handles whatever ClusterD sent after that report."""
    client = GatedClient(config=ClusterDConfig(reconnect_initial=0.01, reconnect_max=0.02))
    log = client.log
    signal = pb.ProcessManageSignal(jobId=JOB, uuid="uuid-1", signalType="stopTrain", actions=["stop_train"])
    client.subscribe = lambda job_id, role: (log.append("Subscribe"), OneSignalStream(log, signal))[1]  # type: ignore[method-assign]
    session = Session(JOB, client, BridgeMetrics(),  # type: ignore[arg-type]
                      on_signal=lambda signal, raw, token: log.append(f"signal {signal.signalType}"),
                      catch_up=lambda: log.append("catch up"), before_subscribe=settled)
    task = asyncio.create_task(session.run())
    try:
        await eventually(lambda: log.count("Subscribe") >= 2, what="the stream ended and the next one opened")
    finally:
        session.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    first = log[:log.index("Subscribe", log.index("Subscribe") + 1) + 1]
    assert first == ["catch up", "Subscribe", "read", "catch up", "signal stopTrain", "read", "catch up",
                     "catch up", "catch up", "Subscribe"]
