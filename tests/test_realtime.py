"""The event loop and the report thread run under SCHED_FIFO while a bridge runs
(``bridge/job/sched/realtime.py``) and the wire's thread, which the controller's own thread wakes,
never does; nothing they start inherits it, the loop's thread gets its own policy back
when the bridge stops, and where the system refuses realtime the bridge says so, shows
it in a metric and still recovers the job exactly as before."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import pytest

from bridge.job.sched import realtime
from bridge.core.config import ConfigError, build_config
from bridge.sim.clusterd import SimJob
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .simjobs import annotation, start_job

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not hasattr(os, "SCHED_FIFO"), reason="SCHED_FIFO is Linux-only")]

THREADS = (realtime.LOOP, realtime.REPORT)


def _policy(native_id: int) -> int:
    return os.sched_getscheduler(native_id) & ~os.SCHED_RESET_ON_FORK


def _realtime_allowed() -> bool:
    """Whether this process may use SCHED_FIFO (root, CAP_SYS_NICE or RLIMIT_RTPRIO), tried
    on a throwaway thread so that nothing here changes."""
    allowed: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
        except OSError:
            allowed.append(False)
        else:
            allowed.append(True)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return allowed[0]


needs_realtime = pytest.mark.skipif(not _realtime_allowed(), reason="this process may not use SCHED_FIFO")


def _gauges(job: SimulatedJob) -> dict[str, float | None]:
    """Each thread's gauge, None where it is not exported (``sample`` would say 0.0)."""
    return {thread: job.metrics.registry.get_sample_value("tft_bridge_realtime_thread", {"thread": thread})
            for thread in THREADS}


async def _started(jobs: list[SimulatedJob], **overrides: Any) -> SimulatedJob:
    controller = {"realtime_priority": overrides.pop("realtime_priority")} if overrides else {}
    job = await start_job(jobs, SimJob("job-rt", world_size=16, devices_per_pod=4),
                          config_overrides={"controller": controller})
    link = job.bridge.link  # type: ignore[union-attr]
    await eventually(lambda: link.wire.batch_policy, what="the report wire started")
    return job


@needs_realtime
async def test_a_running_bridge_runs_its_loop_realtime_and_the_wire_realtime_only_while_a_report_is_out(
        jobs: list[SimulatedJob]) -> None:
    loop_thread = threading.get_native_id()
    before = os.sched_getscheduler(loop_thread), os.sched_getparam(loop_thread).sched_priority
    assert _policy(loop_thread) != os.SCHED_FIFO
    job = await _started(jobs)  # the shipped default: controller.realtime_priority = 1
    link = job.bridge.link  # type: ignore[union-attr]
    assert link.wire.realtime  # it may: the report thread's gauge says 1
    assert _policy(loop_thread) == os.SCHED_FIFO and os.sched_getparam(loop_thread).sched_priority == 1
    # Realtime while it waits, the wire would preempt the controller's thread at every put.
    assert _policy(link.wire._thread.native_id) == os.SCHED_BATCH  # type: ignore[arg-type]
    assert _gauges(job) == {thread: 1.0 for thread in THREADS}
    # Nothing these threads start is realtime: not a worker thread, not a hook's process.
    assert await asyncio.to_thread(lambda: _policy(0)) == os.SCHED_OTHER
    # The child waits for its stdin to close: one that exited may be reaped before it is looked at.
    child = await asyncio.create_subprocess_exec("sh", "-c", "read line", stdin=asyncio.subprocess.PIPE)
    try:
        assert _policy(child.pid) == os.SCHED_OTHER
    finally:
        assert child.stdin is not None
        child.stdin.close()
        await child.wait()
    # It recovers a job exactly as before; the wire, realtime only while its calls were
    # out, waits for the next callback under SCHED_BATCH again.
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    await eventually(lambda: _policy(link.wire._thread.native_id) == os.SCHED_BATCH,  # type: ignore[arg-type]
                     what="the wire back under SCHED_BATCH")
    # Stopped, the loop's thread (here the test runner's) has its own policy back.
    jobs.remove(job)
    await job.stop()
    assert (os.sched_getscheduler(loop_thread), os.sched_getparam(loop_thread).sched_priority) == before
    assert _gauges(job)["loop"] == 0.0


