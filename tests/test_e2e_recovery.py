"""End-to-end recoveries: the simulated ClusterD, the stub controller and the real bridge.

Each test drives one full recovery and asserts on the simulator's journal (what ClusterD
saw and sent), the stub controller's record (what the controller was told), and the
bridge's metrics. Every fixture teardown also checks that neither peer recorded a
protocol violation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from bridge.job.daemon import EXIT_CONTROLLER_ENDED
from bridge.sim.clusterd import SimJob
from bridge.sim.clusterd_release import RELEASES, Release
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .simjobs import annotation, start_job

pytestmark = pytest.mark.timeout(60)

JOB = "job-e2e"


def job_spec(**kwargs) -> SimJob:  # type: ignore[no-untyped-def]
    kwargs.setdefault("world_size", 16)
    kwargs.setdefault("devices_per_pod", 4)
    return SimJob(JOB, **kwargs)


@pytest.fixture
def running(clean_jobs: list[SimulatedJob]) -> list[SimulatedJob]:
    """Tests append their SimulatedJob; teardown checks both peers stayed clean."""
    return clean_jobs


@pytest.fixture(params=list(RELEASES))
def release(request: pytest.FixtureRequest) -> Release:
    """The ClusterD release the simulated ClusterD plays (bridge/sim/clusterd_release.py):
    the recovery scenarios run against every one in use."""
    return RELEASES[request.param]


async def started(running: list[SimulatedJob], **kwargs: Any) -> SimulatedJob:
    # start_job runs the controller at FAST_TIMINGS: its real pace is not under test here
    return await start_job(running, kwargs.pop("job", None) or job_spec(), **kwargs)


def signals(job: SimulatedJob, signal_type: str | None = None) -> list:  # type: ignore[type-arg]
    return job.sim.journal.signals(signal_type, job_id=JOB)


def rpcs(job: SimulatedJob, name: str) -> list:  # type: ignore[type-arg]
    return job.sim.journal.rpcs(name, job_id=JOB)


async def stream_ended(job: SimulatedJob, count: int = 1, timeout: float = 15) -> None:
    await job.sim.wait_for(lambda e: e.kind == "stream-end" and e.detail.get("stream") == count, timeout=timeout)


async def test_recover_success(running: list[SimulatedJob], release: Release) -> None:
    job = await started(running, release=release)
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    assert [s.detail["changeStrategy"] for s in signals(job, "changeStrategy")] == ["recover"]
    global_fault = signals(job, "globalFault")[0]
    assert global_fault.detail["faults"] == {4: 1, 5: 1, 6: 1, 7: 1}  # the whole pod
    # ... reaches the controller whole, and the node agent restarted that pod under its repair
    assert [n.args[0] for n in job.training.notifies("on_global_rank")] == [{4: 1, 5: 1, 6: 1, 7: 1}]
    restarts = [r.args[0] for r in job.training.events if r.kind == "training" and r.name == "restart pods"]
    assert restarts == [[4, 5, 6, 7]] and job.training.repair_hang_ranks == ()
    uuids = {s.detail["uuid"] for s in signals(job)}
    assert len(uuids) == 1
    statuses = rpcs(job, "ReportRecoverStatus")
    assert [r.detail["status"]["code"] for r in statuses] == [0] and statuses[0].detail["strategy"] == "recover"
    assert [r.detail["strategies"] for r in rpcs(job, "ReportRecoverStrategy")] == [["exit", "dump", "recover"]]
    assert len(rpcs(job, "ReportStopComplete")) == 1
    await stream_ended(job)
    await job.subscribed()  # re-subscribed after ClusterD closed the stream at the end of the cycle
    m = job.metrics
    assert m.sample("tft_bridge_recovery_cycles_total", {"strategy": "recover", "outcome": "success"}) == 1
    assert m.sample("tft_bridge_faults_reported_total", {"fault_type": "other"}) >= 1
    assert m.sample("tft_bridge_recovery_duration_seconds_count", {"strategy": "recover"}) == 1
    assert m.sample("tft_bridge_reports_dropped_total", {"kind": "stop_complete", "reason": "cycle_ended"}) == 0


async def uce_fault(job: SimulatedJob, rank: int = 5) -> None:
    """A UCE: the training rank reports it to the controller and the bridge relays it;
    ClusterD's fault centre turns that report alone into a retry cycle (docs/clusterd.md)."""
    job.training.inject_fault({rank: 0})
    await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportProcessFault"
                           and e.detail.get("outcome") == "scheduled", timeout=10)


