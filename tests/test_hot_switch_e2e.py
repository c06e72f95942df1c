"""A hot switch end to end: the simulated ClusterD's hot-switch controller, the stub
controller and the real bridge between them.

ClusterD's hot switch (bridge/sim/clusterd_hot_switch.py) moves a sub-healthy pod's ranks
to a backup pod: ``hot switch`` with that pod's ranks, ``new pod running``, the
controller's ``["migration"]`` once the replacement ranks registered, changeStrategy
``migration``, the result. The flow table once had no row for the controller's offer
outside a fault flow, so every hot switch counted a flow desync and fired
TftBridgeFlowDesync; these tests walk each ending and assert none, and no refusal.
"""

from __future__ import annotations


import pytest

from bridge.sim.clusterd import SimJob
from bridge.sim.clusterd_timings import FAST
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .simjobs import reports_handled, start_job

pytestmark = pytest.mark.timeout(60)

JOB = "job-hot-switch"
POD_1 = [4, 5, 6, 7]  # the sub-healthy pod: 4 devices per pod


async def started(clean_jobs: list[SimulatedJob], new_pod_timeout: float = 30.0) -> SimulatedJob:
    spec = SimJob(JOB, world_size=16, devices_per_pod=4, hot_switch=True)
    return await start_job(clean_jobs, spec, clusterd_timings=FAST.scaled(1.0, new_pod_timeout=new_pod_timeout))


def counted(job: SimulatedJob, family: str) -> dict[tuple[str, ...], float]:
    """Every non-zero sample of a counter family, by its label values."""
    return {tuple(sample.labels.values()): sample.value for metric in job.metrics.registry.collect()
            if metric.name == family for sample in metric.samples
            if sample.name.endswith("_total") and sample.value}


def clean(job: SimulatedJob) -> None:
    """No desync, no refused signal, every notify accepted."""
    assert counted(job, "tft_bridge_flow_desync") == {}
    assert counted(job, "tft_bridge_signals_refused") == {}
    assert [n.result for n in job.training.notifies()] == [0] * len(job.training.notifies())


async def switch_started(job: SimulatedJob) -> None:
    assert await job.sim.sub_health_fault(JOB, 5) == "started"
    await eventually(lambda: job.training.notifies("prepare_action"), 10, what="the hot switch forwarded")
    assert [n.args for n in job.training.notifies("prepare_action")] == [("hot switch", {r: 1 for r in POD_1})]


async def test_a_hot_switch_migrates_without_a_desync(clean_jobs: list[SimulatedJob]) -> None:
    job = await started(clean_jobs)
    await switch_started(job)
    job.training.connect_ranks(POD_1)  # the backup pod's processes register
    await job.sim.new_pod_running(JOB)
    await job.sim.wait_for(lambda e: e.kind == "state" and e.name == "InitState"
                           and e.detail.get("event") == "RestartSuccessEvent", timeout=20)
    await reports_handled(job)
    signals = [(s.name, s.detail["actions"]) for s in job.sim.journal.signals(job_id=JOB) if s.name != "keep-alive"]
    assert signals == [("hot-switch", ["hot switch"]), ("hot-switch", ["new pod running"]),
                       ("changeStrategy", ["change_strategy"])]
    assert [r.detail["strategies"] for r in job.sim.journal.rpcs("ReportRecoverStrategy", job_id=JOB)] == [["migration"]]
    statuses = job.sim.journal.rpcs("ReportRecoverStatus", job_id=JOB)
    assert [(r.detail["strategy"], r.detail["status"]["code"]) for r in statuses] == [("migration", 0)]
    assert [n.args for n in job.training.notifies("change_strategy")] == [("migration", "")]
    assert job.bridge is not None and job.bridge.link.flow.step.value == "idle"
    assert counted(job, "tft_bridge_recovery_cycles") == {("migration", "success"): 1}
    clean(job)


async def test_a_hot_switch_whose_pause_failed_ends_with_the_job_deleted_and_no_desync(
        clean_jobs: list[SimulatedJob]) -> None:
    """The controller offers ["exit"]; ClusterD sends nothing more, deletes the job's
    first pod (the job is rescheduled) and turns the hot switch off; the controller's
    wait runs out into EXIT, and the bridge's flow follows it there by its own clock."""
    job = await started(clean_jobs)
    job.training.fail_next_pause()
    await switch_started(job)
    job.training.connect_ranks(POD_1)
    await job.sim.new_pod_running(JOB)
    await job.sim.wait_for(lambda e: e.kind == "kube" and e.name == "delete-pod", timeout=20)
    assert [r.detail["strategies"] for r in job.sim.journal.rpcs("ReportRecoverStrategy", job_id=JOB)] == [["exit"]]
    assert job.training.wait_state("EXIT", timeout=20)
    assert job.bridge is not None
    flow = job.bridge.link.flow
    await eventually(lambda: flow.refusal("change_strategy", "exit") is None or flow.step.value == "exiting", 20,
                     what="the flow past the controller's wait")
    assert job.sim.journal.signals("changeStrategy", job_id=JOB) == []
    assert await job.sim.sub_health_fault(JOB, 9) != "started"  # off for the job now
    assert counted(job, "tft_bridge_recovery_cycles") == {}  # nothing the recovery alerts count
    clean(job)


async def test_a_backup_pod_that_never_runs_stops_the_switch_and_the_next_fault_recovers(
        clean_jobs: list[SimulatedJob]) -> None:
    """No backup pod within ClusterD's minute: ClusterD sends stop switch while the
    controller still waits in NORMAL for the replacement ranks. Told, the controller
    latches it in its wake-up slot and the next fault it detects ends in EXIT (the
    stub does what the real source does); the bridge withholds it, ends the switch in its
    flow, and the next fault recovers."""
    job = await started(clean_jobs, new_pod_timeout=0.5)
    await switch_started(job)
    await job.sim.wait_for(lambda e: e.kind == "signal" and e.detail.get("actions") == ["stop switch"], timeout=10)
    await eventually(lambda: job.metrics.sample("tft_bridge_controller_notifies_total",
                                                {"action": "stop switch", "result": "withheld"}) == 1,
                     10, what="stop switch withheld")
    assert [n.args[0] for n in job.training.notifies("prepare_action")] == ["hot switch"]
    assert job.bridge is not None and job.bridge.link.flow.step.value == "idle"
    await job.sim.wait_for(lambda e: e.kind == "stream-end", timeout=10)
    await job.subscribed()
    clean(job)
    job.training.inject_fault({9: 1})
    await job.sim.wait_for(lambda e: e.kind == "annotation" and e.detail.get("value") == "recover-success",
                           timeout=30)
    await reports_handled(job)
    clean(job)
