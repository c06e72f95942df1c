"""Platform mode in the gRPC simulated ClusterD, against plain grpc.aio clients.

Each test pins what the real server does when the job's PodGroup carries
``ProcessRecoverStrategy`` (component/clusterd's recover service; platform
mode as observed on the real peers by tests/conformance/test_real_peers.py and the
differential's ``platform-recover``): nothing is sent until the platform's strategy is
there; the faults are confirmed in ``ProcessConfirmFault`` before the globalFault, and a
confirm left uncleared, a missing result or a missing strategy are 508/509 and
FaultRetry; the platform's strategy vetoes the job's; a recover waits for
``RankTableReady``. A simulation that went on without the platform fails them.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc
import pytest

from bridge._proto import recover_pb2 as pb
from bridge.sim import clusterd_rules as rules
from bridge.sim.clusterd import SimClusterD, SimJob
from bridge.sim.clusterd_release import RELEASES
from bridge.sim.clusterd_timings import REAL

from .test_sim_clusterd import JOB, T, Client, Stream, faults_of, own_sim

pytestmark = pytest.mark.timeout(20)

#: A platform-mode PodGroup: platform mode on, no strategy yet, an empty result (allowed).
PLATFORM_PODGROUP = {"ProcessRecoverStrategy": "", "ProcessResultFault": ""}
#: 2 pods x 2 ranks, as on the real peers.
STRATEGIES = ("retry", "recover", "dump")
#: The poll period of these tests (the real 3 s, scaled) and a few of them.
POLL = T.platform_poll
QUIET = 8 * POLL
#: The path of a platform-mode recover: the same states and events as without the platform.
RECOVER_PATH = (
    "INIT(faultOccur)-->NotifyWaitFaultFlushingState(notifyFinish)-->NotifyStopTrainState(notifySuccess)-->"
    "WaitReportStopCompleteState(receiveReport)-->WaitFaultFlushFinishedState(flushFinished)-->"
    "NotifyGlobalFaultState(notifySuccess)-->WaitReportRecoverStrategyState(receiveReport)-->"
    "NotifyDecidedStrategyState(notifyRecoverStrategySuccess)-->"
    "WaitReportProcessRecoverStatusState(receiveReport)-->CheckRecoverResultState(recoverSuccess)-->INIT")


def platform_job(annotations: Mapping[str, str] = PLATFORM_PODGROUP, strategies: tuple[str, ...] = STRATEGIES) -> SimJob:
    return SimJob(JOB, world_size=4, devices_per_pod=2, strategies=strategies, annotations=dict(annotations))


def platform_steps(sim: SimClusterD) -> list[tuple[str, int | None]]:
    return [(e.name, e.code) for e in sim.journal.select("platform", job_id=JOB)]


def paths(sim: SimClusterD) -> list[str]:
    return [path for path, _ in sim.journal.action_paths(JOB)]


async def fault_then_strategy_wait(sim: SimClusterD, client: Client, faults: dict[int, int]) -> Stream:
    stream = await client.session(sim)
    assert await client.fault(faults) == 0
    await sim.wait_for(lambda e: e.kind == "platform" and e.name == "wait-strategy")
    return stream


async def to_global_fault(sim: SimClusterD, client: Client, stream: Stream) -> pb.ProcessManageSignal:
    stop = await stream.next()
    assert stop.signalType == "stopTrain"
    assert await client.stop_complete() == 0
    global_fault = await stream.next()
    assert global_fault.signalType == "globalFault"
    return global_fault


async def test_nothing_is_sent_until_the_platform_writes_its_strategy_then_the_recover_goes_on() -> None:
    async with own_sim(platform_job()) as (sim, client):
        stream = await fault_then_strategy_wait(sim, client, {2: 1})
        # Polls go by: no stopTrain, the cycle stays in its first state, nothing confirmed.
        await stream.no_signal(QUIET)
        assert sim.state(JOB) == "NotifyWaitFaultFlushingState"
        assert "ProcessConfirmFault" not in sim.podgroup(JOB)
        # exit is no strategy before the confirm step; nor is an unknown word.
        sim.platform_annotate(JOB, {"ProcessRecoverStrategy": "exit"})
        await stream.no_signal(QUIET)
        sim.platform_annotate(JOB, {"ProcessRecoverStrategy": " recover,", "RankTableReady": "true"})
        global_fault = await to_global_fault(sim, client, stream)
        # Confirmed before the globalFault: ClusterD's fault, not yet widened to its pod.
        assert sim.podgroup(JOB)["ProcessConfirmFault"] == "2:1"
        assert faults_of(global_fault) == {2: 1, 3: 1}
        assert await client.strategies(["retry", "recover", "dump", "exit"]) == 0
        change = await stream.next()
        assert (change.signalType, change.changeStrategy) == ("changeStrategy", "recover")
        assert await client.status(0, "recover") == 0
        assert await stream.ended() == grpc.StatusCode.OK
        assert sim.podgroup(JOB)["ProcessRecoverStatus"] == "recover-success"
        assert paths(sim) == [RECOVER_PATH]
        assert platform_steps(sim) == [("wait-strategy", None), ("strategy", None), ("confirm", None),
                                       ("merge", None), ("rank-table-ready", None)]
        # ClusterD clears none of the platform's keys.
        assert {k: sim.podgroup(JOB)[k] for k in ("ProcessConfirmFault", "ProcessResultFault", "RankTableReady")} \
            == {"ProcessConfirmFault": "2:1", "ProcessResultFault": "", "RankTableReady": "true"}
        assert sim.violations == []


async def test_no_strategy_within_the_wait_is_508_and_fault_retry() -> None:
    async with own_sim(platform_job(), timings=T.scaled(1.0, platform_wait=6 * POLL)) as (sim, client):
        stream = await fault_then_strategy_wait(sim, client, {2: 1})
        dump_exit = await stream.next(2.0)
        # FaultRetry: label pause, the dump_exit notice, label on, reset: never a stopTrain.
        assert (dump_exit.signalType, dump_exit.changeStrategy, dump_exit.extraParams) == \
            ("changeStrategy", "exit", "dump_exit")
        assert await stream.ended() == grpc.StatusCode.OK
        assert paths(sim) == ["INIT(faultOccur)-->NotifyWaitFaultFlushingState(waitPlatStrategyTimeout)-->"
                              "FaultRetryState(finish)-->INIT"]
        assert platform_steps(sim) == [("wait-strategy", None), ("strategy", rules.STRATEGY_WAIT_TIMEOUT)]
        assert [e.detail["value"] for e in sim.journal.select("annotation", "label:process-recover-enable")] == \
            ["on", "pause", "on"]
        assert "ProcessRecoverStatus" not in sim.podgroup(JOB)


async def test_a_confirm_left_from_the_last_fault_is_509_without_a_global_fault() -> None:
    leftover = {**PLATFORM_PODGROUP, "ProcessRecoverStrategy": "recover", "ProcessConfirmFault": "1:1"}
    async with own_sim(platform_job(leftover)) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({2: 1}) == 0
        assert (await stream.next()).signalType == "stopTrain"  # the strategy was there already
        assert await client.stop_complete() == 0
        dump_exit = await stream.next()
        assert (dump_exit.signalType, dump_exit.extraParams) == ("changeStrategy", "dump_exit")
        assert await stream.ended() == grpc.StatusCode.OK
        assert sim.podgroup(JOB)["ProcessConfirmFault"] == "1:1"  # not overwritten
        assert paths(sim)[0].endswith("NotifyGlobalFaultState(writeConfirmFaultOrWaitResultFaultTimeout)-->"
                                      "FaultRetryState(finish)-->INIT")
        assert platform_steps(sim)[-1] == ("confirm-failed", rules.CONFIRM_OR_RESULT_FAILED)


async def test_on_v7_3_fault_retry_sends_no_exit_notice() -> None:
    """v7.3.2's FaultRetry resets without a dump_exit (observed on its harness after a
    509); master's sends one first."""
    leftover = {**PLATFORM_PODGROUP, "ProcessRecoverStrategy": "recover", "ProcessConfirmFault": "1:1"}
    async with own_sim(platform_job(leftover), release=RELEASES["7.3"]) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({2: 1}) == 0
        assert (await stream.next()).signalType == "stopTrain"
        assert await client.stop_complete() == 0
        assert await stream.ended() == grpc.StatusCode.OK  # nothing between: no dump_exit
        assert [e.name for e in sim.journal.signals(job_id=JOB)] == ["stopTrain"]
        assert paths(sim)[0].endswith("(writeConfirmFaultOrWaitResultFaultTimeout)-->FaultRetryState(finish)-->INIT")


