"""The simulated ClusterD's channels: one-slot report buffers and the signal outbox.

ClusterD hands every report to its state machine through a Go channel of capacity 1 and
sends signals through another. The OM channels (NIC switch, stress test) are one-slot too. Their quirks are the protocol's sharpest edges, so they
are modelled exactly: a put into an empty slot succeeds with nobody waiting; a put into
a full slot blocks until the slot drains or the channel is closed by a reset (the RPC
then answers 599); a closed slot's contents are simply gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc

from bridge._proto import recover_pb2 as pb

T = TypeVar("T")


#: ClusterD's one-slot report buffers, by kind (``ReportSlot``), read by the job's cycle.
STOP_COMPLETE = "stop_complete"
RECOVER_STRATEGY = "recover_strategy"
RECOVER_STATUS = "recover_status"
REPORT_KINDS = (STOP_COMPLETE, RECOVER_STRATEGY, RECOVER_STATUS)


class ReportSlot(Generic[T]):
    """A Go ``chan T`` of capacity 1 that is closed (never reopened) by a reset."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._queue: asyncio.Queue[T] = asyncio.Queue(maxsize=1)
        self._closed = asyncio.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def full(self) -> bool:
        return self._queue.full()

    async def put(self, item: T, on_block: Callable[[], None] | None = None) -> bool:
        """Insert ``item``; True once it is in the slot, False if a reset closed the slot
        first. Blocks for as long as the slot stays full (the caller bounds nothing: the
        real server's goroutine outlives the client's deadline too). ``on_block`` is
        called once, right when the put finds the slot full and starts waiting: from then
        on only a drain or a reset ends it, which is what tests need to know before they
        reset (a blocked report then gets 599, never 0)."""
        if self.closed:
            return False
        if not self._queue.full():
            self._queue.put_nowait(item)
            return True
        if on_block is not None:
            on_block()
        putter = asyncio.ensure_future(self._queue.put(item))
        closer = asyncio.ensure_future(self._closed.wait())
        try:
            done, _ = await asyncio.wait({putter, closer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (putter, closer):
                if not task.done():
                    task.cancel()
        return putter in done and not putter.cancelled()

    async def get(self, timeout: float) -> T | None:
        """The buffered or next report, or None after ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    def close(self) -> None:
        self._closed.set()


@dataclass
class Outgoing:
    """A signal waiting for the stream writer. ``sent`` (state-machine signals only) is
    resolved once the write returned: like ClusterD, delivery is assumed at that point."""

    signal: pb.ProcessManageSignal
    sent: asyncio.Future[None] | None = None


@dataclass
class StreamEnd:
    code: grpc.StatusCode
    reason: str


@dataclass
class Subscriber(Generic[T]):
    """One live stream: SubscribeProcessManageSignal (items are :class:`Outgoing`) or
    SubscribeRankTable (items are ``RankTableStream`` messages)."""

    stream_id: int
    queue: asyncio.Queue[T]
    ended: asyncio.Future[StreamEnd] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def end(self, code: grpc.StatusCode, reason: str) -> None:
        """Ask the stream to finish with ``code``; the first request wins."""
        if not self.ended.done():
            self.ended.set_result(StreamEnd(code, reason))

    async def next(self) -> T | None:
        """The next signal to write, or None once the stream has been told to end (an
        end request wins over a queued signal: the real sender stops at once)."""
        if self.ended.done():
            return None
        getter = asyncio.ensure_future(self.queue.get())
        waiters: set[asyncio.Future[Any]] = {getter, self.ended}
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if self.ended.done():
            if getter.done() and not getter.cancelled():
                _abandon(getter.result())
            return None
        return getter.result()


def _abandon(item: object) -> None:
    """A signal taken off the queue but never written: make sure nobody waits on it."""
    if isinstance(item, Outgoing) and item.sent is not None and not item.sent.done():
        item.sent.set_exception(ConnectionError("the stream ended before the signal was written"))
        item.sent.exception()  # retrieved: the waiter may already be cancelled by the reset


async def next_item(queue: asyncio.Queue[T], stop: asyncio.Event) -> T | None:
    """The queue's next item, or None once ``stop`` is set first (an item already taken
    off the queue is still returned, never lost)."""
    if stop.is_set():
        return None
    getter = asyncio.ensure_future(queue.get())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({getter, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not getter.done():
            getter.cancel()
    return getter.result() if getter.done() and not getter.cancelled() else None


class OmChannels:
    """The OM channels one ClusterD ``reset()`` creates (``initControllerChan``)."""

    def __init__(self) -> None:
        self.switch_notify: asyncio.Queue[pb.SwitchRankList] = asyncio.Queue(maxsize=1)
        self.stress_notify: asyncio.Queue[pb.StressTestRankParams] = asyncio.Queue(maxsize=1)
        self.switch_result: asyncio.Queue[pb.SwitchResult] = asyncio.Queue(maxsize=1)
        self.stress_result: asyncio.Queue[pb.StressTestResult] = asyncio.Queue(maxsize=1)
        self.responses: asyncio.Queue[str] = asyncio.Queue()
        self.notified = asyncio.Event()  # a listener wrote the notify (NotifySuccessEvent)
        self.operation = ""  # "switch_nic" or "stress_test" while a flow runs
        self.closed = asyncio.Event()
        self.server_stopped = False  # closed by a server stop: the streams end UNAVAILABLE, not OK

    def close(self) -> None:
        self.closed.set()

    def respond(self, message: str) -> None:
        """``replyOMResponse``: only while an OM flow runs."""
        if self.operation:
            self.responses.put_nowait(message)
