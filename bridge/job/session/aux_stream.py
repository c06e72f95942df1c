"""One auxiliary ClusterD stream, subscribed for as long as the bridge runs: the NIC-switch
and stress-test notify streams (``operator_actions.py``) and the Fault service's stream
(``fault_centre.py``), each on the signal stream's channel (``ClusterDClient.channel``).

Contract: a subscription is attempted only while the signal stream is live (``ready``:
they fail before Register, docs/clusterd.md); ``prepare`` runs before each; messages go
to ``handle`` one at a time on the event loop. A clean end is routine (ClusterD ends
these streams at every reset) and re-subscribed after the back-off's first step; a
failure is logged (``StreamLoop``) and counted in
``tft_bridge_clusterd_stream_failures_total{stream}``; ``UNIMPLEMENTED`` goes to
``on_unimplemented`` and is re-checked every ``clusterd.recheck_disabled`` seconds.
``stop()`` ends ``run()`` at once. No keep-alive of its own: the signal stream's traffic
keeps the shared connection's pings within every release's policy
(``clusterd.channel_options``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from bridge.job.metrics import BridgeMetrics
from bridge.job.session.clusterd import ClusterDClient
from bridge.job.session.stream_loop import Outcome, StreamEnd, StreamLoop, Subscription

log = logging.getLogger(__name__)

T = TypeVar("T")


class AuxStream(Subscription[T]):
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
        self.metrics = metrics
        self._handle = handle
        self._ready = ready
        self._prepare = prepare
        self._on_unimplemented = on_unimplemented
        self.loop: StreamLoop[T] = StreamLoop(name, client, method, request, decode)

    @property
    def subscribed(self) -> asyncio.Event:
        """Set while a subscription is open (tests wait for it)."""
        return self.loop.subscribed

    @property
    def unimplemented(self) -> bool:
        """The last attempt found the method not served."""
        return self.loop.unimplemented

    async def run(self) -> None:
        await self.loop.run(self)

    def stop(self) -> None:
        self.loop.stop()

    # ------------------------------------------------------------------ Subscription
    async def prepare(self) -> Outcome | None:
        await self._ready()
        if self._prepare is not None and not await self._prepare():
            return Outcome.FAILED
        return None

    async def handle(self, message: T) -> None:
        try:
            await self._handle(message)
        except Exception:  # one bad message must not end the stream
            log.exception("handling a message of ClusterD's %s stream failed", self.name)
            self.metrics.aux_stream_failures.labels(self.name).inc()

    def ended(self, end: StreamEnd) -> float | None:
        if end.outcome is Outcome.UNIMPLEMENTED:
            self._on_unimplemented()
        elif end.outcome in (Outcome.FAILED, Outcome.SILENT):
            self.metrics.aux_stream_failures.labels(self.name).inc()
        return None