async def test_no_result_key_within_the_wait_is_509_after_the_confirm_was_written() -> None:
    no_result = {"ProcessRecoverStrategy": "recover"}
    async with own_sim(platform_job(no_result), timings=T.scaled(1.0, platform_wait=6 * POLL)) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({2: 1}) == 0
        assert (await stream.next()).signalType == "stopTrain"
        assert await client.stop_complete() == 0
        assert (await stream.next(3.0)).extraParams == "dump_exit"
        assert sim.podgroup(JOB)["ProcessConfirmFault"] == "2:1"
        assert platform_steps(sim)[-1] == ("confirm-failed", rules.CONFIRM_OR_RESULT_FAILED)


async def test_the_platforms_result_faults_join_the_cycle() -> None:
    with_result = {"ProcessRecoverStrategy": "recover", "ProcessResultFault": "3:0,5:1", "RankTableReady": "true"}
    job = SimJob(JOB, world_size=8, devices_per_pod=2, strategies=STRATEGIES, annotations=with_result)
    async with own_sim(job) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({2: 1}) == 0
        global_fault = await to_global_fault(sim, client, stream)
        assert faults_of(global_fault) == {2: 1, 3: 1, 4: 1, 5: 1}  # 5's pod too
        assert sorted(global_fault.nodeRankIds) == ["1", "2"]
        merge = sim.journal.select("platform", "merge", job_id=JOB)[-1]
        assert merge.detail["faults"] == "2:1,3:0,5:1"