async def test_refused_realtime_is_logged_once_shown_and_the_job_still_recovers(
        jobs: list[SimulatedJob], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """As under RestrictRealtime=yes or without LimitRTPRIO: the call fails with EPERM."""
    real = os.sched_setscheduler

    def refuse_realtime(pid: int, policy: int, param: os.sched_param) -> None:
        if policy & ~os.SCHED_RESET_ON_FORK == os.SCHED_FIFO:
            raise PermissionError(1, "Operation not permitted")
        real(pid, policy, param)

    monkeypatch.setattr(os, "sched_setscheduler", refuse_realtime)
    monkeypatch.setattr(realtime, "_refused_logged", False)
    loop_thread = threading.get_native_id()
    before = os.sched_getscheduler(loop_thread)
    with caplog.at_level(logging.WARNING, logger="bridge.job.sched.realtime"):
        job = await _started(jobs)
        link = job.bridge.link  # type: ignore[union-attr]
        await eventually(lambda: link.wire.batch_policy, what="the wire's fallback policy")
        job.training.inject_fault({5: 1})
        await annotation(job, "recover-success")
    refusals = [r.getMessage() for r in caplog.records if r.name == "bridge.job.sched.realtime"]
    assert len(refusals) == 1, refusals  # two threads refused, one line
    assert "LimitRTPRIO=1" in refusals[0] and "controller.realtime_priority" in refusals[0]
    assert _gauges(job) == {thread: 0.0 for thread in THREADS}
    assert _policy(link.wire._thread.native_id) == os.SCHED_BATCH  # type: ignore[arg-type]
    assert os.sched_getscheduler(loop_thread) == before


async def test_priority_zero_leaves_every_thread_as_it_was(jobs: list[SimulatedJob],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    loop_thread = threading.get_native_id()
    before = os.sched_getscheduler(loop_thread)
    with caplog.at_level(logging.WARNING, logger="bridge.job.sched.realtime"):
        job = await _started(jobs, realtime_priority=0)
    link = job.bridge.link  # type: ignore[union-attr]
    await eventually(lambda: link.wire.batch_policy, what="the wire's policy")
    assert os.sched_getscheduler(loop_thread) == before
    assert not link.wire.realtime
    assert _gauges(job) == {thread: None for thread in THREADS}  # not exported: nothing to alert on
    assert not [r for r in caplog.records if r.name == "bridge.job.sched.realtime"]  # off is not a problem to report


@needs_realtime
async def test_two_bridges_on_one_loop_share_its_promotion_and_the_last_one_restores_it() -> None:
    def check() -> list[int]:
        first, second = realtime.LoopPriority(1), realtime.LoopPriority(1)
        seen = [_policy(0)]
        assert first.hold() and second.hold()
        seen.append(_policy(0))
        first.release()
        seen.append(_policy(0))  # the second bridge still runs
        second.release()
        second.release()  # idempotent
        seen.append(_policy(0))
        return seen

    result: list[list[int]] = []
    thread = threading.Thread(target=lambda: result.append(check()))  # never touch the runner's thread here
    thread.start()
    thread.join()
    assert result == [[os.SCHED_OTHER, os.SCHED_FIFO, os.SCHED_FIFO, os.SCHED_OTHER]]


@pytest.mark.parametrize("value", [-1, 100, "high", 1.5])
def test_a_priority_outside_0_to_99_is_a_config_error_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError) as error:
        build_config({"job_id": "j", "controller": {"realtime_priority": value}}, env={})
    assert "controller.realtime_priority" in str(error.value)
