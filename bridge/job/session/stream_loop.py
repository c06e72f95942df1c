"""One resubscribing loop for ClusterD's server streams (the signal stream, the auxiliary
streams, the rank table's).

A round: ``prepare`` (the owner's Register, a readiness wait), open the stream, read its
messages until it ends, tell the owner how it ended, pause, again, until ``stop()``. The
pause: none when the owner asks for none, ``recheck_disabled`` when the peer does not
serve the method, else the jittered back-off (bridge/core/backoff.py), reset by a clean end
(ClusterD ends these streams at every cycle end and reset: docs/clusterd.md).

How an owner uses it (``AuxStream``, ``RankTableSubscriber``). ``Session`` maps onto it
as follows (the signal stream: ``decode`` gives (signal, raw bytes))::

    self.loop = StreamLoop("signal", client, SUBSCRIBE, client_info(job_id, role),
                           lambda raw: (pb.ProcessManageSignal.FromString(raw), raw),
                           silence=config.keepalive_interval * config.watchdog_intervals)
    async def run(self):  await self.loop.run(self); self._set_state(STOPPED)
    def stop(self):       self.loop.stop()
    def request_resubscribe(self, reason):  self._end_reason = reason; self.loop.restart()

    async def prepare(self):   # CONNECTING; Init and Register, each retried on RpcFailure
        ...                    # with ``await self.loop.sleep(self.loop.backoff.next())``;
                               # 403 -> RECOVERY_OFF, return Outcome.UNIMPLEMENTED (re-checked
                               # every recheck_disabled); another code -> return Outcome.FAILED;
                               # then catch_up(), await before_subscribe(), count the reconnect,
                               # stream_count += 1; return None
    async def opened(self):    # the Subscribe's head start, subscribe_sent, on_cycles()
    async def handle(self, item):   # catch_up(); live/SUBSCRIBED on the first; stale check,
                                    # track the cycle, on_signal(...)
    def ended(self, end):      # catch_up(), end the cycle, live cleared, on_cycles(); end_reason
                               # from end.outcome (ENDED: cycle_end, SILENT: keepalive_timeout,
                               # FAILED: stream_<status>, goaway(end.detail) -> connection_lost);
                               # return 0.0 after a heard cycle end (ENDED and end.messages),
                               # else BACKOFF and None

Thread: everything runs on the event loop; ``stop`` and ``restart`` too.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from bridge.core.backoff import Backoff
from bridge.core.log_budget import LogBudget, suppressed_note
from bridge.job.session.clusterd import ClusterDClient, RpcFailure

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class Outcome(enum.Enum):
    """How one round ended."""

    ENDED = "ended"  # the stream ended with OK: routine, the back-off is reset
    FAILED = "failed"  # the stream or its preparation failed: logged, the back-off grows
    SILENT = "silent"  # no message within ``silence`` seconds: treated as dead, like FAILED
    UNIMPLEMENTED = "unimplemented"  # the peer does not serve it: re-checked every ``recheck_disabled``
    RESTARTED = "restarted"  # ``restart()`` cut it
    STOPPED = "stopped"  # ``stop()`` cut it: the loop returns


@dataclass(frozen=True)
class StreamEnd:
    """One round's end, as the owner's ``ended`` sees it. ``opened``: the stream call
    was made (False: ``prepare`` ended the round); ``messages``: how many were read;
    ``status``/``detail``: the gRPC status name and details of a failure, else empty."""

    outcome: Outcome
    opened: bool = False
    messages: int = 0
    status: str = ""
    detail: str = ""


class Subscription(Generic[T]):
    """What the owner of a stream supplies; the defaults do nothing. All four run on the
    event loop, one at a time, and none may block it."""

    async def prepare(self) -> Outcome | None:
        """Before each subscription: None to subscribe, else the round's outcome
        (FAILED, UNIMPLEMENTED). A ``grpc.aio.AioRpcError`` or ``RpcFailure`` it raises
        ends the round as FAILED (UNIMPLEMENTED for that status). Cut by ``stop()``."""
        return None

    async def opened(self) -> None:
        """Right after the stream call was made, before its first read. Cut by ``stop()``."""

    async def handle(self, message: T) -> object:
        """One message, in order; the next is read when it returns (its result is not
        used). An exception is logged and the stream goes on."""
        return None

    def ended(self, end: StreamEnd) -> float | None:
        """Told of every round's end, ``stop()``'s included, before the pause; returns
        the pause in seconds, or None for the loop's own (module docstring)."""
        return None


