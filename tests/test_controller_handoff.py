"""The controller callbacks and their hand-off to the event loop.

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
from typing import Any

import pytest

from bridge.controller import make_callback
from bridge.reports import THREAD, WAKE, ControllerReport, Handoff


class Collected:
    """The event-loop side: every batch the hand-off delivered."""

    def __init__(self) -> None:
        self.batches: list[list[ControllerReport]] = []
        self.changed = asyncio.Event()

    def handle(self, reports: list[ControllerReport]) -> None:
        self.batches.append(reports)
        self.changed.set()

    @property
    def reports(self) -> list[ControllerReport]:
        return [report for batch in self.batches for report in batch]

    async def wait_for(self, count: int, timeout: float = 5.0) -> list[ControllerReport]:
        async with asyncio.timeout(timeout):
            while len(self.reports) < count:
                self.changed.clear()
                await self.changed.wait()
        return self.reports


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
    assert [(r.callback, r.args) for r in reports] == [
        ("report_fault_ranks", ({3: 1}, {3: "E"})),
        ("report_stop_complete", (0, "ok", {})),
        ("report_fault_ranks", ({5: 2},)),
    ]
    assert all(isinstance(r, ControllerReport) and r.waiter is None for r in reports)
    assert before <= reports[0].at <= reports[1].at <= reports[2].at <= time.monotonic()


async def test_a_report_put_with_a_waiter_keeps_it() -> None:
    """The seed API puts whole ControllerReports, with the future its caller waits on."""
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle)
    waiter: Future[int] = Future()
    try:
        handoff.put(ControllerReport("report_result", (0, "ok", {}, "retry"), 1.5, waiter))
        (report,) = await collected.wait_for(1)
    finally:
        handoff.close()
    assert report == ControllerReport("report_result", (0, "ok", {}, "retry"), 1.5, waiter)
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


@pytest.mark.parametrize("mode, pinned", [(WAKE, False), (THREAD, False), (THREAD, True)])
async def test_the_callback_runs_no_python_frame_but_its_own_and_the_put(mode: str, pinned: bool) -> None:
    """On the controller's (cold) thread the callback's Python frames are itself and, in
    WAKE mode, the hand-off's put (a deque append and a flag; the clock, the append and
    the wake-up write are C calls). A further wrapper, or a dataclass built per call,
    would show up here (and cost 3-4x the time). Pinned (the daemon's THREAD mode,
    bridge/affinity.py), the thread's first callback pins it; the next runs no more
    frames than unpinned."""
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, mode)
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
    own = [callback.__code__.co_name] + (["_put_and_wake"] if mode == WAKE else [])
    assert python_frames == own


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux-only")
async def test_the_handoff_thread_never_preempts_the_controller_on_wakeup() -> None:
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, THREAD)
    try:
        handoff.put(("report_fault_ranks", ({1: 0},), 0.0, None))
        await collected.wait_for(1)  # the thread has set its policy before its first get
        thread = handoff._thread
        assert thread.name == "tft-handoff" and thread.native_id is not None
        assert handoff.batch_policy
        assert os.sched_getscheduler(thread.native_id) == os.SCHED_BATCH
        assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_BATCH  # only that thread
    finally:
        handoff.close()


async def test_close_ends_the_thread_after_delivering_what_was_queued() -> None:
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle)
    for rank in range(50):
        handoff.put(("report_fault_ranks", ({rank: 0},), 0.0, None))
    await asyncio.to_thread(handoff.close)
    assert not handoff.alive
    reports = await collected.wait_for(50)
    assert [r.args[0] for r in reports] == [{rank: 0} for rank in range(50)]


def test_an_external_controller_is_never_started_here() -> None:
    """The seed API hosts a controller its caller runs: registering the callbacks again and
    re-initialising it would break the caller's, so start() refuses."""
    from bridge.config import ControllerConfig
    from bridge.controller import ControllerHost, StartupError

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
