"""The report RPCs on a thread of their own, over a synchronous gRPC channel.

Issue 16 measured the controller's reports reaching ClusterD later than the synchronous
MindCluster client's, and much later when the node's cores are busy. On loopback against
the simulated ClusterD in its own process (``bench/bench_loaded.py``), with two busy
processes on the 2-core machine, a unary call made from the event loop with
``grpc.aio`` took p99 36 ms from the call to the server having decoded the request; the
same call made with a synchronous channel on a dedicated thread that the loop wakes,
18 ms; made inline, 7.5 ms (p50 0.4 ms for all three). ``grpc.aio`` hands the call's
completion-queue work between the loop and gRPC's own poller thread; each of those
wake-ups waits for a core when the cores are busy. A synchronous call drives its
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
its own channel: never-resend depends on it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

import grpc

log = logging.getLogger(__name__)

#: The unary methods made on this thread: the report path's (relay.METHODS).
THREADED = frozenset({"/Recover/ReportProcessFault", "/Recover/ReportStopComplete",
                      "/Recover/ReportRecoverStrategy", "/Recover/ReportRecoverStatus"})


class RpcThread:
    """One thread, one synchronous channel, one call at a time."""

    _STOP = object()

    def __init__(self, channel: grpc.Channel, response_deserializer: Any) -> None:
        self.channel = channel
        self._deserialize = response_deserializer
        self._callables: dict[str, Any] = {}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.state = grpc.ChannelConnectivity.IDLE
        channel.subscribe(self._on_state, try_to_connect=True)  # connect now: the first report must not wait
        self._thread = threading.Thread(target=self._serve, name="tft-rpc", daemon=True)
        self._thread.start()

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        self.state = state

    @property
    def ready(self) -> bool:
        return self.state is grpc.ChannelConnectivity.READY

    async def call(self, method: str, payload: bytes, timeout: float) -> Any:
        """The deserialized response, or the ``grpc.RpcError`` the call ended with."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.put((method, payload, timeout, future, loop))
        return await future

    def _callable(self, method: str) -> Any:
        if method not in self._callables:
            self._callables[method] = self.channel.unary_unary(
                method, request_serializer=None, response_deserializer=self._deserialize)
        return self._callables[method]

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            method, payload, timeout, future, loop = item
            if future.cancelled():  # its caller stopped waiting (racy, harmless: the call is just made)
                continue
            try:
                outcome: tuple[Any, BaseException | None] = (self._callable(method)(payload, timeout=timeout), None)
            except Exception as error:  # noqa: BLE001 - grpc.RpcError, or anything else: the caller's to classify
                outcome = (None, error)
            try:
                loop.call_soon_threadsafe(_resolve, future, outcome)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return

    def close(self, timeout: float = 2.0) -> None:
        """End the thread; closing the channel cancels a call in flight. Any thread."""
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
