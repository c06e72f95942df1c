"""ClusterD's operator actions (NIC switch, stress test) on the simulated peers: the
bridge declines them at once and the job goes on training instead of staying paused,
on both entry points (the daemon and the seed API), with the same assertions."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from bridge._proto import recover_pb2 as pb
from bridge._proto import recover_pb2_grpc as pb_grpc
from bridge.job.session.aux_stream import AuxStream
from bridge.job.daemon import EXIT_CONTROLLER_ENDED
from bridge.job.reports.controller_flow import Step
from bridge.job.metrics import BridgeMetrics
from bridge.job.session.operator_actions import MAX_RESULT_RANKS, declined_stress_result
from bridge.sim.clusterd import SimClusterD, SimJob
from bridge.sim.clusterd_timings import FAST
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually, eventually_sync
from .om_operator import Operator
from .seedapi import JOB as SEED_JOB
from .seedapi import ServerThread, hosting_the_controller, server, training  # noqa: F401 - fixtures
from .simjobs import start_job

pytestmark = pytest.mark.timeout(60)

JOB = "job-om-sim"


def assert_clean(job: SimulatedJob) -> None:
    """Neither peer saw a protocol violation."""
    assert (job.sim.violations, job.training.violations) == ([], [])


def om_streams_open(sim: SimClusterD, job_id: str, streams: list[AuxStream[Any]]) -> bool:
    """Both notify streams open on the current generation (after the last Subscribe's reset)."""
    if not all(stream.subscribed.is_set() for stream in streams):
        return False
    last_subscribe = max(e.seq for e in sim.journal.select("stream-open", "SubscribeProcessManageSignal", job_id))
    return {e.name for e in sim.journal.select("om-stream-open", None, job_id)
            if e.seq > last_subscribe} >= {"SubscribeNotifySwitch", "SubscribeNotifyExecStressTest"}


async def om_subscribed(job: SimulatedJob) -> None:
    assert job.bridge is not None and job.bridge.side is not None
    streams = job.bridge.side.operator_actions.streams
    await eventually(lambda: om_streams_open(job.sim, JOB, streams), 10, what="OM streams open")


def declined_count(metrics: BridgeMetrics, operation: str) -> float:
    return metrics.sample("tft_bridge_om_requests_total", {"operation": operation, "result": "declined"})


async def declined(job: SimulatedJob, operation: str) -> None:
    """One request declined and counted (ClusterD may go on, and answer the operator,
    before the bridge has the reply's Status back)."""
    await eventually(lambda: declined_count(job.metrics, operation) == 1, 10,
                     what=f"the declined {operation} counted")


def desyncs(metrics: BridgeMetrics) -> float:
    return sum(s.value for metric in metrics.registry.collect() if metric.name == "tft_bridge_flow_desync"
               for s in metric.samples if s.name.endswith("_total"))


async def stress_test(address: str, job_id: str, ranks: list[int]) -> str:
    """An operator's stress test of ``ranks``: accepted, and the outcome ClusterD gives."""
    async with Operator(address) as operator:
        status = await operator.stress_test(job_id, ranks)
        assert status.code == 0, status
        return await operator.response(job_id, "stress_test", timeout=20)


async def switch_nic(address: str, job_id: str) -> str:
    """An operator's NIC switch of node-1's devices 0 and 1: accepted, and its outcome."""
    async with Operator(address) as operator:
        status = await operator.switch_nic(job_id, {"node-1": [("0", True), ("1", True)]})
        assert status.code == 0, status
        return await operator.response(job_id, "switch_nic", timeout=20)


def assert_stress_test_declined(sim: SimClusterD, job_id: str, training: Any, outcome: str, world_size: int) -> None:
    """The stress test declined at once, every rank "exec failed", and training resumed
    (changeStrategy continue, the controller's result) with nothing isolated; called once
    ClusterD has the controller's ReportRecoverStatus."""
    (notify,) = sim.journal.select("om-notify", None, job_id)
    (reply,) = sim.journal.rpcs("ReplyStressTestResult", job_id)
    assert reply.at - notify.at < 1.0  # answered at once
    assert reply.detail == {"info": "reply success", "ranks": world_size, "codes": ["1"]}  # every rank: exec failed
    assert outcome.startswith("stress test finish") and "exec failed" in outcome
    status_report = sim.journal.rpcs("ReportRecoverStatus", job_id)[0].detail
    assert (status_report["status"]["code"], status_report["strategy"]) == (0, "continue")
    assert [n.args[0] for n in training.notifies("change_strategy")] == ["continue"]
    states = sim.journal.states(job_id)
    assert "WaitStressTestFinishedState" in states and "WaitContinueTrainState" in states
    assert "NotifyStopTrainState" not in states  # nothing isolated, no recovery


def assert_nic_switch_declined(sim: SimClusterD, job_id: str, training: Any, outcome: str) -> None:
    """The switch declined at once (result false), ClusterD told the operator it failed and
    took its failure path: a stop after the pause (handleNotifyStopTrain)."""
    assert outcome == "switch nic failed, switch nic failed"
    (notify,) = sim.journal.select("om-notify", None, job_id)
    assert notify.detail["ranks"] == ["4", "5"]
    (reply,) = sim.journal.rpcs("ReplySwitchNicResult", job_id)
    assert reply.at - notify.at < 1.0 and reply.detail["result"] is False
    states = sim.journal.states(job_id)
    assert states.index("WaitSwitchNicFinishedState") < states.index("NotifyStopTrainState")
    assert [n.args[1] for n in training.notifies("stop_train")] == ["pause", "stop"]


async def test_stress_test_is_declined_and_training_resumes(jobs: list[SimulatedJob]) -> None:
    job = await start_job(jobs, SimJob(JOB, world_size=8, devices_per_pod=4))
    await om_subscribed(job)
    outcome = await stress_test(job.sim.address or "", JOB, [0, 1])
    await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportRecoverStatus", timeout=10)
    await eventually(lambda: job.sim.state(JOB) == "INIT" and job.bridge is not None
                     and job.bridge.flow.step is Step.IDLE, 10, what="job back to training")
    assert_stress_test_declined(job.sim, JOB, job.training, outcome, world_size=8)
    await declined(job, "stress_test")
    assert desyncs(job.metrics) == 0
    assert_clean(job)


def test_seed_api_declines_a_stress_test_and_training_resumes(server: ServerThread, training: Any) -> None:
    """The same on the seed API: a launcher hosting the controller through
    DLRecoverManager no longer leaves the job paused in NotifyStressTestState."""
    manager = hosting_the_controller(server, training)
    try:
        assert manager.link is not None and manager.side is not None
        link, streams = manager.link, manager.side.operator_actions.streams
        eventually_sync(lambda: server.call(om_streams_open, server.sim, SEED_JOB, streams), 10,
                        what="OM streams open")
        outcome = server.run(stress_test(server.address, SEED_JOB, [0, 1]))
        server.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportRecoverStatus")
        eventually_sync(lambda: server.sim.state(SEED_JOB) == "INIT" and link.flow.step is Step.IDLE, 10,
                        what="job back to training")
        assert_stress_test_declined(server.sim, SEED_JOB, training, outcome, world_size=16)
        eventually_sync(lambda: declined_count(manager.metrics, "stress_test") == 1, 10,
                        what="the declined stress_test counted")
        assert desyncs(manager.metrics) == 0
    finally:
        manager.close()
    assert manager.side.tasks and all(task.done() for task in manager.side.tasks.values())


def test_seed_api_declines_a_nic_switch(server: ServerThread, training: Any) -> None:
    """The NIC switch on the seed API: declined at once, ClusterD's failure path runs
    (the job's strategies include retry, which the controller does not offer for a
    fault-less stop: ClusterD chooses dump, and the controller is told to exit)."""
    manager = hosting_the_controller(server, training)
    try:
        assert manager.side is not None
        streams = manager.side.operator_actions.streams
        eventually_sync(lambda: server.call(om_streams_open, server.sim, SEED_JOB, streams), 10,
                        what="OM streams open")
        outcome = server.run(switch_nic(server.address, SEED_JOB))
        server.wait_for(lambda e: e.kind == "annotation" and e.name == "ProcessRecoverStatus"
                        and e.detail.get("value") == "dump-success", 20)
        eventually_sync(lambda: [n.args[0] for n in training.notifies("change_strategy")] == ["dump", "exit"], 10,
                        what="the controller told to dump, then exit")
        assert_nic_switch_declined(server.sim, SEED_JOB, training, outcome)
        eventually_sync(lambda: declined_count(manager.metrics, "switch_nic") == 1, 10,
                        what="the declined switch_nic counted")
        assert desyncs(manager.metrics) == 0
    finally:
        manager.close()


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
    outcome = await switch_nic(job.sim.address or "", JOB)
    await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReplySwitchNicResult", timeout=10)
    if verdict is None:
        await job.sim.wait_for(lambda e: e.kind == "state" and e.name == "WaitReportProcessRecoverStatusState",
                               timeout=20)
        with pytest.raises(TimeoutError):  # the repair of no ranks gives no result
            await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportRecoverStatus", timeout=2)
    else:
        await job.sim.wait_for(lambda e: e.kind == "annotation" and e.name == "ProcessRecoverStatus"
                               and e.detail.get("value") == verdict, timeout=20)
        assert await job.wait_exit(15) == EXIT_CONTROLLER_ENDED  # dumped and told to exit
    assert_nic_switch_declined(job.sim, JOB, job.training, outcome)
    await declined(job, "switch_nic")
    assert desyncs(job.metrics) == 0
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
