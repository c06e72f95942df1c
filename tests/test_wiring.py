"""A job's parts are wired one way: no part holds the link that built them, the parts
form no cycle but through the cycle state, and a signal wakes the report wire once.

The parts are built as the daemon builds them (``bridge.job.assembly.Link``); their
attributes are walked (instance dictionaries, containers, bound methods, closures and
partials), never into the standard library's objects, gRPC's or prometheus_client's.
"""

from __future__ import annotations

import asyncio
import functools
import types
from collections import deque
from types import SimpleNamespace
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from bridge._proto import recover_pb2 as pb
from bridge.core.config import ControllerConfig, build_config
from bridge.job.assembly import Link
from bridge.job.host.controller import ControllerHost
from bridge.job.metrics import BridgeMetrics
from bridge.job.recorder import NullRecorder
from bridge.job.reports.controller_flow import ControllerFlow
from bridge.job.session.codes import Code

from .conftest import eventually
from .test_signals import FakeController

JOB = "job-wiring"
#: The parts of one job, as attributes of the link. The metrics and the recorder are
#: shared sinks every part writes to: reached, never walked.
PARTS = ("client", "inbox", "cycles", "reports", "wire", "dispatcher", "session", "controller", "flow")
SINKS = ("metrics", "recorder")
#: Where the walk goes: the bridge's own objects, and the containers and callables between them.
WALKED = (dict, list, tuple, set, frozenset, deque, types.MethodType, types.FunctionType, functools.partial)


def build(**controller: Any) -> Link:
    """A job's parts as the daemon builds them (``daemon.Bridge._start``), not started."""
    config = build_config({"job_id": JOB, "clusterd": {"address": "127.0.0.1:1"},
                           "controller": {"world_size": 8, "realtime_priority": 1, **controller}}, env={})
    metrics = BridgeMetrics()
    flow = ControllerFlow(wait_timeout=config.controller.wait_mindx_time, on_desync=metrics.count_desync)
    return Link(config, metrics, ControllerHost(FakeController(), config.controller), flow,  # type: ignore[arg-type]
                on_kill_master=lambda: None, on_state=lambda state: None, observer=lambda line: None,
                recorder=NullRecorder())


def children(obj: Any) -> Iterator[tuple[str, Any]]:
    """What ``obj`` holds, named: the edges of the walk."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
    elif isinstance(obj, (list, tuple, set, frozenset, deque)):
        for index, value in enumerate(obj):
            yield f"[{index}]", value
    elif isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
    elif isinstance(obj, types.FunctionType):
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                yield f"<closure {name}>", cell.cell_contents
            except ValueError:  # an empty cell
                pass
        for index, value in enumerate(obj.__defaults__ or ()):
            yield f"<default {index}>", value
    elif isinstance(obj, functools.partial):
        yield ".func", obj.func
        yield from ((f"<arg {index}>", value) for index, value in enumerate(obj.args))
        yield from ((f"<keyword {key}>", value) for key, value in obj.keywords.items())
    else:
        for name, value in getattr(obj, "__dict__", {}).items():
            yield f".{name}", value
        for name in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, name):
                yield f".{name}", getattr(obj, name)


def walked(obj: Any) -> bool:
    return isinstance(obj, WALKED) or type(obj).__module__.startswith("bridge.")


def reached(start: Any, stops: dict[int, str]) -> dict[str, str]:
    """Every object of ``stops`` (id -> name) that ``start`` holds, directly or through
    anything but another stop: name -> the path to it."""
    found: dict[str, str] = {}
    seen: set[int] = {id(start)}
    todo: list[tuple[str, Any]] = [("", start)]
    while todo:
        path, obj = todo.pop()
        for edge, child in children(obj):
            if id(child) in stops:
                found.setdefault(stops[id(child)], path + edge)
            elif id(child) not in seen and walked(child):
                seen.add(id(child))
                todo.append((path + edge, child))
    return found


@pytest.fixture
async def link() -> AsyncIterator[Link]:
    built = build()
    try:
        yield built
    finally:
        built.wire.stop(1.0)
        built.dispatcher.close()


async def test_no_part_holds_the_link_that_built_it(link: Link) -> None:
    """The link builds its parts and hands each only parts built before it: nothing it
    built refers back to it, by attribute, bound method, closure or partial."""
    stops = {id(link): "the link"}
    back = {part: path for part in PARTS + SINKS if (path := reached(getattr(link, part), stops).get("the link"))}
    assert back == {}, f"parts that hold the link: {back}"


async def test_building_the_parts_starts_no_thread(link: Link) -> None:
    """Built is not started: the report wire's thread starts in ``Link.start`` (after the
    channel is open), and a link that never started stops without one."""
    assert not link.wire.alive and link.wire._thread.ident is None  # never started


async def test_the_parts_form_no_cycle_and_talk_back_only_through_the_cycle_state(link: Link) -> None:
    """Which part holds which (walking stops at every part): a graph with no cycle, and
    every part that needs the loop's cycle state holds the one ``CycleState``."""
    parts = {id(getattr(link, part)): part for part in PARTS + SINKS}
    holds = {part: reached(getattr(link, part), parts) for part in PARTS}
    order: list[str] = []
    visiting: set[str] = set()

    def visit(part: str, trail: tuple[str, ...]) -> None:
        assert part not in visiting, f"a cycle between parts: {' -> '.join((*trail, part))} ({holds})"
        if part in order or part in SINKS:
            return
        visiting.add(part)
        for held in holds[part]:
            visit(held, (*trail, part))
        visiting.discard(part)
        order.append(part)

    for part in PARTS:
        visit(part, ())
    for part in ("reports", "wire", "dispatcher", "session"):
        assert "cycles" in holds[part], f"{part} does not hold the cycle state: {holds[part]}"
    assert order.index("cycles") < order.index("session")