class _StepCancelled(Exception):
    """A step of the round was cancelled by something other than ``stop()``."""


def _unimplemented(error: BaseException) -> bool:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code() is grpc.StatusCode.UNIMPLEMENTED
    return isinstance(error, RpcFailure) and error.status == grpc.StatusCode.UNIMPLEMENTED.name


class StreamLoop(Generic[T]):
    """Subscribes to ``method`` with ``request`` (pre-encoded) on ``client``'s channel,
    opened by the owner beforehand, and hands each message, decoded by ``decode``, to the
    subscription. ``silence``: seconds without a message after which the stream counts as
    dead (None: wait for ever, for streams the peer writes to only on a change).

    State (read by the owner and tests, written here): ``subscribed`` is set while a
    stream is open; ``subscriptions`` counts the streams opened; ``unimplemented`` says
    the last round found the method not served."""

    def __init__(self, name: str, client: ClusterDClient, method: str, request: bytes,
                 decode: Callable[[bytes], T], *, silence: float | None = None) -> None:
        self.name = name
        self.client = client
        self.method = method
        self.request = request
        self.decode = decode
        self.silence = silence
        self.backoff = Backoff(client.config.reconnect_initial, client.config.reconnect_max)
        self.subscribed = asyncio.Event()
        self.subscriptions = 0
        self.unimplemented = False
        self._stopping = asyncio.Event()
        self._restarting = False
        self._call: Any = None
        self._budget = LogBudget(burst=3, window=300.0)

    # ------------------------------------------------------------------ control
    def stop(self) -> None:
        """End the loop: the open stream is cancelled, a pending step cut; ``run`` returns."""
        self._stopping.set()
        if self._call is not None:
            self._call.cancel()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def restart(self) -> None:
        """End the open stream (if any) and go round again after the back-off."""
        if self._call is not None:
            self._restarting = True
            self._call.cancel()

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless stopped first; True when stopping (for an owner's own retries)."""
        try:
            stopped, _ = await self._unless_stopped(asyncio.sleep(seconds))
        except _StepCancelled:  # pragma: no cover - nothing else cancels a sleep
            return False
        return stopped

    # ------------------------------------------------------------------ the loop
    async def run(self, subscription: Subscription[T]) -> None:
        """Rounds until ``stop()``; never raises but for the task's own cancellation."""
        while not self._stopping.is_set():
            end = await self._round(subscription)
            pause = subscription.ended(end)
            if end.outcome is Outcome.STOPPED or self._stopping.is_set():
                break
            if pause is None:
                pause = self._pause(end)
            if pause > 0 and await self.sleep(pause):
                break

    def _pause(self, end: StreamEnd) -> float:
        if end.outcome is Outcome.UNIMPLEMENTED:
            return self.client.config.recheck_disabled
        if end.outcome is Outcome.ENDED:
            self.backoff.reset()  # routine: ClusterD ends these streams at every reset
        return self.backoff.next()

    async def _round(self, subscription: Subscription[T]) -> StreamEnd:
        self._restarting = False
        try:
            stopped, prepared = await self._unless_stopped(subscription.prepare())
        except (grpc.aio.AioRpcError, RpcFailure) as error:
            return self._failed(error, opened=False)
        except _StepCancelled:
            return self._cancelled(opened=False)
        if stopped:
            return StreamEnd(Outcome.STOPPED)
        if prepared is not None:
            return StreamEnd(prepared)
        assert self.client.channel is not None, "the owner opens the client before run()"
        call = self.client.channel.unary_stream(self.method, request_serializer=None,
                                                response_deserializer=self.decode)(self.request, timeout=None)
        self._call = call
        self.subscriptions += 1
        self.subscribed.set()
        messages = 0
        try:
            try:
                stopped, _ = await self._unless_stopped(subscription.opened())
            except _StepCancelled:
                return self._cancelled(opened=True)
            if stopped:
                return StreamEnd(Outcome.STOPPED, opened=True)
            self.unimplemented = False
            while True:
                try:
                    message = await asyncio.wait_for(call.read(), self.silence)
                except asyncio.TimeoutError:
                    log.warning("ClusterD %s stream silent for %.0f s (no keep-alive): treating it as dead",
                                self.name, self.silence or 0.0)
                    return StreamEnd(Outcome.SILENT, opened=True, messages=messages)
                if message is grpc.aio.EOF:
                    return StreamEnd(Outcome.ENDED, opened=True, messages=messages)
                messages += 1
                try:
                    await subscription.handle(message)
                except Exception:  # one bad message must not end the stream
                    log.exception("handling a message of ClusterD's %s stream failed", self.name)
        except asyncio.CancelledError:
            if self._stopping.is_set():
                return StreamEnd(Outcome.STOPPED, opened=True, messages=messages)
            if self._restarting:
                return StreamEnd(Outcome.RESTARTED, opened=True, messages=messages)
            raise
        except grpc.aio.AioRpcError as error:
            if self._stopping.is_set():
                return StreamEnd(Outcome.STOPPED, opened=True, messages=messages)
            if self._restarting and error.code() is grpc.StatusCode.CANCELLED:
                return StreamEnd(Outcome.RESTARTED, opened=True, messages=messages)
            return self._failed(error, opened=True, messages=messages)
        finally:
            self.subscribed.clear()
            call.cancel()
            self._call = None

    def _cancelled(self, *, opened: bool) -> StreamEnd:
        log.warning("preparing ClusterD's %s stream was cancelled; subscribing again after a back-off", self.name)
        return StreamEnd(Outcome.FAILED, opened=opened, status="CANCELLED", detail="a step was cancelled")

    def _failed(self, error: grpc.aio.AioRpcError | RpcFailure, *, opened: bool, messages: int = 0) -> StreamEnd:
        """A failed round, logged (UNIMPLEMENTED once until served again; the rest within
        a budget per status)."""
        if isinstance(error, RpcFailure):
            status, detail = error.status, error.detail
        else:
            status, detail = error.code().name, error.details() or ""
        if _unimplemented(error):
            if not self.unimplemented:
                log.warning("ClusterD does not serve %s (UNIMPLEMENTED, an older release): re-checked every "
                            "%g s", self.method, self.client.config.recheck_disabled)
            self.unimplemented = True
            return StreamEnd(Outcome.UNIMPLEMENTED, opened=opened, messages=messages, status=status, detail=detail)
        self.unimplemented = False
        suppressed = self._budget.allow(status)
        if suppressed is not None:
            log.warning("ClusterD's %s stream ended: %s %s; subscribing again after a back-off%s", self.name,
                        status, detail[:200], suppressed_note(suppressed))
        return StreamEnd(Outcome.FAILED, opened=opened, messages=messages, status=status, detail=detail)

    async def _unless_stopped(self, awaitable: Awaitable[R]) -> tuple[bool, R | None]:
        """Await ``awaitable`` unless ``stop()`` comes first (then it is cancelled):
        (True, None) when stopping, else (False, its result); its exception propagates."""
        if self._stopping.is_set():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            return True, None
        step = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
        if self._stopping.is_set():
            if step.done() and not step.cancelled():
                step.exception()  # retrieved: a late failure of a step cut short is not worth a warning
            return True, None
        if step.cancelled():  # cancelled from inside (its channel closed under it), not by stop()
            raise _StepCancelled()
        return False, step.result()
