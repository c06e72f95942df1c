"""ClusterD's operator actions (NIC switch, stress test) on the simulated peers: the
bridge declines them at once and the job goes on training instead of staying paused."""

from __future__ import annotations

import asyncio
import grpc
import pytest

from bridge._proto import recover_pb2 as pb
from bridge._proto import recover_pb2_grpc as pb_grpc
from bridge.daemon import EXIT_CONTROLLER_ENDED
from bridge.flow import Step
from bridge.om import MAX_RESULT_RANKS, declined_stress_result
from bridge.sim.clusterd import SimClusterD, SimJob
from bridge.sim.clusterd_timings import FAST
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .om_operator import Operator
from .simjobs import start_job

pytestmark = pytest.mark.timeout(60)

JOB = "job-om-sim"


def assert_clean(job: SimulatedJob) -> None:
    """Neither peer saw a protocol violation."""
    assert (job.sim.violations, job.training.violations) == ([], [])


async def om_subscribed(job: SimulatedJob) -> None:
    """Both notify streams open on the current generation (after the last Subscribe's reset)."""
    assert job.bridge is not None and job.bridge.side is not None
    streams = job.bridge.side.om.streams
    await eventually(lambda: all(stream.subscribed.is_set() for stream in streams), 10, what="OM streams open")
    opened = job.sim.journal.select("om-stream-open", None, JOB)
    await eventually(lambda: {e.name for e in job.sim.journal.select("om-stream-open", None, JOB)
                              if e.seq > _last_subscribe(job)} >= {"SubscribeNotifySwitch",
                                                                   "SubscribeNotifyExecStressTest"},
                     10, what=f"OM streams re-opened after the last Subscribe ({len(opened)} opens)")


def _last_subscribe(job: SimulatedJob) -> int:
    return max(e.seq for e in job.sim.journal.select("stream-open", "SubscribeProcessManageSignal", JOB))


async def declined(job: SimulatedJob, operation: str) -> None:
    """One request declined and counted (ClusterD may go on, and answer the operator,
    before the bridge has the reply's Status back)."""
    await eventually(lambda: job.metrics.sample("tft_bridge_om_requests_total",
                                                {"operation": operation, "result": "declined"}) == 1,
                     10, what=f"the declined {operation} counted")


def desyncs(job: SimulatedJob) -> float:
    return sum(s.value for metric in job.metrics.registry.collect() if metric.name == "tft_bridge_flow_desync"
               for s in metric.samples if s.name.endswith("_total"))


async def test_stress_test_is_declined_and_training_resumes(jobs: list[SimulatedJob]) -> None:
    job = await start_job(jobs, SimJob(JOB, world_size=8, devices_per_pod=4))
    await om_subscribed(job)
    async with Operator(job.sim.address or "") as operator:
        status = await operator.stress_test(JOB, [0, 1])
        assert status.code == 0, status
        outcome = await operator.response(JOB, "stress_test", timeout=20)
    notify = await job.sim.wait_for(lambda e: e.kind == "om-notify" and e.job_id == JOB, timeout=10)
    reply = await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReplyStressTestResult", timeout=10)
    assert reply.at - notify.at < 1.0  # answered at once
    assert reply.detail == {"info": "reply success", "ranks": 8, "codes": ["1"]}  # every rank: exec failed
    assert outcome.startswith("stress test finish") and "exec failed" in outcome
    # ClusterD resumes training: changeStrategy continue, the controller's result, the flow back to INIT
    await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportRecoverStatus", timeout=10)
    status_report = job.sim.journal.rpcs("ReportRecoverStatus", JOB)[0].detail
    assert (status_report["status"]["code"], status_report["strategy"]) == (0, "continue")
    assert [n.args[0] for n in job.training.notifies("change_strategy")] == ["continue"]
    await eventually(lambda: job.sim.state(JOB) == "INIT" and job.bridge is not None
                     and job.bridge.flow.step is Step.IDLE, 10, what="job back to training")
    states = job.sim.journal.states(JOB)
    assert "WaitStressTestFinishedState" in states and "WaitContinueTrainState" in states
    assert "NotifyStopTrainState" not in states  # nothing isolated, no recovery
    await declined(job, "stress_test")
    assert desyncs(job) == 0
    assert_clean(job)


