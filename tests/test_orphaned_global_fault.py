"""The orphaned globalFault (the real ClusterD's behaviour the simulation
reproduces, docs/clusterd.md section 7).

The bridge's stream drops while a type-1 cycle sleeps before its globalFault; the bridge
subscribes again. The real server's sleep is not stopped by the reset: 11 s after the
StopComplete (here ``global_fault_delay``) the *new* stream gets a globalFault
[on_global_rank, fault_nodes_exit] with uuid "", no fault ranks and no node ranks.
Forwarded, the controller reported strategies into a cycle that does not exist; that
stale ReportRecoverStrategy sat in ClusterD's one-slot buffer, the next real stopTrain
was refused (unexpected_step at await_strategy) and the job ended in EXIT.

With the orphan refused, the controller still waits for on_global_rank of its cycle;
the bridge's resume (bridge/job/session/resume.py) re-reports that cycle's faults on the new
subscription, the new ClusterD starts a fresh cycle, and that cycle carries the
recovery: the controller ends it with report_result 0.
"""

from __future__ import annotations



from bridge.sim.clusterd import SimJob
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .simjobs import start_job

JOB = "job-orphan"


async def start(jobs: list[SimulatedJob], **kwargs: float) -> SimulatedJob:
    return await start_job(jobs, SimJob(JOB, world_size=16, devices_per_pod=4), subscribed=False, **kwargs)


def metric(job: SimulatedJob, name: str, **labels: str) -> float:
    return job.metrics.sample(name, labels)


async def drop_during_the_wait_before_global_fault(job: SimulatedJob) -> None:
    await job.subscribed()
    job.training.inject_fault({5: 1})
    await job.sim.wait_for(lambda e: e.kind == "state" and e.name == "NotifyGlobalFaultState", timeout=10)
    await job.sim.drop_subscriber(JOB)


async def assert_recovered_by_the_controller(job: SimulatedJob) -> None:
    """The controller ends the cycle with report_result 0, never EXIT; on_global_rank
    reached it once, with fault ranks; node hooks ran only for globalFaults of a cycle."""
    await eventually(lambda: job.training.callbacks("report_result"), 30, "the controller's result")
    assert job.training.callbacks("report_result")[0].args[0] == 0
    assert "EXIT" not in job.training.states()
    globals_ = job.training.notifies("on_global_rank")
    assert len(globals_) == 1 and globals_[0].args[0], globals_
    # Distinct signals: a globalFault identical to one already handled (the orphan built
    # from the new cycle names what that cycle's own will) is refused as a duplicate,
    # whole, node hook included.
    of_a_cycle = {(s.detail["uuid"], repr(s.detail.get("faults")), tuple(s.detail["nodeRankIds"]))
                  for s in job.sim.journal.signals("globalFault", JOB) if s.detail.get("uuid")}
    await eventually(lambda: metric(job, "tft_bridge_hook_runs_total", hook="fault_nodes_exit",
                                    result="no_hook") == len(of_a_cycle), 5, "one hook run per globalFault of a cycle")
    assert not job.sim.violations and not job.training.violations


async def test_the_orphan_first_on_the_new_stream_is_refused_and_the_resumed_cycle_recovers(
        jobs: list[SimulatedJob]) -> None:
    """The orphan is the first message on the new stream (keep-alives every 4 s, the
    orphan 2 s after the StopComplete), as on the real server when the stream drops late
    in its 11 s wait: no cycle runs, so it comes with uuid "" and no ranks. Before: its
    fault_nodes_exit ran the node hook with no node, and it was not refused as what it is."""
    job = await start(jobs, global_fault_delay=2.0, keepalive_interval=4.0, wait_time=10.0)
    await drop_during_the_wait_before_global_fault(job)
    orphan = await job.sim.wait_for(lambda e: e.kind == "signal" and e.name == "globalFault"
                                    and e.detail.get("uuid") == "", timeout=10)
    assert not orphan.detail.get("faults")
    await eventually(lambda: metric(job, "tft_bridge_signals_refused_total", reason="orphaned_global_fault") == 1,
                     10, "the orphaned globalFault refused")
    # Having sent it, ClusterD waits for a strategy of a cycle nobody runs, and a fault
    # reported then would join that cycle: the bridge resets the job by subscribing again.
    await eventually(lambda: metric(job, "tft_bridge_subscription_reconnects_total",
                                    reason="orphaned_global_fault") == 1, 10, "the re-subscription after the orphan")
    await assert_recovered_by_the_controller(job)


async def test_the_orphan_after_the_resumed_cycle_started_does_not_break_it(jobs: list[SimulatedJob]) -> None:
    """The lead's reproduction (globalFault 1 s after StopComplete, keep-alives every
    0.5 s): the bridge's re-report starts the new cycle before the
    orphan is due, so the orphan is built from the new cycle (its uuid, its whole-pod
    ranks) and cannot be told from a globalFault of that cycle; the controller still
    ends the cycle with report_result 0."""
    job = await start(jobs, global_fault_delay=1.0, report_timeout=3.0)
    await drop_during_the_wait_before_global_fault(job)
    await assert_recovered_by_the_controller(job)
    # the whole pod of rank 5, which the node agent restarts: fewer would hang the repair
    assert job.training.notifies("on_global_rank")[0].args[0] == {4: 1, 5: 1, 6: 1, 7: 1}