async def test_a_relay_that_drops_ranks_clusterd_named_hangs_the_recovery(running: list[SimulatedJob],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The stub punishes what the real controller punishes: a bridge that forwards fewer
    fault ranks than ClusterD's globalFault named (the seed API's guard once assumed a
    world size of 1 and dropped all but rank 0) leaves the controller repairing rank 5
    while the node agent restarts its whole pod; the repair never completes and the cycle
    ends without recover-success when ClusterD's report wait runs out."""
    import bridge.job.session.signals as signals_module

    real = signals_module.notify_arguments

    def world_of_one(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **{**kwargs, "world_size": 1})

    monkeypatch.setattr(signals_module, "notify_arguments", world_of_one)
    job = await started(running, report_timeout=2.0)
    job.training.inject_fault({5: 1})
    await eventually(lambda: job.training.repair_hang_ranks == (4, 6, 7), timeout=20,
                     what="the repair hanging on the restarted pod")
    assert [n.args[0] for n in job.training.notifies("on_global_rank")] == [{}]
    await job.sim.wait_for(lambda e: e.kind == "signal" and e.detail.get("changeStrategy") == "exit", timeout=20)
    assert rpcs(job, "ReportRecoverStatus") == []
    assert not [a for a in job.sim.journal.entries if a.kind == "annotation" and a.detail.get("value") == "recover-success"]


async def test_retry_success(running: list[SimulatedJob], release: Release) -> None:
    job = await started(running, release=release)
    await uce_fault(job)
    await annotation(job, "retry-success")
    global_fault = signals(job, "globalFault")[0]
    assert global_fault.detail["actions"] == ["on_global_rank"]
    assert global_fault.detail["faults"] == {5: 0}
    assert [s.detail["changeStrategy"] for s in signals(job, "changeStrategy")][:1] == ["retry"]
    assert [r.detail["strategies"] for r in rpcs(job, "ReportRecoverStrategy")][:1] == [["exit", "dump", "retry", "recover"]]
    assert job.training.notifies("change_strategy")[0].args[0] == "retry"
    assert job.metrics.sample("tft_bridge_recovery_cycles_total", {"strategy": "retry", "outcome": "success"}) == 1
    if not release.repeats_retry_cycle:
        assert job.metrics.sample("tft_bridge_recovery_repeated_cycles_total") == 0
        return
    # v7.3.2: the fault centre still holds the repaired UCE and runs the cycle again; the
    # controller's device stop fails (499) and ClusterD marks the job retry-failed.
    await annotation(job, "retry-failed")
    codes = [r.detail["status"]["code"] for r in rpcs(job, "ReportRecoverStatus")]
    assert codes == [0, 499]
    assert len({s.detail["uuid"] for s in signals(job, "stopTrain")}) == 2
    assert [n.args[0] for n in job.training.notifies("stop_train")] == [{5: 0}, {5: 0}]
    # ... and the bridge shows it for what it is: a repeat, not a failed repair.
    m = job.metrics
    assert m.sample("tft_bridge_recovery_repeated_cycles_total") == 1
    assert m.sample("tft_bridge_recovery_cycles_total", {"strategy": "retry", "outcome": "repeat_after_success"}) == 1
    assert m.sample("tft_bridge_recovery_cycles_total", {"strategy": "retry", "outcome": "failed"}) == 0


