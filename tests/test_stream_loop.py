"""The resubscribing stream loop against a real gRPC server whose stream the test drives:
each end is told to the owner as it happened, the pause follows it, stop() cuts any step."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from bridge.core.config import ClusterDConfig
from bridge.job.metrics import BridgeMetrics
from bridge.job.session.clusterd import ClusterDClient
from bridge.job.session.stream_loop import Outcome, StreamEnd, StreamLoop, Subscription

from .conftest import eventually

pytestmark = pytest.mark.timeout(30)

METHOD = "/test.Streams/Messages"
UNSERVED = "/test.Streams/Missing"


class Server:
    """One server-streaming method. Each subscription takes the next script from
    ``scripts``: a list of bytes (sent, then the stream ends with OK), optionally ending
    with a grpc.StatusCode (the stream fails with it) or None (the stream stays open)."""

    def __init__(self) -> None:
        self.scripts: asyncio.Queue[list[Any]] = asyncio.Queue()
        self.opened = 0
        self.server = grpc.aio.server()

        async def messages(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            self.opened += 1
            for step in await self.scripts.get():
                if step is None:
                    await asyncio.Event().wait()  # open until the client goes
                if isinstance(step, grpc.StatusCode):
                    await context.abort(step, "scripted failure")
                yield step

        handler = grpc.method_handlers_generic_handler("test.Streams", {
            "Messages": grpc.unary_stream_rpc_method_handler(messages)})
        self.server.add_generic_rpc_handlers((handler,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")


class Owner(Subscription[bytes]):
    def __init__(self, prepare_waits: asyncio.Event | None = None, pause: float | None = None) -> None:
        self.messages: list[bytes] = []
        self.ends: list[StreamEnd] = []
        self.prepared = 0
        self.prepare_waits = prepare_waits
        self.pause = pause

    async def prepare(self) -> Outcome | None:
        self.prepared += 1
        if self.prepare_waits is not None:
            await self.prepare_waits.wait()
        return None

    async def handle(self, message: bytes) -> None:
        self.messages.append(message)

    def ended(self, end: StreamEnd) -> float | None:
        self.ends.append(end)
        return self.pause


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    srv = Server()
    await srv.server.start()
    yield srv
    await srv.server.stop(None)


@pytest.fixture
async def client(server: Server) -> AsyncIterator[ClusterDClient]:
    config = ClusterDConfig(address=f"127.0.0.1:{server.port}", reconnect_initial=0.01, reconnect_max=0.05,
                            recheck_disabled=0.05)
    c = ClusterDClient(config, BridgeMetrics())
    await c.open()
    yield c
    await c.close()


def loop_of(client: ClusterDClient, method: str = METHOD, silence: float | None = None) -> StreamLoop[bytes]:
    return StreamLoop("test", client, method, b"", lambda raw: raw, silence=silence)


async def test_clean_ends_and_failures_are_told_and_subscribed_again(server: Server, client: ClusterDClient) -> None:
    await server.scripts.put([b"a", b"b"])
    await server.scripts.put([b"c", grpc.StatusCode.UNAVAILABLE])
    await server.scripts.put([None])
    loop, owner = loop_of(client), Owner()
    task = asyncio.create_task(loop.run(owner))
    await eventually(lambda: server.opened == 3 and loop.subscribed.is_set(), what="the third subscription")
    assert owner.messages == [b"a", b"b", b"c"]
    assert [(e.outcome, e.opened, e.messages, e.status) for e in owner.ends] == [
        (Outcome.ENDED, True, 2, ""), (Outcome.FAILED, True, 1, "UNAVAILABLE")]
    assert loop.subscriptions == 3 and owner.prepared == 3
    loop.stop()
    await asyncio.wait_for(task, 5)
    assert owner.ends[-1].outcome is Outcome.STOPPED and not loop.subscribed.is_set()


async def test_stop_cuts_a_pending_prepare(client: ClusterDClient) -> None:
    never = asyncio.Event()
    loop, owner = loop_of(client), Owner(prepare_waits=never)
    task = asyncio.create_task(loop.run(owner))
    await eventually(lambda: owner.prepared == 1, what="prepare running")
    loop.stop()
    await asyncio.wait_for(task, 5)
    assert [(e.outcome, e.opened) for e in owner.ends] == [(Outcome.STOPPED, False)]


async def test_stop_cuts_a_long_pause(server: Server, client: ClusterDClient) -> None:
    await server.scripts.put([])
    loop, owner = loop_of(client), Owner(pause=3600.0)
    task = asyncio.create_task(loop.run(owner))
    await eventually(lambda: owner.ends, what="the first end")
    loop.stop()
    await asyncio.wait_for(task, 5)
    assert [e.outcome for e in owner.ends] == [Outcome.ENDED]


async def test_an_unserved_method_is_rechecked(client: ClusterDClient) -> None:
    loop, owner = loop_of(client, UNSERVED), Owner()
    task = asyncio.create_task(loop.run(owner))
    await eventually(lambda: len(owner.ends) >= 2, what="two checks of the unserved method")
    assert {e.outcome for e in owner.ends} == {Outcome.UNIMPLEMENTED} and loop.unimplemented
    loop.stop()
    await asyncio.wait_for(task, 5)


async def test_a_silent_stream_counts_as_dead(server: Server, client: ClusterDClient) -> None:
    await server.scripts.put([b"a", None])
    await server.scripts.put([None])
    loop, owner = loop_of(client, silence=0.2), Owner()
    task = asyncio.create_task(loop.run(owner))
    await eventually(lambda: owner.ends, what="the silent stream given up")
    assert (owner.ends[0].outcome, owner.ends[0].messages) == (Outcome.SILENT, 1)
    await eventually(lambda: server.opened == 2, what="subscribed again")
    loop.stop()
    await asyncio.wait_for(task, 5)


async def test_restart_ends_the_open_stream_and_subscribes_again(server: Server, client: ClusterDClient) -> None:
    await server.scripts.put([None])
    await server.scripts.put([None])
    loop, owner = loop_of(client), Owner()
    task = asyncio.create_task(loop.run(owner))
    await eventually(lambda: loop.subscribed.is_set(), what="subscribed")
    loop.restart()
    await eventually(lambda: server.opened == 2 and loop.subscribed.is_set(), what="subscribed again")
    assert [e.outcome for e in owner.ends] == [Outcome.RESTARTED]
    loop.stop()
    await asyncio.wait_for(task, 5)


async def test_a_step_cancelled_under_it_is_a_failure_not_a_stop(server: Server, client: ClusterDClient) -> None:
    """A prepare whose awaited call is cancelled from elsewhere (its channel closed under
    it) ends the round as a failure; the loop goes on."""
    pending: list[asyncio.Future[None]] = []

    class Cancelled(Owner):
        async def prepare(self) -> Outcome | None:
            self.prepared += 1
            if self.prepared == 1:
                pending.append(asyncio.get_running_loop().create_future())
                await pending[0]
            return None

    await server.scripts.put([None])
    loop, owner = loop_of(client), Cancelled()
    task = asyncio.create_task(loop.run(owner))
    await eventually(lambda: pending, what="prepare waiting")
    pending[0].cancel()
    await eventually(lambda: loop.subscribed.is_set(), what="subscribed after the failed round")
    assert [(e.outcome, e.status) for e in owner.ends] == [(Outcome.FAILED, "CANCELLED")]
    loop.stop()
    await asyncio.wait_for(task, 5)
