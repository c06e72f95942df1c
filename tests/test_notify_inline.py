"""The controller's notify calls are made on the event loop itself (the notify
thread's wake-up was the signal path's avoidable cost on busy cores), and a notify that
ever holds the loop longer than ``INLINE_NOTIFY_LIMIT`` sends every later one back to
the dedicated thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bridge.job.session.signals import INLINE_NOTIFY_LIMIT

from .conftest import eventually
from .test_signals import Rig, dispatching, signal, stop_train


class ThreadRecordingRig(Rig):
    """A Rig whose fake controller records the thread of each notify and can be slow."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []
        self.slow = 0.0
        original = self.module._call

        def call(name: str, *args: Any) -> int:
            self.threads.append(threading.current_thread().name)
            if self.slow:
                # the delay is the behaviour under test: a notify slower than the limit
                time.sleep(self.slow)
                self.slow = 0.0
            return original(name, *args)

        self.module._call = call  # type: ignore[method-assign]


@pytest.fixture
async def rig() -> AsyncIterator[ThreadRecordingRig]:
    async with dispatching(ThreadRecordingRig()) as running:
        yield running


async def test_a_notify_runs_on_the_event_loops_thread(rig: ThreadRecordingRig) -> None:
    rig.send(stop_train())
    await eventually(lambda: rig.module.calls, what="the stop_train notify")
    assert rig.threads == [threading.current_thread().name]
    assert rig.dispatcher.notify_inline


async def test_a_slow_notify_sends_the_later_ones_to_the_notify_thread(rig: ThreadRecordingRig,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    rig.slow = INLINE_NOTIFY_LIMIT * 2
    idle = rig.flow.snapshot()
    with caplog.at_level(logging.WARNING, logger="bridge.job.session.signals"):
        rig.send(signal("stopTrain", ["pause_train"], timeout=900))
        await eventually(lambda: rig.module.calls, what="the slow pause notify")
        await eventually(lambda: not rig.dispatcher.notify_inline, what="inline notify switched off")
        rig.flow.restore(idle)  # as if that pause had run its course: the next stopTrain is expected
        rig.send(stop_train())
        await eventually(lambda: len(rig.module.calls) == 2, what="the stop_train notify")
    assert rig.module.names() == ["stop_train", "stop_train"]  # pause, then stop
    assert rig.threads[0] == threading.current_thread().name
    assert rig.threads[1].startswith("tft-notify")
    assert rig.notifies("pause_train", "ok") == rig.notifies("stop_train", "ok") == 1  # both forwarded, counted
    assert "later notify calls run on a thread of their own" in caplog.text
