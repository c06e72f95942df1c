"""A report wire built as ``bridge.job.assembly.Link`` builds it (its inbox and its cycle
state beside it), for the tests of the wire alone: the test plays the loop's side."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import grpc

from bridge.job.cycle_state import Cycles, CycleState
from bridge.job.metrics import BridgeMetrics
from bridge.job.reports.kinds import report_of
from bridge.job.reports.relay import ReportInbox, Wire, WireListener


class NoRpcs:
    def observe_rpc(self, method: str, code: int | str, started: float, seconds: float) -> None:
        pass


class WireRig:
    """The wire, its inbox and its cycle state; ``publish`` sets the cycle state whole,
    as the loop's parts (session, dispatcher, resume) do between them."""

    def __init__(self, job_id: str, channel: grpc.Channel, loop: asyncio.AbstractEventLoop, listener: WireListener,
                 metrics: BridgeMetrics, *, rpcs: Any = None, **options: Any) -> None:
        self.flow = SimpleNamespace(answering=None)
        self.inbox = ReportInbox()
        self.cycles = CycleState(self.flow, self.inbox.wake)  # type: ignore[arg-type]
        self.wire = Wire(job_id, channel, loop, self.inbox, self.cycles, listener, rpcs or NoRpcs(), metrics,
                         **options)
        self.put = self.inbox.put
        self.pin = self.wire.pin

    def start(self) -> WireRig:
        self.wire.start()
        return self

    def publish(self, cycles: Cycles) -> None:
        self.flow.answering = cycles.answering
        self.cycles._publish(live=cycles.live, subscribed=cycles.subscribed, running=cycles.running,
                             stream=cycles.stream, rebound=cycles.rebound)

    def report(self, callback: str, *args: Any, waiter: Future[int] | None = None) -> None:
        """A controller report put as the callbacks put it."""
        self.put(report_of(callback, args, time.monotonic(), waiter))

    async def settle(self, timeout: float) -> bool:
        return await self.cycles.settle(timeout)

    def catch_up(self) -> None:
        self.wire.catch_up()

    def handed_all(self) -> bool:
        return self.wire.handed_all()

    def stop(self, timeout: float) -> None:
        self.wire.stop(timeout)

    def __len__(self) -> int:
        return len(self.wire)
