"""The bridge between the real peers: ClusterD's service code and a real MindIO TFT build.

Every scenario runs on both entry points (``tft-bridge run`` as its own process, and a
launcher on the seed API hosting the controller itself), with one real controller and
four ranks on the real processor library (2 pods x 2), and asserts what ClusterD
decided (its ``ProcessRecoverStatus`` annotation, its cycle's state path), what the
controller did (its callbacks and notifies, from its own log; the ranks' repair), and
that the bridge stayed up and exits with its documented code. What each proves:
docs/testing.md, "The conformance tier".

Skipped, in one line, without the real peers or under another Python than the one the
MindIO build was made for, and in the suite's run when CI runs the tier in its own stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..conftest import eventually_sync
from .peers import HarnessOptions, find_real_peers, kill_all_on_sigterm
from .realjob import RealJob
from .tier import skip_unless_the_tier_runs_here

skip_unless_the_tier_runs_here()

pytestmark = [pytest.mark.real_peers, pytest.mark.timeout(300)]

#: ClusterD's state paths (its reset function's line when a cycle closes), read from the
#: real server: a retry, and a process-level recover.
_HEAD = ("INIT(faultOccur)-->NotifyWaitFaultFlushingState(notifyFinish)-->NotifyStopTrainState(notifySuccess)-->"
         "WaitReportStopCompleteState(receiveReport)-->WaitFaultFlushFinishedState(flushFinished)-->"
         "NotifyGlobalFaultState(notifySuccess)-->WaitReportRecoverStrategyState(receiveReport)-->")
RETRY_PATH = (_HEAD + "NotifyDecidedStrategyState(notifyRetryStrategySuccess)-->"
              "WaitReportStepRetryStatusState(receiveReport)-->CheckRecoverResultState(recoverSuccess)-->INIT")
RECOVER_PATH = (_HEAD + "NotifyDecidedStrategyState(notifyRecoverStrategySuccess)-->"
                "WaitReportProcessRecoverStatusState(receiveReport)-->CheckRecoverResultState(recoverSuccess)-->INIT")
EXIT_PATH = (_HEAD + "NotifyDecidedStrategyState(notifyExitStrategySuccess)-->CheckRecoverResultState(checkFinish)-->"
             "ListenScheduleResultState(scheduleSuccess)-->NotifyRestartAllProcessState(notifySuccess)-->"
             "WaitRestartAllProcessState")
#: The controller's wait for each ClusterD decision (MINDIO_WAIT_MINDX_TIME): above the
#: 11 s ClusterD takes from a type-1 fault's stop-complete to its globalFault.
WAIT = 20
#: A recovery's bound: a type-1 fault is seen 2 s after the rank raises, its globalFault
#: comes 11 s after the stop, the repair takes a few seconds; a loaded machine doubles it.
RECOVERY = 90.0


@pytest.fixture(params=["daemon", "seed"])
def entry(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_job(peer_logs: Path, entry: str) -> Iterator[Callable[..., RealJob]]:
    """Jobs on the real peers; each is taken down at teardown, pass or fail, and its
    transcript and log folder printed (shown when the test failed); logs in ``peer_logs``."""
    peers = find_real_peers()
    assert peers is not None
    kill_all_on_sigterm()  # CI's budget stops this process with SIGTERM: the peers go with it
    workdir = peer_logs
    jobs: list[RealJob] = []

    def make(options: HarnessOptions, **kwargs: object) -> RealJob:
        job = RealJob(peers, workdir, entry, options, **kwargs)  # type: ignore[arg-type]
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        print(job.dump())
        job.close()


# --------------------------------------------------------------------------- checks
def recovered(job: RealJob, strategy: str) -> None:
    """ClusterD wrote ``<strategy>-success`` and closed the cycle on the path of that
    strategy; the controller was told that strategy, repaired, and reported success."""
    assert job.clusterd.wait_annotation("ProcessRecoverStatus", timeout=RECOVERY) == f"{strategy}-success"
    expected = RETRY_PATH if strategy == "retry" else RECOVER_PATH
    incarnation = job.clusterd.incarnation_mark()
    eventually_sync(lambda: job.clusterd.cycle_paths(incarnation), 10, "ClusterD closing the cycle")
    transcript = job.transcript()
    assert job.clusterd.cycle_paths(incarnation) == [expected], transcript
    assert ("changeStrategy", strategy) in [(t, s) for t, _, s in transcript.signals()], transcript
    assert transcript.of("clusterd", "decision")[-1].strategy == strategy, transcript
    assert transcript.notifies()[-3:] == ["stop_train", "on_global_rank", f"change_strategy:{strategy}"], transcript
    result = transcript.of("controller", "callback", "report_result")
    assert [(r.code, r.strategy) for r in result] == [(0, strategy)], transcript
    every_rank_resumed(job)


def every_rank_resumed(job: RealJob) -> None:
    """Every rank's live process trains on after the repair: it logs a step (every 5th)
    after ClusterD wrote its verdict (a rank the fault interrupted resumes from the
    rollback step; one that was between steps just goes on)."""
    verdict = job.transcript(outcome=False).of("clusterd", "outcome")[-1].at

    def trained_on() -> set[str]:
        return {e["src"] for e in job.ranks.events("step") if e["t"] > verdict}

    ranks = {f"rank{r}" for r in range(job.options.world_size)}
    eventually_sync(lambda: trained_on() >= ranks, 30, "every rank training on after the repair")
    assert all(job.ranks.alive(r) for r in range(job.options.world_size))


def bridge_up_then_stopped(job: RealJob) -> None:
    """The entry kept running through the recovery, and an operator's SIGTERM stops it
    with 0 (docs/operations.md, exit codes; the seed launcher closes its manager)."""
    assert job.entry.exit_code() is None, f"{job.entry.name} exited with {job.entry.exit_code()}"
    assert job.entry.terminate(timeout=70) == 0


def daemon_recorded(job: RealJob, strategy: str) -> None:
    """The bridge's own record: the daemon's flight recorder closed the cycle as a
    success of that strategy, every report answered 0; the seed launcher's RPCs too."""
    transcript = job.transcript(outcome=False)
    codes = [(s.name, s.code) for s in transcript.of("bridge", "rpc") if s.name.startswith("Report")]
    assert codes and {code for _, code in codes} == {0}, transcript
    if job.entry.name == "daemon":
        assert not job.entry.log.find(r"may be ORPHANED"), "a fresh job's bridge flagged it orphaned"
        outcomes = [(s.name, s.strategy) for s in transcript.of("bridge", "outcome")]
        assert outcomes[-1:] == [("success", strategy)], transcript