@pytest.mark.parametrize(("strategies", "verdict"), [
    (("recover", "dump", "exit"), None),
    (("retry", "recover", "dump", "exit"), "dump-success"),
])
async def test_nic_switch_is_declined_and_clusterd_takes_its_failure_path(
        jobs: list[SimulatedJob], strategies: tuple[str, ...], verdict: str | None) -> None:
    """ClusterD's answer to a failed switch is a recovery cycle with no fault ranks
    (handleNotifyStopTrain), as on the real peers: with retry among the job's strategies
    the controller offers no retry for a fault-less stop, ClusterD takes that as "uce
    repair not enabled" and chooses dump: the job is saved and exits. Without retry it
    chooses recover, and the controller's repair of no ranks waits for new workers that
    never come (no result; ClusterD's report timeout ends it). Nothing stalls in the OM
    flow and the bridge follows every step without a desync."""
    job = await start_job(jobs, SimJob(JOB, world_size=8, devices_per_pod=4, strategies=strategies))
    await om_subscribed(job)
    async with Operator(job.sim.address or "") as operator:
        status = await operator.switch_nic(JOB, {"node-1": [("0", True), ("1", True)]})
        assert status.code == 0, status
        outcome = await operator.response(JOB, "switch_nic", timeout=20)
    assert outcome == "switch nic failed, switch nic failed"
    notify = await job.sim.wait_for(lambda e: e.kind == "om-notify" and e.job_id == JOB, timeout=10)
    assert notify.detail["ranks"] == ["4", "5"]
    reply = await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReplySwitchNicResult", timeout=10)
    assert reply.at - notify.at < 1.0 and reply.detail["result"] is False
    if verdict is None:
        await job.sim.wait_for(lambda e: e.kind == "state" and e.name == "WaitReportProcessRecoverStatusState",
                               timeout=20)
        with pytest.raises(TimeoutError):  # the repair of no ranks gives no result
            await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportRecoverStatus", timeout=2)
    else:
        await job.sim.wait_for(lambda e: e.kind == "annotation" and e.name == "ProcessRecoverStatus"
                               and e.detail.get("value") == verdict, timeout=20)
        assert await job.wait_exit(15) == EXIT_CONTROLLER_ENDED  # dumped and told to exit
    states = job.sim.journal.states(JOB)
    assert states.index("WaitSwitchNicFinishedState") < states.index("NotifyStopTrainState")
    assert [n.args[1] for n in job.training.notifies("stop_train")] == ["pause", "stop"]
    await declined(job, "switch_nic")
    assert desyncs(job) == 0
    assert_clean(job)


async def test_nic_switch_outside_a_super_pod_is_refused(jobs: list[SimulatedJob]) -> None:
    """As on the real server (checkNicsParam): a node without a super pod cannot switch."""
    job = await start_job(jobs, SimJob(JOB, world_size=8, devices_per_pod=4, super_pod_id=-1))
    async with Operator(job.sim.address or "") as operator:
        status = await operator.switch_nic(JOB, {"node-1": [("0", True)]})
    assert (status.code, status.info) == (413, "node:node-1 should operate in superPodID")
    assert job.sim.state(JOB) == "INIT"


async def test_without_a_listener_the_simulated_clusterd_stalls() -> None:
    """The simulation fails where the real server does: a client that pauses but does
    not listen on the notify stream leaves the stress test in NotifyStressTestState,
    training paused (what the bridge did before it answered these requests)."""
    sim = SimClusterD([SimJob(JOB, world_size=8, devices_per_pod=4)], timings=FAST, keepalive_interval=0.2)
    async with sim, grpc.aio.insecure_channel(sim.address or "") as channel:
        stub = pb_grpc.RecoverStub(channel)  # type: ignore[no-untyped-call]
        info = pb.ClientInfo(jobId=JOB, role="test")
        assert (await stub.Init(info, timeout=5)).code == 0
        assert (await stub.Register(info, timeout=5)).code == 0
        stream = stub.SubscribeProcessManageSignal(info)
        await sim.wait_for(lambda e: e.kind == "stream-open", timeout=5)
        async with Operator(sim.address or "") as operator:
            assert (await operator.stress_test(JOB)).code == 0
        while "pause_train" not in (signal := await asyncio.wait_for(stream.read(), 5)).actions:
            pass
        assert signal.timeout == 900
        stop = pb.StopCompleteRequest(jobId=JOB, status=pb.Status(code=0, info="Controller pause train success!"))
        assert (await stub.ReportStopComplete(stop, timeout=5)).code == 0
        await sim.wait_for(lambda e: e.kind == "state" and e.name == "NotifyStressTestState", timeout=5)
        with pytest.raises(TimeoutError):  # the real server waits for a listener with no limit
            await sim.wait_for(lambda e: e.kind == "state" and e.name == "WaitStressTestFinishedState", timeout=2)
        assert sim.state(JOB) == "NotifyStressTestState"
        stream.cancel()


def test_declined_result_covers_every_rank_and_op() -> None:
    request = pb.StressTestRankParams(jobId="j")
    request.stressParam["3"].ops.extend([0, 1])
    request.stressParam["4"].ops.extend([1])
    result = declined_stress_result("j", request)
    assert {rank: {op: r.code for op, r in v.rankResult.items()} for rank, v in result.stressResult.items()} == {
        "3": {"aic": "1", "p2p": "1"}, "4": {"p2p": "1"}}
    huge = pb.StressTestRankParams(jobId="j")
    for rank in range(MAX_RESULT_RANKS + 1):
        huge.stressParam[str(rank)].ops.append(0)
    assert len(declined_stress_result("j", huge).stressResult) == 0  # bounded: ClusterD resumes all the same


async def test_the_streams_come_back_after_a_clusterd_restart(jobs: list[SimulatedJob]) -> None:
    """A broken notify stream is counted and subscribed again (jittered back-off): after
    ClusterD restarts, its next stress test is still answered."""
    job = await start_job(jobs, SimJob(JOB, world_size=8, devices_per_pod=4))
    await om_subscribed(job)
    await job.sim.restart()
    await eventually(lambda: job.metrics.sample("tft_bridge_clusterd_stream_failures_total",
                                                {"stream": "stress_test"}) >= 1, 10, what="the broken stream counted")
    await job.subscribed()
    await om_subscribed(job)
    async with Operator(job.sim.address or "") as operator:
        assert (await operator.stress_test(JOB, [1])).code == 0
        assert (await operator.response(JOB, "stress_test", timeout=20)).startswith("stress test finish")
    await declined(job, "stress_test")
    assert_clean(job)
