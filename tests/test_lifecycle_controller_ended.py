"""The controller ends on its own: the bridge stops with EXIT_CONTROLLER_ENDED.

Seen before the fix: after the controller went to EXIT (or FINAL) the bridge kept sending
WATCHDOG=1, STATUS said "controller: exiting", and later faults produced no RPC at all --
a zombie, because a controller that has ended cannot be restarted in place (the real one,
started again on the same address, rejects every heartbeat of ranks still running). Each
way the controller ends is driven here with the simulated ClusterD and the stub
controller; each must end in exit code 76 (the unit restarts the bridge), the
controller's last report delivered first (ClusterD's journal has it before the bridge's
stream ends), no watchdog ping after the decision, a log line saying why, and the
orphan marker removed (the job's ranks are gone or going, bridge/job/session/orphan.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from bridge.job.daemon import EXIT_CONTROLLER_ENDED, EXIT_RESCHEDULED
from bridge.sim.clusterd import SimJob
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .simjobs import RecordingNotifier, start_job

pytestmark = pytest.mark.timeout(90)
JOB = "job-ended"
ENDED = "the controller has ended on its own"


def pings_after_the_decision(notifier: RecordingNotifier) -> int:
    """Watchdog pings sent from the STATUS line announcing the decision on."""
    messages = notifier.messages
    decided = next(i for i, m in enumerate(messages) if "the controller ended" in str(m.get("status", "")))
    return sum(1 for m in messages[decided:] if "watchdog" in m)


async def started(jobs: list[SimulatedJob], spec: SimJob | None = None, **kwargs: Any) -> SimulatedJob:
    kwargs.setdefault("wait_time", 1.0)  # the controller's EXIT wait: 1 s
    return await start_job(jobs, spec or SimJob(JOB, world_size=8, devices_per_pod=4), **kwargs)


def marker(job: SimulatedJob) -> Path:
    return Path(job.config.controller.state_directory) / "controller.json"


async def delivered_before_the_stream_ended(job: SimulatedJob, rpc: str, code: int | None = None) -> None:
    """ClusterD's journal: ``rpc`` (with status ``code``) answered OK before the bridge's
    last stream ended. The bridge has exited; ClusterD's side of its stream may journal
    the end a moment later (the server learns of it on its own loop)."""
    def streams(kind: str) -> list[int]:
        return [e.seq for e in job.sim.journal if e.kind == kind and e.name == "SubscribeProcessManageSignal"]

    await eventually(lambda: streams("stream-open") and len(streams("stream-end")) == len(streams("stream-open")),
                     10, what="ClusterD saw every stream of the exited bridge end")
    entries = list(job.sim.journal)
    ends = streams("stream-end")
    sent = [e for e in entries if e.kind == "rpc" and e.name == rpc and e.code == 0
            and (code is None or e.detail.get("status", {}).get("code") == code)]
    assert sent, f"{rpc} (code {code}) never reached ClusterD"
    assert ends and sent[-1].seq < ends[-1], f"{rpc} arrived after the bridge's stream ended"


async def assert_ended(job: SimulatedJob, notifier: RecordingNotifier, caplog: pytest.LogCaptureFixture,
                       why: str, timeout: float = 30) -> None:
    assert await job.wait_exit(timeout) == EXIT_CONTROLLER_ENDED
    assert notifier.pings() > 0, "the watchdog was never pinged: the check below would prove nothing"
    assert pings_after_the_decision(notifier) == 0
    lines = [r for r in caplog.records if ENDED in r.getMessage()]
    assert len(lines) == 1 and why in lines[0].getMessage() and str(EXIT_CONTROLLER_ENDED) in lines[0].getMessage()
    assert not marker(job).exists(), "the job's ranks are gone: no orphan marker may be left"
    assert job.training.controller is None  # destroyed by the stop


async def test_exit_strategy(jobs: list[SimulatedJob], notifier: RecordingNotifier,
                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    job = await started(jobs, SimJob(JOB, world_size=8, devices_per_pod=4, strategies=("exit",)))
    assert marker(job).exists()
    job.training.inject_fault({5: 1})
    await assert_ended(job, notifier, caplog, "exit notice")
    # exit expects no result: the strategy report was the last one, and it arrived
    await delivered_before_the_stream_ended(job, "ReportRecoverStrategy")
    assert [n.args[0] for n in job.training.notifies("change_strategy")] == ["exit", "exit"]


async def test_dump_after_save_and_exit(jobs: list[SimulatedJob], notifier: RecordingNotifier,
                                        caplog: pytest.LogCaptureFixture) -> None:
    job = await started(jobs)
    await job.sim.save_and_exit(JOB)
    await assert_ended(job, notifier, caplog, "exit notice")
    await delivered_before_the_stream_ended(job, "ReportRecoverStatus", code=0)
    assert len(job.training.notifies("dump")) == 1


async def test_stop_complete_404_is_answered_with_kill_master(jobs: list[SimulatedJob],
                                                              notifier: RecordingNotifier) -> None:
    """No processor reported its replica information: the stop-complete carries 404 and
    the controller goes to EXIT. ClusterD answers a 404 with killMaster
    (docs/clusterd.md), which stops the bridge first, with 75; had killMaster been lost,
    the EXIT wait running out would end it with 76 (the test below)."""
    job = await started(jobs)
    job.training.replica_info_complete = False
    job.training.inject_fault({5: 1})
    assert await job.wait_exit(30) == EXIT_RESCHEDULED
    await delivered_before_the_stream_ended(job, "ReportStopComplete", code=404)
    assert not marker(job).exists(), "the job is being rescheduled: no orphan marker may be left"


async def test_the_controller_wait_for_clusterd_ran_out(jobs: list[SimulatedJob], notifier: RecordingNotifier,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """ClusterD gone for good after a fault: the controller gives up waiting for stopTrain
    (EXIT), then its EXIT wait runs out too (it tells the ranks to exit, FINAL)."""
    job = await started(jobs)
    await job.sim.stop()
    job.training.inject_fault({5: 1})
    await eventually(lambda: job.training.callbacks("report_fault_ranks"), 10, what="the fault reported")
    await assert_ended(job, notifier, caplog, "wait there ran out", timeout=40)
    assert any("did not hear from ClusterD" in r.getMessage() for r in caplog.records)


async def test_a_repair_that_ends_well_does_not_stop_the_bridge(jobs: list[SimulatedJob],
                                                                notifier: RecordingNotifier) -> None:
    """The decision is about the controller ending, not about a cycle ending: a good
    recovery leaves the bridge serving, pinging, and the marker in place."""
    job = await started(jobs)
    job.training.inject_fault({5: 1})
    await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportRecoverStatus", timeout=15)
    pings = notifier.pings()
    await eventually(lambda: notifier.pings() > pings + 3, 10, what="the watchdog still pinged after the recovery")
    assert job._run is not None and not job._run.done()
    assert marker(job).exists()