async def test_a_new_fault_after_a_retry_is_no_repeat(running: list[SimulatedJob]) -> None:
    """A second UCE on the same rank, reported by the controller, is a new failure: only
    a cycle ClusterD starts by itself, on the ranks that just succeeded, repeats it."""
    job = await started(running, release=RELEASES["master"])
    await uce_fault(job)
    await annotation(job, "retry-success")
    await stream_ended(job)
    await job.subscribed()
    job.training.fail_next_repair("repair")
    await uce_fault(job)
    await annotation(job, "retry-failed")
    m = job.metrics
    assert m.sample("tft_bridge_recovery_repeated_cycles_total") == 0
    assert m.sample("tft_bridge_recovery_cycles_total", {"strategy": "retry", "outcome": "failed"}) == 1


async def test_retry_fails_with_405_then_recover(running: list[SimulatedJob], release: Release) -> None:
    job = await started(running, release=release)
    job.training.fail_next_repair(405)
    await uce_fault(job)
    await annotation(job, "recover-success")
    assert [s.detail["changeStrategy"] for s in signals(job, "changeStrategy")] == ["retry", "recover"]
    assert len(signals(job, "globalFault")) == 2  # ClusterD sends globalFault again after a 405
    codes = [r.detail["status"]["code"] for r in rpcs(job, "ReportRecoverStatus")]
    assert codes == [405, 0]
    assert len(job.training.notifies("on_global_rank")) == 2
    assert job.metrics.sample("tft_bridge_recovery_cycles_total", {"strategy": "retry", "outcome": "failed"}) == 1


async def test_recover_fails_then_dump(running: list[SimulatedJob], release: Release) -> None:
    job = await started(running, release=release)
    job.training.fail_next_repair(406)
    job.training.inject_fault({5: 1})
    await annotation(job, "dump-success")
    # After the dump ClusterD sends exit/dump_exit (and repeats it later). The controller
    # hears exactly one exit notice; it is then FINAL, so the bridge leaves for systemd to
    # restart it and the repeat is never forwarded.
    assert await job.wait_exit(15) == EXIT_CONTROLLER_ENDED
    assert [s.detail["changeStrategy"] for s in signals(job, "changeStrategy")][:3] == ["recover", "dump", "exit"]
    assert [r.detail["status"]["code"] for r in rpcs(job, "ReportRecoverStatus")] == [406, 0]
    assert [n.args[0] for n in job.training.notifies("change_strategy")] == ["recover", "dump", "exit"]
    assert job.metrics.sample("tft_bridge_recovery_cycles_total", {"strategy": "dump", "outcome": "success"}) == 1


async def test_exit_expects_no_result(running: list[SimulatedJob], release: Release) -> None:
    job = await started(running, release=release, job=job_spec(strategies=("exit",)))
    job.training.inject_fault({5: 1})
    await stream_ended(job)
    # The exit decision, then (master) FaultRetry's exit notice; v7.3.2 and v7.0.RC1 send none.
    notices = ["exit", "exit"] if release.fault_retry_dump_exit else ["exit"]
    assert [s.detail["changeStrategy"] for s in signals(job, "changeStrategy")] == notices
    assert rpcs(job, "ReportRecoverStatus") == []
    assert "ProcessRecoverStatus" not in job.sim.podgroup(JOB)  # exit-completed is never written
    assert not job.training.callbacks("report_result")
    assert job.metrics.sample("tft_bridge_recovery_cycles_total", {"strategy": "exit", "outcome": "exit"}) == 1


async def test_pause_then_continue(running: list[SimulatedJob], release: Release) -> None:
    job = await started(running, release=release)
    await job.sim.pause(JOB, timeout=0)
    await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportRecoverStatus", timeout=10)
    stop = job.training.notifies("stop_train")
    assert [(n.args[1], n.args[2]) for n in stop] == [("pause", 600)]  # timeout 0 -> the configured default
    assert [n.args[0] for n in job.training.notifies("change_strategy")] == ["continue"]
    status = rpcs(job, "ReportRecoverStatus")[0].detail
    assert (status["status"]["code"], status["strategy"]) == (0, "continue")


