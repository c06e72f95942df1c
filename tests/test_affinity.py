"""The controller's callback thread and the wire's thread on one CPU
(``bridge/job/sched/affinity.py``).

The first callback on a thread pins that thread to the CPU it runs on; after the batch
it woke the wire's thread for, the wire's thread pins itself there too, so every
later wake-up is queued where the controller's thread is about to go back to waiting.
Where pinning is refused the bridge says so once, off the controller's thread, puts back
what it pinned and delivers exactly as before; closing the wire puts every thread
back on the CPUs it had."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from bridge.job.sched import affinity
from bridge.job.host.controller import make_callback
from bridge.sim.clusterd import SimJob
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .simjobs import annotation, start_job
from .test_controller_handoff import Collected, Handoff

CPUS = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not affinity.ControllerPin().enabled,
                                 reason="needs sched_getcpu, sched_setaffinity and two CPUs to choose between")]


class CallbackThread:
    """A long-lived thread that calls what it is given, as the controller's state-machine
    thread calls its callbacks; it reports its own CPUs after each call."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="test-controller")
        self._thread.start()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            function, done = call
            try:
                done.set_result(function())
            except BaseException as error:  # noqa: BLE001 - handed to the test
                done.set_exception(error)

    async def call(self, function: Callable[[], Any]) -> Any:
        done: Future[Any] = Future()
        self._calls.put((function, done))
        return await asyncio.wrap_future(done)

    async def callback(self, callback: Callable[..., int], *args: Any) -> tuple[int, frozenset[int]]:
        """The callback's return value, and the CPUs its thread may run on afterwards."""
        return await self.call(lambda: (callback(*args), frozenset(os.sched_getaffinity(0))))

    @property
    def cpus(self) -> frozenset[int]:
        assert self._thread.native_id is not None
        return frozenset(os.sched_getaffinity(self._thread.native_id))

    def close(self) -> None:
        self._calls.put(None)
        self._thread.join(5)


def handoff_cpus(handoff: Handoff) -> frozenset[int]:
    thread = handoff._thread
    assert thread is not None and thread.native_id is not None
    return frozenset(os.sched_getaffinity(thread.native_id))


@pytest.fixture
async def controller() -> Any:
    thread = CallbackThread()
    yield thread
    thread.close()


async def test_the_first_callback_pins_its_thread_and_the_handoff_thread_follows_it_there(
        controller: CallbackThread) -> None:
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, pin_cpu=True)
    pin = handoff.pin
    assert pin is not None and pin.enabled
    callback = make_callback("report_fault_ranks", handoff.put, lambda: None, pin)
    try:
        assert controller.cpus == CPUS and handoff_cpus(handoff) == CPUS  # nothing before a callback
        result, cpus = await controller.callback(callback, {1: 0}, {})
        assert result == 0 and len(cpus) == 1 and cpus == {pin.cpu}
        await collected.wait_for(1)
        await eventually(lambda: pin.handoff_cpu == pin.cpu, what="the wire's thread pinned")
        assert handoff_cpus(handoff) == cpus  # to the callback's CPU
        for count in range(2, 6):  # later callbacks keep both where they are
            assert await controller.callback(callback, {count: 0}, {}) == (0, cpus)
        await collected.wait_for(5)
        assert handoff_cpus(handoff) == cpus
    finally:
        await asyncio.to_thread(handoff.close)
    assert controller.cpus == CPUS  # closing puts both back
    assert pin.cpu == pin.handoff_cpu == -1
    assert await controller.callback(callback, {6: 0}, {}) == (0, CPUS)  # and pins no more
    assert [taken.report.faults for taken in collected.reports] == [{n: 0} for n in range(1, 6)]


async def test_off_nothing_is_pinned(controller: CallbackThread) -> None:
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, pin_cpu=False)
    assert handoff.pin is not None and not handoff.pin.enabled
    callback = make_callback("report_fault_ranks", handoff.put, lambda: None, handoff.pin)
    try:
        for count in range(1, 4):
            assert await controller.callback(callback, {count: 0}, {}) == (0, CPUS)
            await collected.wait_for(count)
        assert handoff_cpus(handoff) == CPUS and handoff.pin.cpu == -1
    finally:
        await asyncio.to_thread(handoff.close)


def refusing(calls: list[int], error: int) -> affinity.SetAffinity:
    def setaffinity(thread: int, size: int, mask: object) -> int:
        calls.append(thread)
        ctypes.set_errno(error)
        return -1
    return setaffinity


