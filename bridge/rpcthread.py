"""The report RPCs on a thread of their own, over a synchronous gRPC channel.

Made with ``grpc.aio`` from the event loop, the controller's reports reached ClusterD
later than the synchronous MindCluster client's, and much later when the node's cores
are busy (docs/performance.md, "Measurements behind the design"): ``grpc.aio`` hands the
call's completion-queue work between the loop and gRPC's own poller thread, and each of
those wake-ups waits for a core when the cores are busy. A synchronous call drives its
completion queue on the calling thread.

The event loop must never block, so the call runs here, on one thread that only makes
these calls, and the loop awaits a future this thread resolves. Only the four Report*
calls come here (``THREADED``): they go out one at a time (the outbox, ``relay.py``), so
a queue never builds up behind a slow one; the stream, Init and Register stay on the
``grpc.aio`` channel. The thread and its channel start with the client's first
subscription (``ClusterDClient.subscribe``): every report follows one, so the channel is
connected before the first report, and a client that never subscribes has neither.
Every call carries its deadline; ``close`` ends the thread and closes the channel, which
cancels a call in flight.

Whether a failed call provably never reached ClusterD is decided from *this* channel's
connectivity when the call started (``ready``), as ``clusterd.ClusterDClient`` does for
its own channel: never-resend depends on it. The same connectivity shows ClusterD closing
the connection (a GOAWAY, e.g. ``too_many_pings`` from a release that enforces gRPC's
default ping policy, or a lost connection): the channel leaves READY while nobody closed
it, and ``on_lost`` is told (logged and counted by the client), since gRPC itself only
reconnects silently at the next call.

**Chained calls.** On the recovery's critical path the controller reports twice in a row
(the cycle's second ``report_fault_ranks``, then ``report_strategies``). ClusterD must get
the second request only once the first was answered with code 0 (the outbox's order), and
the synchronous client sends it the moment that answer arrives, from the same thread.
Going back to the loop in between costs two thread wake-ups, each a scheduling delay on
busy cores (the end-to-end report path under load). So the outbox may queue the next request here
*chained* to the one on the wire: this thread sends it straight after its predecessor
answered code 0, and never sends it otherwise (``ChainBroken``: it provably never left).
Until this thread takes a chained call, ``cancel`` withdraws it for good (its cycle
ended); once taken it is on the wire, like any call in flight.

**Calls made by the hand-off thread.** The report lane's calls (``fastlane.py``) are not
queued here: the hand-off thread, already awake with the report, makes them itself
(``make``) on this channel, which saves the wake-up of this thread between the callback
and the wire. Calls are made one at a time whichever of the two threads makes them
(``_calling``), so a chained call follows the very call it names, as above.

**Once the request is written.** The hand-off thread runs ``SCHED_FIFO`` while it waits
for the answer (``fastlane.py``), but it must not be realtime when it writes the request.
Traced with the scheduler's events on a loopback node: the write wakes ClusterD's
receiving thread with a sync hint, so Linux places it on the writer's CPU, where it
preempts a normal-policy writer at once (the synchronous client) but cannot preempt a
realtime one; it then went to the other CPU, idle and slow to wake. So ``make`` runs its ``on_sent`` (the promotion) right after
gRPC has written the request (``lowlevel.after_send``: gRPC's internal structure, the
one place the bridge reaches into it). Where a gRPC release has none of it, ``on_sent``
runs just before the call, as before, and ``after_send`` says so (a guard test fails on
such a release, so an upgrade cannot lose it silently).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from . import lowlevel, realtime
from .reporttypes import REPORT_METHODS

log = logging.getLogger(__name__)

#: The unary methods made on this thread: the report path's four.
THREADED = REPORT_METHODS


class ChainBroken(Exception):
    """A chained call was never sent: its predecessor did not answer code 0, or it was
    cancelled before this thread took it."""


class Call:
    """One call on its way through the thread; the loop keeps it to await or cancel."""

    __slots__ = (
        "adopted",
        "after",
        "cancelled",
        "cycle",
        "future",
        "loop",
        "method",
        "payload",
        "prepare",
        "started",
        "taken",
        "timeout",
        "was_ready",
    )

    def __init__(self, method: str, payload: bytes, timeout: float, future: asyncio.Future[Any],
                 loop: asyncio.AbstractEventLoop, after: Call | None) -> None:
        self.method = method
        self.payload = payload
        self.timeout = timeout
        self.future = future
        self.loop = loop
        self.after = after  # chained: sent only right after this call answered code 0
        self.cancelled = False
        self.taken = False  # the thread took it: from then on it is (being) sent
        self.started = time.monotonic()  # when it went on the wire (set by the thread)
        self.was_ready = False  # the channel was connected when it went on the wire
        # The report lane's (bridge/fastlane.py): the payload, made by the thread that
        # makes the call (None: not to be sent).
        self.prepare: Callable[[], bytes | None] | None = None
        self.cycle: str | None = None  # the cycle the lane bound a cycle-bound report to
        self.adopted = False  # the outbox took charge of it (a lane's call)

    @classmethod
    def blank(cls, loop: asyncio.AbstractEventLoop) -> Call:
        """A call for the report lane to ``fill`` later (any thread). The lane makes the
        next one ahead, after a call answered: creating it (its future asks the loop for
        its debug mode, a Python call) cost a measurable share of a report's hop on the way to the
        wire, where the path runs cold (docs/performance.md)."""
        return cls("", b"", 0.0, loop.create_future(), loop, None)

    def fill(self, method: str, timeout: float, after: Call | None,
             prepare: Callable[[], bytes | None]) -> Call:
        """A ``blank`` call made into the lane's: ``prepare`` makes the payload on the
        thread that makes the call (None: it is not made, ``ChainBroken``) and may not
        raise; the caller makes it with ``RpcThread.make``."""
        self.method, self.timeout, self.after, self.prepare = method, timeout, after, prepare
        return self


class RpcThread:
    """One thread, one synchronous channel, one call at a time."""

    _STOP = object()

    def __init__(self, channel: grpc.Channel, response_deserializer: Any, realtime_priority: int = 0,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.channel = channel
        self._on_lost = on_lost
        self._closing = False
        self._realtime_priority = realtime_priority
        self.realtime = False  # True once the thread runs under SCHED_FIFO (bridge/realtime.py)
        self._deserialize = response_deserializer
        self._callables: dict[str, Any] = {}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._take = threading.Lock()  # a chained call is either taken or cancelled, never both
        self._calling = threading.Lock()  # one call at a time, on this thread or the hand-off's
        self._last: Call | None = None  # the call made before the next one
        self._on_sent: Callable[[], None] | None = None  # the call being made's (under ``_calling``)
        self.after_send = True  # on_sent runs after the write (False: gRPC has no _channel to wrap)
        self._answered_ok = False  # ... and it answered code 0: a call chained to it may follow
        self.state = grpc.ChannelConnectivity.IDLE
        channel.subscribe(self._on_state, try_to_connect=True)  # connect now: the first report must not wait
        self._thread = threading.Thread(target=self._serve, name="tft-rpc", daemon=True)
        self._thread.start()

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        """On gRPC's connectivity thread; never raises into it."""
        was_ready, self.state = self.state is grpc.ChannelConnectivity.READY, state
        if was_ready and state is not grpc.ChannelConnectivity.READY and not self._closing and self._on_lost:
            try:
                self._on_lost()
            except Exception:  # noqa: BLE001 - a logging/metrics failure must not break gRPC's thread
                log.exception("reporting the report channel's lost connection failed")

    @property
    def ready(self) -> bool:
        return self.state is grpc.ChannelConnectivity.READY

    def submit(self, method: str, payload: bytes, timeout: float, after: Call | None = None) -> Call:
        """Queue a call (on the loop); its future gets the deserialized response or the
        ``grpc.RpcError`` the call ended with. With ``after``: send it only if ``after`` is
        the call this thread made just before it and it answered code 0; else its future
        fails with ``ChainBroken`` and it never leaves."""
        return self.submit_from(asyncio.get_running_loop(), method, payload, timeout, after)

    def submit_from(self, loop: asyncio.AbstractEventLoop, method: str, payload: bytes, timeout: float,
                    after: Call | None = None) -> Call:
        """``submit`` from any thread: the future belongs to ``loop`` and is only ever
        resolved there."""
        call = Call(method, payload, timeout, loop.create_future(), loop, after)
        self._queue.put(call)
        return call

    def cancel(self, call: Call) -> bool:
        """Withdraw a queued call; True when it is now certain never to be sent."""
        with self._take:
            if call.taken:
                return False
            call.cancelled = True
            return True

    def _callable(self, method: str) -> Any:
        if method not in self._callables:
            callable_ = self.channel.unary_unary(
                method, request_serializer=None, response_deserializer=self._deserialize)
            if not lowlevel.after_send(callable_, self._sent):
                self.after_send = False
            self._callables[method] = callable_
        return self._callables[method]

    def _sent(self) -> None:
        """On the calling thread, the request written: its ``on_sent``, once. Never
        raises into gRPC's call."""
        action, self._on_sent = self._on_sent, None
        if action is not None:
            try:
                action()
            except Exception:  # noqa: BLE001 - the call goes on whatever the action did
                log.exception("a report call's after-write action failed")

    def _serve(self) -> None:
        self.realtime = realtime.promote(self._realtime_priority, realtime.REPORT)
        while True:
            call = self._queue.get()
            if call is self._STOP:
                return
            if not self.make(call):
                return  # the loop is closed: nobody waits any more

    def make(self, call: Call, on_sent: Callable[[], None] | None = None) -> bool:
        """Make one call on the calling thread: this one's own, or the hand-off thread's for
        the report lane's calls (``Call.fill``). One call at a time
        whichever thread makes it, so "chained" keeps meaning "the very next call". False
        when the call's loop is closed. ``on_sent`` runs on this thread once the request
        is written, before the wait for the answer (see "Once the request is written"),
        and not at all when the call is not made."""
        with self._calling:  # one function, not two: this runs cold between a callback and the wire
            with self._take:
                send = not call.cancelled and (call.after is None or (call.after is self._last and self._answered_ok))
                call.taken = send
            self._last, self._answered_ok = call, False
            payload = call.payload
            if send and call.prepare is not None:
                prepared = call.prepare()
                send = prepared is not None
                payload = prepared or b""
            outcome: tuple[Any, BaseException | None] | None = None
            if not send:
                outcome = (None, ChainBroken(call.method))
            elif not call.future.cancelled():  # else its caller stopped waiting (racy, harmless: the call is just made)
                call.started, call.was_ready = time.monotonic(), self.ready
                callable_ = self._callable(call.method)
                self._on_sent = on_sent
                if not self.after_send:
                    self._sent()
                try:
                    outcome = (callable_(payload, timeout=call.timeout), None)
                except Exception as error:  # noqa: BLE001 - grpc.RpcError, or anything else: the caller's to classify
                    outcome = (None, error)
                self._on_sent = None  # the call ended before gRPC started it: not run
                self._answered_ok = outcome[1] is None and getattr(outcome[0], "code", None) == 0
            if outcome is None:
                return True
            try:
                call.loop.call_soon_threadsafe(_resolve, call.future, outcome)
            except RuntimeError:
                return False
            return True

    def close(self, timeout: float = 2.0) -> None:
        """End the thread; closing the channel cancels a call in flight. Any thread."""
        self._closing = True
        self._queue.put(self._STOP)
        try:
            self.channel.unsubscribe(self._on_state)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        self.channel.close()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _resolve(future: asyncio.Future[Any], outcome: tuple[Any, BaseException | None]) -> None:
    if future.done():
        return
    result, error = outcome
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