async def test_save_and_exit(running: list[SimulatedJob], release: Release) -> None:
    job = await started(running, release=release)
    await job.sim.save_and_exit(JOB)
    await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportRecoverStatus", timeout=10)
    assert len(job.training.notifies("dump")) == 1
    status = rpcs(job, "ReportRecoverStatus")[0].detail
    assert (status["status"]["code"], status["strategy"]) == (0, "dump")
    assert not job.training.callbacks("report_fault_ranks")


async def test_clusterd_first_stop_is_forwarded_once(running: list[SimulatedJob], release: Release) -> None:
    job = await started(running, release=release)
    await job.sim.start_clusterd_fault(JOB, {9: 1})  # a hardware fault ClusterD saw first
    await annotation(job, "recover-success")
    assert len(job.training.notifies("stop_train")) == 1
    assert job.training.callbacks("report_fault_ranks")  # the controller still reports the faults
    assert len(rpcs(job, "ReportStopComplete")) == 1
    assert job.metrics.sample("tft_bridge_signals_refused_total", {"reason": "unexpected_step"}) == 0


async def test_downgrade_passes_extra_params_and_isolates(running: list[SimulatedJob]) -> None:
    job = await started(running, job=job_spec(strategies=("elastic-training", "dump", "exit")), enable_zit=True)
    job.training.inject_fault({5: 1})
    await job.sim.wait_for(lambda e: e.kind == "signal" and e.name == "faultNodesExit", timeout=15)
    change = job.training.notifies("change_strategy")[0]
    assert change.args[0] == "downgrade" and "scale-in-strategy" in change.args[1]
    status = rpcs(job, "ReportRecoverStatus")[0].detail
    assert status["status"]["code"] == 201 and status["strategy"] == "downgrade"
    assert status["isolateRankIds"] == ["4", "5", "6", "7"]
    assert job.metrics.sample("tft_bridge_hook_runs_total", {"hook": "fault_nodes_exit", "result": "no_hook"}) >= 1


async def test_kill_master_stops_the_bridge_for_systemd_to_restart(running: list[SimulatedJob]) -> None:
    job = await started(running)
    await job.sim.kill_master(JOB)
    assert await job.wait_exit(15) == 75
    assert job.training.state in ("UNINIT", "FINAL") or job.training.controller is None


async def test_process_recovery_off_keeps_the_controller_down_until_switched_on(running: list[SimulatedJob]) -> None:
    spec = job_spec(process_recover=False)
    job = await start_job(running, spec, subscribed=False)
    assert job.bridge is not None and job.bridge.controller is not None
    assert not job.bridge.controller.started
    assert job.metrics.sample("tft_bridge_process_recover_enabled") == 0
    await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "Init" and e.code == 403, timeout=5)
    assert not job.sim.journal.select(kind="stream-open")
    spec.process_recover = True  # the operator labels the PodGroup
    await job.subscribed(timeout=10)
    controller = job.bridge.controller
    await eventually(lambda: controller.started, what="the controller started once recovery is on")
    assert job.metrics.sample("tft_bridge_process_recover_enabled") == 1


async def test_duplicated_and_foreign_signals_never_reach_the_controller(running: list[SimulatedJob]) -> None:
    job = await started(running)
    await job.sim.send_foreign_signal(JOB, "someone-else")
    await job.sim.wait_for(lambda e: e.kind == "signal" and e.detail.get("jobId") == "someone-else", timeout=5)
    await eventually(lambda: job.metrics.sample("tft_bridge_signals_refused_total", {"reason": "foreign_job"}),
                     what="the foreign signal refused")
    job.sim.duplicate_next_signal()
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    assert len([s for s in signals(job, "stopTrain")]) >= 2  # ClusterD really sent it twice
    assert len(job.training.notifies("stop_train")) == 1
    assert job.metrics.sample("tft_bridge_signals_refused_total", {"reason": "foreign_job"}) == 1
    assert job.metrics.sample("tft_bridge_signals_refused_total", {"reason": "duplicate"}) == 1