# --------------------------------------------------------------------------- scenarios
@pytest.mark.parametrize(("kind", "rank", "reported"), [("uce", 2, "2:0"), ("hccl", 1, "1:2")], ids=["uce", "hccl"])
def test_retry(make_job: Callable[..., RealJob], kind: str, rank: int, reported: str) -> None:
    """A UCE (type 0) or an HCCL failure (type 2) on one rank: ClusterD retries, the
    controller repairs in place, no rank is restarted."""
    job = make_job(HarnessOptions(job_uid=f"conformance-{kind}"), wait_mindx_time=WAIT)
    job.start(fault_rank=rank, fault_step=6, fault_kind=kind)
    recovered(job, "retry")
    transcript = job.transcript()
    assert transcript.of("clusterd", "rpc", "ReportProcessFault")[0].faults == reported, transcript
    assert job.agent is not None and job.agent.restarts == []
    assert all(n == 1 for n in job.ranks.starts.values())
    daemon_recorded(job, "retry")
    bridge_up_then_stopped(job)


def test_process_fault_recovered(make_job: Callable[..., RealJob]) -> None:
    """A process fault on rank 2: ClusterD widens it to the pod (2, 3), names both in
    the reset ConfigMap, the node agent restarts them, and the recover succeeds."""
    job = make_job(HarnessOptions(job_uid="conformance-process"), wait_mindx_time=WAIT)
    job.start(fault_rank=2, fault_step=6, fault_kind="unknown")
    recovered(job, "recover")
    transcript = job.transcript()
    assert ("globalFault", "2:1,3:1", "") in transcript.signals(), transcript
    assert job.agent is not None and job.agent.restarts == [[2, 3]]
    restarted = {e["src"] for e in job.ranks.events("registered") if e.get("restarted")}
    assert restarted == {"rank2", "rank3"}
    daemon_recorded(job, "recover")
    bridge_up_then_stopped(job)


def test_fault_in_rank0_pod_recovered(make_job: Callable[..., RealJob]) -> None:
    """A process fault on rank 1: rank 0's whole pod is restarted. The controller lives
    outside every pod (in the bridge's process), so it survives and recovers the job,
    where a controller inside rank 0's pod would die with it."""
    job = make_job(HarnessOptions(job_uid="conformance-pod0"), wait_mindx_time=WAIT)
    job.start(fault_rank=1, fault_step=6, fault_kind="unknown")
    recovered(job, "recover")
    assert job.agent is not None and job.agent.restarts == [[0, 1]]
    assert job.ranks.starts == {0: 2, 1: 2, 2: 1, 3: 1}
    daemon_recorded(job, "recover")
    bridge_up_then_stopped(job)