async def test_a_rank_table_not_ready_falls_back_past_recover_under_the_platforms_veto() -> None:
    """RankTableReady "false" fails at once; the platform still says recover, so dump
    (configured, offered) is vetoed too and exit is all that is left."""
    failed = {**PLATFORM_PODGROUP, "ProcessRecoverStrategy": "recover", "RankTableReady": "false"}
    async with own_sim(platform_job(failed)) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({2: 1}) == 0
        await to_global_fault(sim, client, stream)
        assert await client.strategies(["retry", "recover", "dump", "exit"]) == 0
        change = await stream.next()
        assert change.changeStrategy == "exit"
        assert platform_steps(sim)[-1] == ("rank-table-failed", None)


async def test_the_platforms_strategy_vetoes_the_jobs() -> None:
    """A UCE with the platform saying recover: no retry (supportRetryStrategy is the
    platform's), the fault goes the type-1 way and is confirmed as it was reported."""
    plat = {**PLATFORM_PODGROUP, "ProcessRecoverStrategy": "recover", "RankTableReady": "true"}
    async with own_sim(platform_job(plat)) as (sim, client):
        stream = await client.session(sim)
        assert await client.fault({2: 0}) == 0
        global_fault = await to_global_fault(sim, client, stream)
        assert faults_of(global_fault) == {2: 1, 3: 1}
        assert sim.podgroup(JOB)["ProcessConfirmFault"] == "2:0"
        assert await client.strategies(["retry", "recover", "dump", "exit"]) == 0
        assert (await stream.next()).changeStrategy == "recover"