class ScriptedStream:
    """ClusterD's signal stream as the test feeds it, one message at a time."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[Any] = asyncio.Queue()

    def send(self, signal: pb.ProcessManageSignal) -> None:
        self.messages.put_nowait((signal, signal.SerializeToString()))

    async def read(self) -> Any:
        return await self.messages.get()

    def cancel(self) -> None:
        self.messages.put_nowait(grpc.aio.EOF)


def signal(signal_type: str, actions: list[str], uuid: str = "", **fields: Any) -> pb.ProcessManageSignal:
    message = pb.ProcessManageSignal(jobId=JOB, uuid=uuid, signalType=signal_type, actions=actions, **fields)
    for rank in (2, 3):
        message.faultRanks.add(rankId=str(rank), faultType="1")
    return message


async def test_a_signal_wakes_the_report_wire_once() -> None:
    """One publication per change, and the wire woken once per signal: a stop signal
    starting a cycle, and one replacing the running cycle (which ends the old one and
    starts the new one), each wake the wire once; a signal of the running cycle and
    the notifies (the controller's answering cycle, read by the wire as it takes the
    next report) wake it not."""
    link = build(realtime_priority=0)
    stream = ScriptedStream()

    async def answered(method: str, payload: bytes, timeout: float | None = None) -> int:
        return Code.OK

    async def opened() -> None:  # the signal channel: the stream loop opens the test's stream on it
        link.client.channel = SimpleNamespace(  # type: ignore[assignment]
            unary_stream=lambda method, **how: lambda request, timeout=None: stream, close=closed)

    async def closed(grace: float | None = None) -> None:
        pass

    link.client.call = answered  # type: ignore[method-assign]  # Init and Register
    link.client.open = opened  # type: ignore[method-assign]
    module: FakeController = link.controller.module  # type: ignore[assignment]
    dispatched = lambda: link.dispatcher._queue.empty()  # noqa: E731 - taken and handled (no await inside)
    await link.start()
    try:
        await eventually(lambda: link.session.subscribe_sent, what="the Subscribe's head start over")
        stream.send(pb.ProcessManageSignal(jobId=JOB, signalType="keep-alive"))
        await eventually(lambda: link.session.live.is_set(), what="the stream live")
        wakes = [link.inbox.wakes]
        link.flow.on_callback("report_fault_ranks")
        stream.send(signal("stopTrain", ["stop_train"], uuid="uuid-1"))
        await eventually(lambda: module.names() == ["stop_train"], what="the first stop_train notified")
        wakes.append(link.inbox.wakes)
        stream.send(pb.ProcessManageSignal(jobId=JOB, signalType="keep-alive", uuid="uuid-1"))
        stream.send(signal("globalFault", ["on_global_rank"], uuid="uuid-1"))  # the running cycle's
        await eventually(lambda: link.metrics.sample("tft_bridge_signals_received_total",
                                                     {"signal_type": "globalFault"}) == 1 and dispatched(),
                         what="the running cycle's globalFault handled")
        wakes.append(link.inbox.wakes)
        stream.send(signal("stopTrain", ["stop_train"], uuid="uuid-2"))  # ClusterD replaced the cycle
        await eventually(lambda: link.session.current_uuid == "uuid-2" and dispatched(),
                         what="the new cycle tracked and its stop_train handled")
        wakes.append(link.inbox.wakes)
        publications = link.cycles.publications
    finally:
        await link.stop()
    assert [later - earlier for earlier, later in zip(wakes, wakes[1:])] == [1, 0, 1]
    assert publications <= 8  # subscribed, live, and per signal one for the stream and one for the notify