def test_rank_killed_without_strategy_exits(make_job: Callable[..., RealJob]) -> None:
    """Rank 3 killed (kill -9) on a job whose PodGroup allows only retry: the controller
    offers exit, dump and recover, ClusterD has only exit left and chooses it, the
    controller tells every rank to exit once its wait runs out, and ClusterD waits for a
    restart of the whole job (no ``ProcessRecoverStatus``: ClusterD never writes
    ``exit-completed``). The daemon exits 76 (the controller ended on its own); a seed
    launcher keeps its process and is stopped by its owner."""
    # The controller's wait is longer than the 20 s ClusterD checks whether the fault
    # pods were rescheduled before it asks for every process to restart: the daemon ends
    # (with the controller) only once ClusterD is in its last state.
    wait = 30
    job = make_job(HarnessOptions(job_uid="conformance-exit", strategies="retry"), wait_mindx_time=wait,
                   node_agent=False)
    job.start()
    mark = job.clusterd.log.mark()
    job.ranks.kill([3])
    job.clusterd.wait_log(r"choose strategy:exit", mark, RECOVERY, "ClusterD choosing exit")
    job.entry.log.wait_for(r"Mindx calling notify do EXIT", 0, 30, "the controller told to exit")
    job.clusterd.wait_log(r"state is NotifyRestartAllProcessState, event=notifySuccess", mark, 60,
                          "ClusterD asking every process to restart")
    for rank in (0, 1, 2):  # told by the controller once its wait for ClusterD ran out
        eventually_sync(lambda rank=rank: job.ranks.events("cb_exit", rank), wait + 30, f"rank {rank} told to exit")
    if job.entry.name == "daemon":
        assert job.entry.wait_exit(60) == 76
    else:
        assert job.entry.exit_code() is None
        assert job.entry.terminate(timeout=70) == 0
    eventually_sync(lambda: job.clusterd.cycle_paths(), 30, "ClusterD closing the cycle once the stream ended")
    transcript = job.transcript()
    assert job.clusterd.cycle_paths() == [EXIT_PATH], transcript
    assert transcript.outcome is None, transcript
    assert ("changeStrategy", "2:1,3:1", "exit") in transcript.signals(), transcript
    assert transcript.notifies() == ["stop_train", "on_global_rank", "change_strategy:exit"], transcript
    strategies = transcript.of("controller", "callback", "report_strategies")
    assert strategies and "retry" not in strategies[-1].detail.split(), transcript
    assert transcript.of("controller", "callback", "report_result") == [], transcript


def test_clusterd_killed_after_stop_complete_recovers(make_job: Callable[..., RealJob]) -> None:
    """ClusterD killed (-9) right after it received the stop-complete of a process fault,
    and back on its port 3 s later, with none of the cycle: the bridge re-subscribes,
    re-reports the fault, answers the new cycle from what the controller already did,
    and the recover succeeds at the new ClusterD (MindCluster's own synchronous client
    loses the job here)."""
    from bridge.sim.scenario import free_port

    # The port is reused by the restart: one outside the kernel's ephemeral range, so no
    # reconnect attempt's source port can hold it meanwhile.
    job = make_job(HarnessOptions(job_uid="conformance-restart"), wait_mindx_time=30, clusterd_port=free_port())
    job.start(fault_rank=2, fault_step=6, fault_kind="unknown")
    job.clusterd.wait_log(r"receive ReportStopComplete", 0, RECOVERY, "the stop-complete at ClusterD")
    job.clusterd.kill()
    down_at = time.monotonic()
    time.sleep(3)  # ClusterD stays down 3 s: the outage is the behaviour under test
    job.clusterd.start()
    assert time.monotonic() - down_at >= 3
    recovered(job, "recover")
    assert job.clusterd.incarnations == 2
    # The controller stopped once; the new ClusterD got that stop-complete again, from
    # the bridge, in its own cycle.
    transcript = job.transcript()
    assert len(transcript.of("controller", "callback", "report_stop_complete")) == 1, transcript
    assert len(transcript.of("clusterd", "rpc", "ReportStopComplete")) == 2, transcript
    assert job.clusterd.log.find(r"receive ReportStopComplete", job.clusterd.incarnation_mark()), transcript
    assert job.agent is not None and job.agent.restarts == [[2, 3]]
    daemon_recorded(job, "recover")
    bridge_up_then_stopped(job)


def test_platform_mode_recovers(make_job: Callable[..., RealJob]) -> None:
    """Seed 003's platform mode: the PodGroup carries ``ProcessRecoverStrategy`` empty
    (wait for the platform) and ``ProcessResultFault``. At a process fault ClusterD sends
    nothing until the platform writes a strategy; then it confirms the faults in
    ``ProcessConfirmFault``, the platform's rank table is ready, and the recover
    succeeds."""
    job = make_job(HarnessOptions(job_uid="conformance-platform", platform="", plat_result=""), wait_mindx_time=WAIT)
    job.start(fault_rank=2, fault_step=6, fault_kind="unknown")
    waiting, _ = job.clusterd.wait_log(r"start wait plat strategy ready", 0, RECOVERY,
                                       "ClusterD waiting for the platform's strategy")
    # ClusterD polls the platform's strategy every 3 s and stops nobody meanwhile: two
    # polls' worth of time is the behaviour under test, not a wait for something.
    time.sleep(6)
    assert job.transcript(outcome=False).signals() == []
    assert not job.clusterd.log.find(r"finish wait plat strategy", waiting)
    job.clusterd.post("/pg/annotate", ProcessRecoverStrategy="recover", RankTableReady="true")
    job.clusterd.wait_log(r"finish wait plat strategy, .*strategy=recover", waiting, 30, "ClusterD taking the strategy")
    recovered(job, "recover")
    assert job.clusterd.annotation("ProcessConfirmFault") == "2:1"
    assert job.agent is not None and job.agent.restarts == [[2, 3]]
    daemon_recorded(job, "recover")
    bridge_up_then_stopped(job)