async def storm_delivered(job: SimulatedJob, pause_after: int | None = None) -> None:
    """1 000 fault callbacks back to back on a job of 2 048 ranks, each rank first going
    out in one request built by merging the callbacks queued together. ``pause_after``:
    after that many callbacks, wait until the controller has made its own fault report
    (ClusterD's stopTrain for the first ranks reached it): its reports go out among the
    storm's, merged into a queued request or alone, as the wire's timing has it."""
    assert job.bridge is not None and job.bridge.controller is not None
    callback = job.training.registry.registered("report_fault_ranks")
    assert callback is not None

    def controller_reports() -> int:  # the controller's own report_fault_ranks naming ranks
        return sum(1 for record in job.training.callbacks("report_fault_ranks") if record.args[0])

    def storm() -> None:  # the controller's thread, 1 000 callbacks back to back
        for rank in range(1000):
            if rank == pause_after:
                with job.training.cond:  # told of every callback the controller makes
                    reported = job.training.cond.wait_for(controller_reports, timeout=10)
                assert reported, "the controller made no fault report of its own in 10 s"
            callback({rank: 0}, {rank: ""})

    await asyncio.to_thread(storm)

    def delivered() -> set[int]:
        ranks: set[int] = set()
        for entry in rpcs(job, "ReportProcessFault"):
            ranks |= set(entry.detail["faults"])
        return ranks

    await eventually(lambda: len(delivered()) == 1000, 10, what="all 1000 ranks delivered")
    requests = rpcs(job, "ReportProcessFault")
    assert len(requests) <= 50, len(requests)
    # Every callback's rank first goes out in exactly one request, built by merging the
    # fault reports queued together: the storm's callbacks, and the controller's own
    # report_fault_ranks once ClusterD's stopTrain for the first ranks reached it (it
    # names ranks already sent). A request carrying no rank for the first time is the
    # controller's, a resend, or one of the bridge's own re-reports (a new stream's on a
    # loaded machine, refault.py's when ClusterD started no recovery in time); any of
    # them merges into a queued request when one is waiting. A send that failed (a
    # deadline on a loaded machine, a QPS refusal) may still be journaled; the request
    # stays queued and takes the callbacks behind it, so its resend is built again.
    sent: set[int] = set()
    built = 0
    for entry in requests:
        ranks = set(entry.detail["faults"])
        built += bool(ranks - sent)
        sent |= ranks
    assert sent == set(range(1000))
    streams = len(job.sim.journal.select("stream-open", "SubscribeProcessManageSignal"))
    own = streams - 1 + sum(job.metrics.sample("tft_bridge_fault_rereports_total", {"reason": reason})
                            for reason in ("record_held", "as_process_fault"))
    controller = controller_reports()
    failed = total(job, "tft_bridge_clusterd_rpcs_total",
                   lambda labels: labels["method"] == "ReportProcessFault" and labels["code"] != "0")
    merged = job.metrics.sample("tft_bridge_fault_reports_merged_total")
    shown = [(e.seq, e.code, len(e.detail["faults"]), e.detail.get("outcome")) for e in requests]
    assert 1000 - built <= merged <= 1000 - built + own + controller + failed, (
        merged, built, own, controller, failed, shown)
    if pause_after is not None:
        assert controller >= 1, shown


async def test_fault_storm_every_rank_delivered_in_few_requests(running: list[SimulatedJob]) -> None:
    await storm_delivered(await started(running, job=job_spec(world_size=2048, devices_per_pod=8)))


async def test_a_storm_with_the_controllers_own_report_in_it_delivers_every_rank(running: list[SimulatedJob]) -> None:
    await storm_delivered(await started(running, job=job_spec(world_size=2048, devices_per_pod=8)),
                          pause_after=11)


def after(job: SimulatedJob, seq: int, kind: str, name: str | None = None) -> list:  # type: ignore[type-arg]
    return [e for e in job.sim.journal.select(kind=kind, name=name) if e.seq > seq]