def test_platform_rules() -> None:
    assert (REAL.platform_poll, REAL.platform_wait) == (3.0, 300.0)  # CheckPeriod, ProcessControlTimeout
    assert rules.platform_mode({"ProcessRecoverStrategy": ""})
    assert not rules.platform_mode({"ProcessRecoverStrategy-x": "recover"})
    assert rules.platform_strategy({"ProcessRecoverStrategy": "\u3000dump,,"}, confirm=False) == "dump"
    assert rules.platform_strategy({"ProcessRecoverStrategy": "exit"}, confirm=False) is None
    assert rules.platform_strategy({"ProcessRecoverStrategy": "exit"}, confirm=True) == "exit"
    assert rules.platform_strategy({}, confirm=True) is None
    assert rules.confirm_not_clear({"ProcessConfirmFault": " "}) and not rules.confirm_not_clear({})
    assert [rules.rank_table_state({"RankTableReady": v}) for v in ("true", "True", "")] == \
        ["ready", "failed", "waiting"]
    job = ("retry", "recover-in-place", "recover", "elastic-training", "dump", "exit")
    assert rules.platform_job_strategies(job, "recover") == ("recover-in-place", "recover", "elastic-training", "exit")
    assert rules.platform_job_strategies(job, "") == ("elastic-training", "exit")
    assert rules.merge_platform_faults([("2", "0")], "2:1,4:0", "2:0") == [("2", "1"), ("4", "0")]
    assert rules.faults_string([("2", "1"), ("3", "1")]) == "2:1,3:1"


class PodGroup:
    """A PodGroup whose platform answers once ClusterD's confirm is read ``answer_after`` times."""

    def __init__(self, annotations: Mapping[str, str], answer: Mapping[str, str], answer_after: int = 2) -> None:
        self.values = dict(annotations)
        self.answer = dict(answer)
        self.reads_left = answer_after
        self.writes: list[tuple[str, str]] = []

    def annotations(self) -> Mapping[str, str]:
        if "ProcessConfirmFault" in self.values and self.reads_left == 0:
            self.values.update(self.answer)
        self.reads_left -= 1
        return dict(self.values)

    def write(self, key: str, value: str) -> None:
        self.writes.append((key, value))
        self.values[key] = value


async def test_the_one_model_refuses_a_confirm_left_over_and_writes_nothing() -> None:
    from bridge.sim.clusterd_platform import NOT_CLEAR, PlatformMode

    podgroup = PodGroup({"ProcessRecoverStrategy": "retry", "ProcessConfirmFault": "1:1"}, {})
    out = await PlatformMode(podgroup, POLL, 6 * POLL).confirm([("2", "0")], "2:0")
    assert (out.failure, out.blocking_confirm, out.written, podgroup.writes) == (NOT_CLEAR, "1:1", None, [])


async def test_the_one_model_merges_the_result_and_reads_the_strategy_again_after_it() -> None:
    from bridge.sim.clusterd_platform import PlatformMode

    podgroup = PodGroup({"ProcessRecoverStrategy": "retry"},
                        {"ProcessResultFault": "2:1,4:0", "ProcessRecoverStrategy": " exit,"})
    mode = PlatformMode(podgroup, POLL, 6 * POLL)
    out = await mode.confirm([("2", "0")], "2:0")
    assert podgroup.writes == [("ProcessConfirmFault", "2:0")]
    assert (out.failure, out.result, out.merged) == (None, "2:1,4:0", [("2", "1"), ("4", "0")])
    assert out.strategy == mode.strategy == "exit"  # confirm mode: exit allowed, trimmed


async def test_the_one_model_gives_up_on_a_result_that_never_comes() -> None:
    from bridge.sim.clusterd_platform import NO_RESULT, PlatformMode

    podgroup = PodGroup({"ProcessRecoverStrategy": "retry"}, {}, answer_after=10_000)
    out = await PlatformMode(podgroup, POLL, 3 * POLL).confirm([("2", "0")], "2:0")
    assert (out.failure, out.written, out.result) == (NO_RESULT, "2:0", None)
