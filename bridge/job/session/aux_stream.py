"""One auxiliary ClusterD stream, subscribed for as long as the bridge runs.

Besides the signal stream (``clusterd.Session``) the bridge holds ClusterD's NIC-switch
and stress-test notify streams (``bridge/job/session/operator_actions.py``) and the Fault service's stream
(``bridge/job/session/fault_centre.py``). They share this loop because ClusterD treats them alike:

* **Every recovery cycle ends them.** ClusterD's controller ``reset()`` cancels the
  context its OM listeners wait on, so a notify stream ends with OK at every cycle end and
  at every Subscribe of the signal stream (``om_controller.go``,
  ``listenSwitchNicNotifyChannel``); a listener reads the channel of the reset it was
  opened under, so only a new subscription receives the next request. A clean end is
  routine: subscribe again after the back-off's first step.
* **Before Register they fail** ("not registed, please wait agent register"): the loop
  subscribes only while the signal stream is live (``ready``), i.e. after Register.
* **A release may not serve the method** (v7.3.2's harness: no Fault service, gRPC
  ``UNIMPLEMENTED``): said once in the log and to ``on_unimplemented``, re-checked every
  ``clusterd.recheck_disabled`` seconds.

Every other end is a failure: logged (within a budget), counted in
``tft_bridge_clusterd_stream_failures_total{stream}``, and followed by a re-subscription
after the project's jittered back-off. ``stop()`` ends the loop at once. The stream
rides the signal stream's channel (``ClusterDClient.channel``), so it needs no keep-alive
of its own: the signal stream's traffic keeps that connection's pings within every
release's policy (``clusterd.channel_options``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import grpc

from bridge.core.backoff import Backoff
from bridge.job.session.clusterd import ClusterDClient
from bridge.core.log_budget import LogBudget, suppressed_note
from bridge.job.metrics import BridgeMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")


class AuxStream(Generic[T]):
    """Subscribe to ``method`` with ``request`` and hand each message to ``handle``.

    ``prepare`` runs before each subscription (the Fault service's Register); False
    skips this round (counted as a failure, retried after the back-off); a gRPC error
    it raises counts like the stream's own (``UNIMPLEMENTED`` included). ``handle`` is
    awaited on the loop, one message at a time; an exception in it is logged and counted,
    never ends the loop."""

    def __init__(self, name: str, client: ClusterDClient, metrics: BridgeMetrics, method: str, request: bytes,
                 decode: Callable[[bytes], T], handle: Callable[[T], Awaitable[None]], *,
                 ready: Callable[[], Awaitable[Any]],
                 prepare: Callable[[], Awaitable[bool]] | None = None,
                 on_unimplemented: Callable[[], None] = lambda: None) -> None:
        self.name = name
        self.client = client
        self.metrics = metrics
        self.method = method
        self.request = request
        self.decode = decode
        self.handle = handle
        self.ready = ready
        self.prepare = prepare
        self.on_unimplemented = on_unimplemented
        self.subscribed = asyncio.Event()  # set while a subscription is open (tests wait for it)
        self.subscriptions = 0
        self.unimplemented = False  # the last attempt found the method not served
        self._stopping = asyncio.Event()
        self._call: Any = None
        self._budget = LogBudget(burst=3, window=300.0)

    def stop(self) -> None:
        self._stopping.set()
        if self._call is not None:
            self._call.cancel()

    async def _until(self, awaitable: Awaitable[Any], seconds: float | None = None) -> bool:
        """Wait for ``awaitable`` (at most ``seconds``) unless stopped first; True when stopping."""
        stop = asyncio.ensure_future(self._stopping.wait())
        other = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait({stop, other}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stop, other):
                task.cancel()
            await asyncio.gather(stop, other, return_exceptions=True)
        return self._stopping.is_set()

    async def run(self) -> None:
        config = self.client.config
        backoff = Backoff(config.reconnect_initial, config.reconnect_max)
        while not self._stopping.is_set():
            if await self._until(self.ready()):
                break
            outcome = await self._once()
            if self._stopping.is_set():
                break
            if outcome == "unimplemented":
                if await self._until(asyncio.sleep(config.recheck_disabled)):
                    break
                continue
            if outcome == "ended":
                backoff.reset()  # routine: ClusterD ends these streams at every reset
            else:
                self.metrics.aux_stream_failures.labels(self.name).inc()
            if await self._until(asyncio.sleep(backoff.next())):
                break

    async def _once(self) -> str:
        """One subscription: ``ended`` (clean end), ``failed`` or ``unimplemented``."""
        call: Any = None
        try:
            if self.prepare is not None and not await self.prepare():
                return "failed"
            if self._stopping.is_set():  # stopped during prepare: no call to cancel yet
                return "ended"
            assert self.client.channel is not None
            call = self.client.channel.unary_stream(self.method, request_serializer=None,
                                                    response_deserializer=self.decode)(self.request, timeout=None)
            self._call = call
            self.subscriptions += 1
            self.subscribed.set()
            self.unimplemented = False
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    return "ended"
                try:
                    await self.handle(message)
                except Exception:  # one bad message must not end the stream
                    log.exception("handling a message of ClusterD's %s stream failed", self.name)
                    self.metrics.aux_stream_failures.labels(self.name).inc()
        except asyncio.CancelledError:
            if self._stopping.is_set():
                return "ended"
            raise
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.UNIMPLEMENTED:
                if not self.unimplemented:
                    log.warning("ClusterD does not serve %s (UNIMPLEMENTED, an older release): re-checked every "
                                "%.0f s", self.method, self.client.config.recheck_disabled)
                self.unimplemented = True
                self.on_unimplemented()
                return "unimplemented"
            self.unimplemented = False
            suppressed = self._budget.allow(error.code())
            if suppressed is not None:
                log.warning("ClusterD's %s stream ended: %s %s; subscribing again after a back-off%s", self.name,
                            error.code().name, (error.details() or "")[:200], suppressed_note(suppressed))
            return "failed"
        finally:
            self.subscribed.clear()
            if call is not None:
                call.cancel()
            self._call = None