def resume_off(job: SimulatedJob, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bridge as without bridge/job/session/resume.py: a new stream mid-flow is left alone (the
    outbox's own rules are what the test holds)."""
    assert job.bridge is not None
    monkeypatch.setattr(job.bridge.link.reports.resume, "on_subscribed", lambda flow_faults: None)
    monkeypatch.setattr(job.bridge.link.reports.resume, "outcome_unknown", lambda kind: None)


def total(job: SimulatedJob, name: str, keep: Callable[[dict[str, str]], bool] = lambda labels: True) -> float:
    """The sum of the job's ``name`` samples whose labels ``keep`` accepts."""
    return sum(sample.value for family in job.metrics.registry.collect() for sample in family.samples
               if sample.name == name and keep(sample.labels))


def refusals(job: SimulatedJob) -> float:
    """Signals the bridge refused to forward, whatever the reason."""
    return total(job, "tft_bridge_signals_refused_total")


async def test_stream_drop_mid_cycle_no_stale_report_reaches_the_next_cycle(running: list[SimulatedJob],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    job = await started(running, wait_time=30)
    # The outbox's own rule, alone: with the resume on (bridge/job/session/resume.py) the bridge would
    # re-report the cycle and answer the new stopTrain itself (tests/test_clusterd_restart.py).
    assert job.bridge is not None
    resume_off(job, monkeypatch)
    # From the moment ClusterD sends stopTrain every call bounces with "qps exceeded": the
    # stop-complete report provably does not arrive and waits in the outbox.
    job.sim.journal.add_listener(
        lambda e: job.sim.fail_next_unary(10_000) if e.kind == "signal" and e.name == "stopTrain" else None)
    job.training.inject_fault({5: 1})
    await eventually(lambda: bool(job.training.callbacks("report_stop_complete")), timeout=10)
    await eventually(lambda: job.metrics.sample("tft_bridge_clusterd_rpcs_total",
                                                {"method": "ReportStopComplete", "code": "QPS_EXCEEDED"}) >= 1)
    cut = job.sim.journal.entries[-1].seq
    await job.sim.drop_subscriber(JOB)  # the stream breaks: ClusterD resets mid-cycle
    # The bridge learns of the break only when the stream's end reaches it; a retry it sent
    # just before that may cross the break on the wire (ClusterD then drops it at the next
    # Subscribe's reset). The wall stays up until the bridge has dropped the report, so the
    # test asserts what the bridge decides, not which of two packets in flight wins.
    await eventually(lambda: job.metrics.sample("tft_bridge_reports_dropped_total",
                                                {"kind": "stop_complete", "reason": "cycle_ended"}) == 1,
                     what="the stop-complete report dropped with its stream's cycle")
    job.sim.fail_next_unary(-job.sim._fail_next)  # lift the qps wall: Init, Register, Subscribe go through
    await job.sim.wait_for(lambda e: e.kind == "stream-open" and e.seq > cut, timeout=10)
    await job.subscribed()
    # A new cycle on the new stream must wait for a real StopComplete, not eat a stale one.
    mark = job.sim.journal.entries[-1].seq
    handled = refusals(job)
    await job.sim.start_clusterd_fault(JOB, {9: 1})
    # ClusterD waits for a StopComplete (a stale one in its slot would be consumed at once),
    # and the bridge has read the new stopTrain and refused it.
    await job.sim.wait_for(lambda e: e.kind == "state" and e.name == "WaitReportStopCompleteState" and e.seq > mark,
                           timeout=10)
    await eventually(lambda: refusals(job) > handled, what="the bridge refusing the new cycle's stopTrain")
    reached = [e for e in after(job, cut, "rpc", "ReportStopComplete") if not e.detail.get("grpc_status")]
    assert not reached  # (calls bounced at the qps wall never reached the job)
    assert job.sim.state(JOB) == "WaitReportStopCompleteState"
    assert not [e for e in after(job, mark, "state") if e.detail.get("event") == "receiveReport"]
    # and the controller, still waiting for on_global_rank, was not handed a stray stop_train
    assert len(job.training.notifies("stop_train")) == 1


async def test_clusterd_restart_mid_cycle(running: list[SimulatedJob], monkeypatch: pytest.MonkeyPatch) -> None:
    job = await started(running, global_fault_delay=2.0, wait_time=30)
    # Nothing of the old cycle may reach the new ClusterD; the resume (which starts a new
    # cycle and answers it) is off here, tested in tests/test_clusterd_restart.py.
    assert job.bridge is not None
    resume_off(job, monkeypatch)
    job.training.inject_fault({5: 1})
    await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportStopComplete", timeout=10)
    await job.sim.restart()  # all ClusterD state is gone; the stream breaks
    marker = job.sim.journal.entries[-1].seq
    await job.sim.wait_for(lambda e: e.kind == "stream-open" and e.seq > marker, timeout=10)
    inits = [e for e in after(job, marker, "rpc", "Init") if e.code == 0]
    registers = [e for e in after(job, marker, "rpc", "Register") if e.code == 0]
    assert inits and registers and inits[0].seq < registers[0].seq  # Init before Register, again
    await job.subscribed()
    # Live on the new stream with an empty outbox: nothing answering the old cycle is
    # queued or in flight, and the controller (waiting for globalFault) reports nothing.
    await eventually(lambda: job.metrics.sample("tft_bridge_outbox_depth") == 0, what="an empty outbox")
    for name in ("ReportStopComplete", "ReportRecoverStrategy", "ReportRecoverStatus"):
        assert not after(job, marker, "rpc", name), name
    assert job.metrics.sample("tft_bridge_subscription_up") == 1
    assert sum(job.metrics.sample("tft_bridge_subscription_reconnects_total", {"reason": r})
               for r in ("stream_unavailable", "stream_cancelled", "stream_unknown", "keepalive_timeout",
                         "cycle_end")) >= 1


async def test_malformed_signal_is_refused_without_resetting_the_subscription(running: list[SimulatedJob]) -> None:
    job = await started(running)
    opened = len(job.sim.journal.select(kind="stream-open"))
    await job.sim.send_signal(JOB, jobId=JOB, uuid="bad-1", signalType="stopTrain", actions=["stop_train"],
                              faultRanks=[("x", "1")])
    await job.sim.send_signal(JOB, jobId=JOB, uuid="bad-2", signalType="stopTrain", actions=["stop_train"],
                              faultRanks=[("3", "9")])
    await eventually(lambda: job.metrics.sample("tft_bridge_signals_refused_total", {"reason": "malformed"}) == 2)
    assert job.metrics.sample("tft_bridge_bad_inputs_total", {"kind": "signal_fault_ranks"}) == 2
    assert not job.training.notifies("stop_train")
    assert len(job.sim.journal.select(kind="stream-open")) == opened  # the stream was not reset
    job.training.inject_fault({5: 1})  # and the next real cycle still works
    await annotation(job, "recover-success")


async def test_node_hook_runs_with_the_node_ranks(running: list[SimulatedJob], tmp_path) -> None:  # type: ignore[no-untyped-def]
    record = tmp_path / "hook.log"
    job = await started(running, config_overrides={"hooks": {
        "node_command": ["/bin/sh", "-c", f'echo "$@" >> {record}', "hook"], "timeout": 5}})
    job.training.inject_fault({5: 1})
    await annotation(job, "recover-success")
    await eventually(lambda: job.metrics.sample("tft_bridge_hook_runs_total",
                                                {"hook": "fault_nodes_exit", "result": "ok"}) == 1)
    await eventually(lambda: job.metrics.sample("tft_bridge_hook_runs_total",
                                                {"hook": "change_strategy", "result": "ok"}) == 1)
    # rank 5 lives on pod 1: its node exits at the globalFault, and again at the recover
    # (TaskD exits the agents of a recover's nodes, the pods ClusterD has not seen restarted)
    assert record.read_text().splitlines() == ["fault_nodes_exit 1", "change_strategy 1"]
