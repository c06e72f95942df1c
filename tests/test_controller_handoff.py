"""The controller callbacks and their hand-off to the report wire (bridge/job/reports/relay.py).

The callbacks run on the controller's state-machine thread, which is blocked until they
return: they must never raise, never block, and do as little as possible there.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from concurrent.futures import Future
from types import FrameType
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from bridge.job.sched.affinity import ControllerPin
from bridge.core.backoff import Backoff
from bridge.job.host.controller import make_callback
from bridge.job.metrics import BridgeMetrics
from bridge.job.reports.kinds import report_of
from bridge.sim.scenario import free_port
from bridge.job.reports.relay import Taken

from .wire_rig import WireRig


class Collected:
    """The event-loop side: every batch the wire handed to the loop's bookkeeping."""

    def __init__(self) -> None:
        self.batches: list[list[Taken]] = []
        self.changed = asyncio.Event()

    def handle(self, reports: list[Taken]) -> None:
        self.batches.append(reports)
        self.changed.set()

    @property
    def reports(self) -> list[Taken]:
        return [report for batch in self.batches for report in batch]

    async def wait_for(self, count: int, timeout: float = 5.0) -> list[Taken]:
        async with asyncio.timeout(timeout):
            while len(self.reports) < count:
                self.changed.clear()
                await self.changed.wait()
        return self.reports


class Handoff:
    """The wire as the controller's callbacks see it, with no stream live (its fault
    reports wait) and nobody listening at its address: what the callbacks put reaches
    the loop's bookkeeping (``Collected``), in callback order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handle: Any, *, pin_cpu: bool = False) -> None:
        listener = SimpleNamespace(taken=handle, dropped=lambda *args: None, outcome_unknown=lambda kind: None,
                                   faults_delivered=lambda *args: None)
        self.rig = WireRig("job-handoff", grpc.insecure_channel(f"127.0.0.1:{free_port()}"), loop, listener,  # type: ignore[arg-type]
                           BridgeMetrics(), rpc_timeout=1.0, backoff=Backoff(0.01, 0.02), pin=ControllerPin(pin_cpu))
        self.wire = self.rig.wire
        self.put = self.rig.put
        self.pin = self.wire.pin
        self.wire.start()

    def close(self, timeout: float = 5.0) -> None:
        self.wire.stop(timeout)

    @property
    def alive(self) -> bool:
        return self.wire.alive

    @property
    def _thread(self) -> threading.Thread:
        return self.wire._thread


def call_from_thread(function: Any, *args: Any) -> Any:
    """Call on a thread of its own, as the controller's state machine would."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(function(*args)))
    thread.start()
    thread.join(5)
    return result[0]


async def test_callbacks_reach_the_loop_in_call_order_with_their_arguments() -> None:
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle)
    try:
        faults = make_callback("report_fault_ranks", handoff.put, lambda: None)
        stopped = make_callback("report_stop_complete", handoff.put, lambda: None)
        before = time.monotonic()

        def controller_thread() -> list[int]:
            return [faults({3: 1}, {3: "E"}), stopped(0, "ok", {}), faults({5: 2})]

        assert call_from_thread(controller_thread) == [0, 0, 0]
        reports = await collected.wait_for(3)
    finally:
        handoff.close()
    assert [(t.report.callback, t.report.faults, t.report.code, t.report.message, t.problem) for t in reports] == [
        ("report_fault_ranks", {3: 1}, None, "", ""),
        ("report_stop_complete", {}, 0, "ok", ""),
        ("report_fault_ranks", {5: 2}, None, "", ""),
    ]
    assert all(t.report.waiter is None for t in reports)
    assert before <= reports[0].report.at <= reports[1].report.at <= reports[2].report.at <= time.monotonic()


async def test_a_callback_whose_arguments_do_not_fit_reaches_the_loop_as_malformed() -> None:
    """Named once at intake: a call that does not fit its callback's signature becomes a
    report that says so (answered 499 and counted on the loop), never an exception on
    the controller's thread."""
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle)
    try:
        stopped = make_callback("report_stop_complete", handoff.put, lambda: None)
        strategies = make_callback("report_strategies", handoff.put, lambda: None)
        assert call_from_thread(lambda: [stopped(0), strategies({1: 0}, ["exit"], "extra")]) == [0, 0]
        reports = await collected.wait_for(2)
    finally:
        handoff.close()
    assert "report_stop_complete takes (code, msg[, fault_ranks]), got 1 argument(s)" in reports[0].problem
    assert not reports[1].problem and reports[1].strategies == ["exit"]