async def test_a_refused_pin_is_said_once_off_the_controllers_thread_and_loses_nothing(
        controller: CallbackThread, caplog: pytest.LogCaptureFixture) -> None:
    """As under a SystemCallFilter= without sched_setaffinity: the call fails with EPERM."""
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, pin_cpu=True)
    pin = handoff.pin
    assert pin is not None
    calls: list[int] = []
    pin.pin_here = refusing(calls, errno.EPERM)
    callback = make_callback("report_fault_ranks", handoff.put, lambda: None, pin)
    with caplog.at_level(logging.WARNING, logger="bridge.job.sched.affinity"):
        try:
            for count in range(1, 4):
                assert await controller.callback(callback, {count: 0}, {}) == (0, CPUS)
                await collected.wait_for(count)
            await eventually(lambda: not pin.enabled and caplog.records, what="the refusal said")
            assert handoff_cpus(handoff) == CPUS
        finally:
            await asyncio.to_thread(handoff.close)
    assert len(calls) == 1  # tried once, then never again
    warnings = [record for record in caplog.records if record.name == "bridge.job.sched.affinity"]
    assert len(warnings) == 1 and "Operation not permitted" in warnings[0].getMessage()
    assert "SystemCallFilter" in warnings[0].getMessage()
    assert warnings[0].threadName == "tft-wire"  # never logged inside a callback: logging may block
    assert [taken.report.faults for taken in collected.reports] == [{1: 0}, {2: 0}, {3: 0}]


async def test_a_handoff_that_cannot_follow_puts_the_controllers_thread_back(
        controller: CallbackThread, caplog: pytest.LogCaptureFixture) -> None:
    """A controller thread pinned alone would only lose the freedom to move."""
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, pin_cpu=True)
    pin = handoff.pin
    assert pin is not None and pin.pin_moving is not None
    real, calls = pin.pin_moving, []
    refuse = refusing(calls, errno.EINVAL)

    def refuse_own_pin(thread: int, size: int, mask: object) -> int:  # the restore still works
        return refuse(thread, size, mask) if thread == 0 else real(thread, size, mask)

    pin.pin_moving = refuse_own_pin
    callback = make_callback("report_fault_ranks", handoff.put, lambda: None, pin)
    with caplog.at_level(logging.WARNING, logger="bridge.job.sched.affinity"):
        try:
            result, cpus = await controller.callback(callback, {1: 0}, {})
            assert result == 0 and len(cpus) == 1  # pinned by its callback ...
            await collected.wait_for(1)
            await eventually(lambda: controller.cpus == CPUS, what="the controller's thread put back")
            assert await controller.callback(callback, {2: 0}, {}) == (0, CPUS)  # ... and never again
            await collected.wait_for(2)
        finally:
            await asyncio.to_thread(handoff.close)
    assert calls == [0]
    assert len([record for record in caplog.records if record.name == "bridge.job.sched.affinity"]) == 1


def test_a_cpu_outside_the_bridges_set_is_never_pinned_to() -> None:
    """As when the cpuset shrank under a running bridge: the caller is left as it is."""
    pin = affinity.ControllerPin()
    assert pin.enabled and pin.getcpu is not None
    put: list[object] = []
    callback = make_callback("report_fault_ranks", put.append, lambda: None, pin)
    seen: list[frozenset[int]] = []

    def call() -> None:
        assert pin.getcpu is not None
        del pin.masks[pin.getcpu()]  # wherever this thread runs now is outside the set
        callback({1: 0}, {})
        seen.append(frozenset(os.sched_getaffinity(0)))

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(5)
    assert put and seen == [CPUS] and not pin.enabled and pin.cpu == -1


async def test_a_running_bridge_pins_the_controllers_thread_and_the_handoff_to_one_cpu_through_a_recovery(
        jobs: list[SimulatedJob]) -> None:
    job = await start_job(jobs, SimJob("job-cpu", world_size=16, devices_per_pod=4))
    link = job.bridge.link  # type: ignore[union-attr]
    pin = link.wire.pin
    assert link.controller_pin is pin
    metric: Callable[[], float | None] = lambda: job.metrics.registry.get_sample_value("tft_bridge_controller_cpu")
    assert metric() == -1  # no callback yet
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    await eventually(lambda: pin.handoff_cpu >= 0, what="the wire's thread pinned")
    cpu = pin.handoff_cpu
    assert cpu == pin.cpu and handoff_cpus(link.wire) == {cpu}
    assert len(pin._pinned) == 2  # the stub controller's state-machine thread and the wire
    assert all(os.sched_getaffinity(thread) == {cpu} for thread in pin._pinned)
    assert metric() == cpu
