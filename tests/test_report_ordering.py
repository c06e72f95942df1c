"""A report of an ended stream never reaches ClusterD after the next Subscribe, and the
loop knows the controller's reports before it reacts to ClusterD.

ClusterD's Subscribe resets the job's cycle and empties its one-slot report buffers; a
stop-complete still on the wire when the stream ended (it crossed the server's end of
stream) would otherwise land in the *new* cycle's buffer and be consumed as
its answer. The Report* calls travel on a connection of their own, so only the bridge
can order the two: the session awaits the wire's ``settle`` before every Subscribe, and
once the loop has published the stream's end no cycle-bound report of it starts
(tests/test_relay.py holds ``settle`` itself).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc

from bridge._proto import recover_pb2 as pb
from bridge.job.session.signal_session import Session
from bridge.job.session.codes import Code
from bridge.core.config import ClusterDConfig
from bridge.core.backoff import Backoff
from bridge.job.metrics import BridgeMetrics
from bridge.job.cycle_state import Cycles, CycleState
from bridge.job.reports.kinds import report_of

from .conftest import eventually
from .wire_rig import WireRig

JOB = "job-order"


@dataclass
class GatedClient:
    """A ClusterD client for the session (Init and Register answer 0), which writes every
    Subscribe into the test's log."""

    config: ClusterDConfig = field(default_factory=ClusterDConfig)
    log: list[str] = field(default_factory=list)

    async def call(self, method: str, payload: bytes, timeout: float | None = None) -> int:
        return Code.OK

    def subscribe(self, job_id: str, role: str) -> Any:
        self.log.append("Subscribe")
        return EndedStream()

    @property
    def channel(self) -> Any:
        """The signal channel as the stream loop opens the stream on it."""
        return SimpleNamespace(unary_stream=lambda method, **how: lambda request, timeout=None: self.subscribe("", ""))


class EndedStream:
    """A stream ClusterD ends at once (the routine end of a cycle)."""

    async def read(self) -> Any:
        return grpc.aio.EOF

    def cancel(self) -> None:
        pass


def gated_stop_complete(log: list[str], gate: threading.Event) -> Callable[[bytes, Any], bytes]:
    """ClusterD's ReportStopComplete, answered once the test opens ``gate``; logged."""
    def answer(request: bytes, context: Any) -> bytes:
        log.append("ReportStopComplete sent")
        gate.wait(30)
        log.append("ReportStopComplete answered")
        return pb.Status(code=Code.OK).SerializeToString()
    return answer


async def test_the_next_subscribe_waits_for_the_report_of_the_ended_stream() -> None:
    client = GatedClient(config=ClusterDConfig(reconnect_initial=0.01, reconnect_max=0.02))
    gate = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("Recover", {
        "ReportStopComplete": grpc.unary_unary_rpc_method_handler(gated_stop_complete(client.log, gate))}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    metrics = BridgeMetrics()
    listener = SimpleNamespace(taken=lambda reports: None, dropped=lambda *args: None,
                               outcome_unknown=lambda kind: None, faults_delivered=lambda *args: None)
    wire = WireRig(JOB, grpc.insecure_channel(f"127.0.0.1:{port}"), asyncio.get_running_loop(), listener,  # type: ignore[arg-type]
                   metrics, rpc_timeout=10.0, backoff=Backoff(0.01, 0.02)).start()
    wire.publish(Cycles(live=True, running="uuid-1", stream="stream:1", answering="uuid-1"))
    wire.put(report_of("report_stop_complete", (0, "", {}), time.monotonic()))
    await eventually(lambda: "ReportStopComplete sent" in client.log, what="the report on the wire")
    session = Session(JOB, client, metrics, wire.cycles, SimpleNamespace(submit=lambda screened: None),  # type: ignore[arg-type]
                      wire.wire)
    # The stream's end as the session tells the cycle state, before it settles and subscribes.
    wire.cycles.stream_ended("cycle_end")
    session_task = asyncio.create_task(session.run())
    try:
        # The session would subscribe at once (Init and Register answer 0); it must not
        # while the report is on the wire. Waiting for the session to reach its hook:
        await eventually(lambda: session.state.value == "connecting", what="the session connecting")
        for _ in range(20):
            await asyncio.sleep(0)  # the behaviour under test: no Subscribe happens meanwhile
        assert "Subscribe" not in client.log
        gate.set()
        await eventually(lambda: "Subscribe" in client.log, what="the Subscribe after the report")
        assert client.log.index("ReportStopComplete answered") < client.log.index("Subscribe")
    finally:
        session.stop()
        session_task.cancel()
        await asyncio.gather(session_task, return_exceptions=True)
        await asyncio.to_thread(wire.stop, 5.0)
        gate.set()
        server.stop(None)


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
    """The wire sends a report before the loop knows it (bridge/job/reports/relay.py); the loop must
    know it before it handles whatever ClusterD sent after that report."""
    client = GatedClient(config=ClusterDConfig(reconnect_initial=0.01, reconnect_max=0.02))
    log = client.log
    signal = pb.ProcessManageSignal(jobId=JOB, uuid="uuid-1", signalType="stopTrain", actions=["stop_train"])
    client.subscribe = lambda job_id, role: (log.append("Subscribe"), OneSignalStream(log, signal))[1]  # type: ignore[method-assign]
    cycles = CycleState(SimpleNamespace(answering=None), lambda: None)  # type: ignore[arg-type]
    session = Session(JOB, client, BridgeMetrics(), cycles,  # type: ignore[arg-type]
                      SimpleNamespace(submit=lambda screened: log.append(f"signal {screened.signal.signalType}")),
                      SimpleNamespace(catch_up=lambda: log.append("catch up")))
    task = asyncio.create_task(session.run())
    try:
        await eventually(lambda: log.count("Subscribe") >= 2, what="the stream ended and the next one opened")
    finally:
        session.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    first = log[:log.index("Subscribe", log.index("Subscribe") + 1) + 1]
    # Before the Subscribe, before each message, at the stream's end: once each.
    assert first == ["catch up", "Subscribe", "read", "catch up", "signal stopTrain", "read", "catch up",
                     "catch up", "Subscribe"]