async def test_a_report_put_with_a_waiter_keeps_it() -> None:
    """The seed API puts whole ControllerReports, with the future its caller waits on."""
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle)
    waiter: Future[int] = Future()
    try:
        handoff.put(report_of("report_result", (0, "ok", {}, "retry"), 1.5, waiter))  # the seed API's
        (taken,) = await collected.wait_for(1)
    finally:
        handoff.close()
    report = taken.report
    assert (report.callback, report.code, report.message, report.strategy, report.at) == \
        ("report_result", 0, "ok", "retry", 1.5)
    assert report.waiter is waiter


def test_a_callback_whose_sink_fails_returns_0_and_counts_it() -> None:
    errors: list[int] = []

    def broken_sink(fields: Any) -> None:
        raise KeyboardInterrupt  # even a BaseException must not reach the controller

    callback = make_callback("report_strategies", broken_sink, lambda: errors.append(1))
    assert call_from_thread(callback, ["retry", "recover"]) == 0
    assert errors == [1]


def test_a_failing_error_counter_does_not_escape_either() -> None:
    def broken(*_: Any) -> None:
        raise RuntimeError("metrics are gone")

    assert call_from_thread(make_callback("report_result", broken, broken), 0, "ok", {}, "retry") == 0


@pytest.mark.parametrize("pinned", [False, True])
async def test_the_callback_runs_no_python_frame_but_its_own_and_the_put(pinned: bool) -> None:
    """On the controller's (cold) thread the callback's only Python frame is itself (the
    clock, the tuple and the wire's put are C calls). A further wrapper, or a dataclass
    built per call, would show up here (and cost 3-4x the time). Pinned (the daemon's
    default, bridge/job/sched/affinity.py), the thread's first callback pins it; the next runs no
    more frames than unpinned."""
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, pin_cpu=pinned)
    callback = make_callback("report_fault_ranks", handoff.put, lambda: None, handoff.pin if pinned else None)
    python_frames: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            python_frames.append(frame.f_code.co_name)

    def controller_thread() -> int:
        if pinned:
            assert callback({0: 0}) == 0  # the first: pins the thread where pinning is possible
        sys.setprofile(profile)
        try:
            return callback({1: 0})
        finally:
            sys.setprofile(None)

    try:
        assert call_from_thread(controller_thread) == 0
        await collected.wait_for(2 if pinned else 1)
    finally:
        handoff.close()
    assert python_frames == [callback.__code__.co_name]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux-only")
async def test_the_wire_thread_never_preempts_the_controller_on_wakeup() -> None:
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle)
    try:
        handoff.put(report_of("report_fault_ranks", ({1: 0},), 0.0))
        await collected.wait_for(1)  # the thread has set its policy before its first get
        thread = handoff._thread
        assert thread.name == "tft-wire" and thread.native_id is not None
        assert handoff.wire.batch_policy
        assert os.sched_getscheduler(thread.native_id) == os.SCHED_BATCH
        assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_BATCH  # only that thread
    finally:
        handoff.close()


async def test_close_ends_the_thread_after_delivering_what_was_queued() -> None:
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle)
    for rank in range(50):
        handoff.put(report_of("report_fault_ranks", ({rank: 0},), 0.0))
    await asyncio.to_thread(handoff.close)
    assert not handoff.alive
    reports = await collected.wait_for(50)
    assert [t.report.faults for t in reports] == [{rank: 0} for rank in range(50)]


def test_an_external_controller_is_never_started_here() -> None:
    """The seed API hosts a controller its caller runs: registering the callbacks again and
    re-initialising it would break the caller's, so start() refuses."""
    from bridge.core.config import ControllerConfig
    from bridge.job.host.controller import ControllerHost, StartupError

    calls: list[str] = []

    class Module:
        def __getattr__(self, name: str) -> Any:
            return lambda *args: calls.append(name) or 0

    host = ControllerHost(Module(), ControllerConfig(), external=True)  # type: ignore[arg-type]
    assert host.started and not host.owned
    with pytest.raises(StartupError, match="run by the caller"):
        host.start(lambda fields: None, lambda: None)
    assert calls == []
    assert host.destroy(1.0) is True  # a destroy request is accepted and does nothing to the caller's
    assert calls == []
