"""Issue 16: the callbacks pin the hand-off thread to their own CPU (``bridge/affinity.py``).

Before it wakes the hand-off thread, a callback pins that thread to the CPU its own
thread runs on whenever that CPU changed, so that the wake-up is queued where the
controller's thread is about to go back to waiting rather than behind a busy process on
another CPU. Where pinning is refused the bridge says so once and delivers exactly as
before."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import threading
from typing import Any

import pytest

from bridge import affinity
from bridge.controller import make_callback
from bridge.reports import THREAD, Handoff
from bridge.sim.clusterd import SimJob
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .simjobs import annotation, start_job
from .test_controller_handoff import Collected

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(len(CPUS) < 2 or affinity.cpu_reader() is None,
                                 reason="needs sched_getcpu and at least two CPUs to move between")]


def call_on_cpu(cpu: int, function: Any, *args: Any) -> Any:
    """Call on a thread of its own pinned to ``cpu``, as a controller thread running there."""
    result: list[Any] = []

    def run() -> None:
        os.sched_setaffinity(0, {cpu})
        result.append(function(*args))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(5)
    return result[0]


def _pinned_to(handoff: Handoff) -> set[int]:
    thread = handoff._thread
    assert thread is not None and thread.native_id is not None
    return os.sched_getaffinity(thread.native_id)


async def test_each_callback_pins_the_handoff_thread_to_its_cpu_before_waking_it() -> None:
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, THREAD)
    pin = handoff.pin
    assert pin is not None and pin.enabled
    assert _pinned_to(handoff) == set(CPUS)  # not before a callback says where
    seen: list[set[int]] = []

    def sink(item: object) -> None:  # runs inside the callback, right after the pin
        seen.append(_pinned_to(handoff))
        handoff.put(item)  # type: ignore[arg-type]

    callback = make_callback("report_fault_ranks", sink, lambda: None, pin)
    try:
        for count, cpu in enumerate((CPUS[1], CPUS[1], CPUS[0], CPUS[1]), start=1):
            assert await asyncio.to_thread(call_on_cpu, cpu, callback, {count: 0}) == 0
            assert seen[-1] == {cpu} and pin.pinned == [cpu]
            await collected.wait_for(count)
        pin.enable(False)
        assert _pinned_to(handoff) == set(CPUS) and pin.pinned == [-1]
        await asyncio.to_thread(call_on_cpu, CPUS[0], callback, {5: 0})
        assert seen[-1] == set(CPUS)  # off: the callback leaves it on all its CPUs
        await collected.wait_for(5)
    finally:
        handoff.close()
    assert [report.args[0] for report in collected.reports] == [{n: 0} for n in range(1, 6)]


async def test_a_pin_filtered_at_start_is_logged_once_and_every_report_still_arrives_in_order(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """As under a SystemCallFilter= without sched_setaffinity: the call fails with EPERM."""
    calls: list[int] = []

    def filtered() -> Any:
        def setaffinity(thread: int, size: int, mask: object) -> int:
            calls.append(thread)
            ctypes.set_errno(errno.EPERM)
            return -1
        return setaffinity

    monkeypatch.setattr(affinity, "_setaffinity", filtered)
    collected = Collected()
    with caplog.at_level(logging.WARNING, logger="bridge.affinity"):
        handoff = Handoff(asyncio.get_running_loop(), collected.handle, THREAD)
    assert handoff.pin is not None and not handoff.pin.enabled
    callback = make_callback("report_fault_ranks", handoff.put, lambda: None, handoff.pin)
    try:
        for count, cpu in enumerate((CPUS[1], CPUS[0], CPUS[1]), start=1):
            assert await asyncio.to_thread(call_on_cpu, cpu, callback, {count: 0}) == 0
            await collected.wait_for(count)
        assert _pinned_to(handoff) == set(CPUS)
    finally:
        handoff.close()
    assert [report.args[0] for report in collected.reports] == [{1: 0}, {2: 0}, {3: 0}]
    assert len(calls) == 1  # the probe at start, then never again
    warnings = [r.getMessage() for r in caplog.records if r.name == "bridge.affinity"]
    assert len(warnings) == 1 and "Operation not permitted" in warnings[0] and "SystemCallFilter" in warnings[0]


async def test_a_pin_refused_later_turns_pinning_off_once_and_loses_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    """As when the node's cpuset shrinks under a running bridge: the kernel says EINVAL."""
    collected = Collected()
    handoff = Handoff(asyncio.get_running_loop(), collected.handle, THREAD)
    pin = handoff.pin
    assert pin is not None and pin.call is not None
    real = pin.call
    refusals: list[object] = []

    def refuse(mask: object) -> int:
        refusals.append(mask)
        return -1

    pin.call = refuse
    callback = make_callback("report_fault_ranks", handoff.put, lambda: None, pin)
    pin.call = real  # the callback captured the refusing one
    with caplog.at_level(logging.WARNING, logger="bridge.affinity"):
        try:
            for count, cpu in enumerate((CPUS[1], CPUS[0], CPUS[1]), start=1):
                assert await asyncio.to_thread(call_on_cpu, cpu, callback, {count: 0}) == 0
                await collected.wait_for(count)
                await eventually(lambda: not pin.enabled, what="pinning turned off after the refusal")
        finally:
            handoff.close()
    assert len(refusals) == 1
    assert [report.args[0] for report in collected.reports] == [{1: 0}, {2: 0}, {3: 0}]
    assert len([r for r in caplog.records if r.name == "bridge.affinity"]) == 1


def test_a_cpu_outside_the_threads_own_set_is_never_pinned_to() -> None:
    pin = affinity.HandoffPin(threading.get_native_id())
    assert pin.enabled
    del pin.masks[CPUS[1]]  # as a cpuset narrower than where the caller runs
    put: list[object] = []
    callback = make_callback("report_fault_ranks", put.append, lambda: None, pin)
    assert call_on_cpu(CPUS[1], callback, {1: 0}) == 0
    assert pin.pinned == [-1] and put and os.sched_getaffinity(0) == set(CPUS)


async def test_a_running_bridge_has_its_handoff_thread_on_the_controllers_cpu_through_a_recovery(
        jobs: list[SimulatedJob]) -> None:
    job = await start_job(jobs, SimJob("job-cpu", world_size=16, devices_per_pod=4))
    link = job.bridge.link  # type: ignore[union-attr]
    assert link.handoff_pin is link.handoff.pin and link.handoff.pin is not None
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    pinned = link.handoff.pin.pinned[0]
    assert pinned in CPUS
    assert _pinned_to(link.handoff) == {pinned}
