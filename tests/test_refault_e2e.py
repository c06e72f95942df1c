"""A fault right after a recovery, on the simulated ClusterD with the stub controller.

The same UCE on the same rank again, inside the hold of ClusterD's fault-centre record
of the first one: ClusterD answers the report 0 and skips it ("no new faults added",
bridge/sim/clusterd_retry.py). The bridge reports it once more when the record has
expired, and the job recovers; MindCluster's synchronous client (bench/baseline.py), in
the same scenario, leaves the controller waiting until it gives the job up. A UCE on
another rank is new to ClusterD and recovers at once, with no re-report.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bridge.cli import main

from bridge.sim import mindio_ttp
from bridge.sim.clusterd import SimClusterD, SimJob
from bridge.sim.clusterd_timings import FAST
from bridge.sim.mindio_ttp import FAST_TIMINGS
from bridge.sim.scenario import SimulatedJob, free_port

from .conftest import eventually

JOB = "job-refault"
#: ClusterD's fault centre on a clock ten times faster than its own 10 s / 1 s, every other
#: delay a hundred times: a whole retry cycle fits well inside one record's hold
CLUSTERD = FAST.scaled(1.0, retry_record_hold=2.0, fault_centre_period=0.05)
WAIT = 8  # the controller's MINDIO_WAIT_MINDX_TIME: longer than the hold, as the real 30 s is


def retry_successes(sim: SimClusterD) -> int:
    return len([e for e in sim.journal.select("annotation", "ProcessRecoverStatus", JOB)
                if e.detail.get("value") == "retry-success"])


async def first_retry(sim: SimClusterD, training: object) -> None:
    """A UCE on rank 2, retried: the controller trains again."""
    training.inject_fault({2: 0})  # type: ignore[attr-defined]
    await sim.wait_for(lambda e: e.kind == "annotation" and e.detail.get("value") == "retry-success", timeout=20)
    await eventually(lambda: training.state.value == "NORMAL", 10,  # type: ignore[attr-defined]
                     what="the controller training again")


async def test_the_same_uce_right_after_its_retry_is_reported_again_once_clusterd_counts_it_new(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = SimulatedJob(SimJob(JOB, world_size=8, devices_per_pod=4), wait_time=WAIT,
                       controller_timings=FAST_TIMINGS, clusterd_timings=CLUSTERD,
                       config_overrides={"recorder": {"enabled": True, "directory": str(tmp_path)}})
    async with job:
        await job.subscribed()
        await first_retry(job.sim, job.training)
        second = asyncio.get_running_loop().time()
        job.training.inject_fault({2: 0})  # the same fault again, moments after the ranks resumed
        skipped = await job.sim.wait_for(lambda e: e.kind == "fault-list" and e.name == "no-new-faults"
                                         and e.at > second, timeout=10)
        assert skipped.detail["faults"] == {2: 0}
        await eventually(lambda: retry_successes(job.sim) == 2, 3 * WAIT, what="the second retry's success")
        assert job.metrics.sample("tft_bridge_fault_rereports_total", {"reason": "record_held"}) == 1
        assert job.metrics.sample("tft_bridge_fault_rereports_total", {"reason": "as_process_fault"}) == 0
        reports = [e for e in job.sim.journal.rpcs("ReportProcessFault") if e.at > second]
        # the controller's, one more from the bridge (then the recovered cycle's own second report)
        assert [r.detail["faults"] for r in reports[:2]] == [{2: 0}, {2: 0}]
        new = job.sim.journal.select("fault-list", "new-faults", JOB)[-1]
        # Not sent before ClusterD forgot the record: a re-report inside the hold would only refresh it.
        expired = [e for e in job.sim.journal.select("fault-list", "retry-record-expired", JOB) if e.at > second]
        assert expired and reports[1].at > expired[0].at and new.at > reports[1].at
        await eventually(lambda: job.training.state.value == "NORMAL", 10, what="training again")
        assert "EXIT" not in job.training.states()
        assert not job.sim.violations and not job.training.violations
    # The cycle's record says so (the job stopped: every cycle written).
    capsys.readouterr()
    assert main(["history", "--state-dir", str(tmp_path), "--json"]) == 0
    cycles = json.loads(capsys.readouterr().out)["cycles"]
    (again,) = [c for c in cycles if c["summary"].get("rereports")]
    assert again["summary"]["rereports"] == ["record_held"] and again["outcome"] == "success"
    assert main(["history", "--state-dir", str(tmp_path), "--cycle", again["key"]]) == 0
    text = capsys.readouterr().out
    assert "re-report record_held" in text and "RE-REPORTED 1 rank: uce 1 (2:0) again" in text


async def test_a_uce_on_another_rank_after_a_retry_recovers_without_a_re_report() -> None:
    job = SimulatedJob(SimJob(JOB, world_size=8, devices_per_pod=4), wait_time=WAIT,
                       controller_timings=FAST_TIMINGS, clusterd_timings=CLUSTERD)
    async with job:
        await job.subscribed()
        await first_retry(job.sim, job.training)
        job.training.inject_fault({1: 0})
        await eventually(lambda: retry_successes(job.sim) == 2, 2 * WAIT, what="the second retry's success")
        stops = job.sim.journal.signals("stopTrain")
        assert 1 in stops[-1].detail["faults"]  # new to ClusterD: its cycle starts at once
        assert job.metrics.sample("tft_bridge_fault_rereports_total", {"reason": "record_held"}) == 0
        assert not job.sim.violations and not job.training.violations


async def test_the_synchronous_clients_shape_loses_the_job_to_the_same_repeated_uce(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The baseline: MindCluster's client reports once and the controller, told nothing,
    gives the job up after its wait (EXIT)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    from baseline import SyncClient  # MindCluster's synchronous client shape
    from bridge.sim.mindio_ttp import controller_ttp as ttp

    sim = SimClusterD([SimJob(JOB, world_size=8, devices_per_pod=4)], timings=CLUSTERD, keepalive_interval=0.5)
    address = await sim.start(f"127.0.0.1:{free_port()}")
    mindio_ttp.install()
    training = mindio_ttp.training
    training.reset()
    training.use_timings(FAST_TIMINGS)
    training.auto_step = True
    monkeypatch.setenv("MINDIO_WAIT_MINDX_TIME", "2")  # the stub's EXIT comes after one wait
    client = SyncClient(address, JOB)
    try:
        client.register()
        client.start_reader()
        await sim.wait_for(lambda e: e.kind == "stream-open", timeout=10)
        ttp.tft_init_controller(-1, 8, False, True, False)
        ttp.tft_start_controller("127.0.0.1", free_port(), False, "")
        training.connect_ranks(range(8))
        await first_retry(sim, training)
        second = asyncio.get_running_loop().time()
        training.inject_fault({2: 0})
        await sim.wait_for(lambda e: e.kind == "fault-list" and e.name == "no-new-faults" and e.at > second,
                           timeout=10)
        await eventually(lambda: "EXIT" in training.states(), 15,
                         what="the controller giving the job up")
        assert retry_successes(sim) == 1
        assert [e.detail["faults"] for e in sim.journal.rpcs("ReportProcessFault") if e.at > second] == [{2: 0}]
    finally:
        await asyncio.to_thread(client.close)
        training.reset()
        await sim.stop()


# --------------------------------------------------------------------------- a fault racing a Subscribe

async def resubscribing(job: SimulatedJob) -> float:
    """The bridge drops its stream and subscribes again (as after a ClusterD freeze); the
    loop time it was asked to."""
    assert job.bridge is not None
    at = asyncio.get_running_loop().time()
    job.bridge.session.request_resubscribe("test")
    return at


async def test_a_uce_that_reaches_clusterd_before_the_subscribes_reset_still_recovers() -> None:
    """Report first: ClusterD's Subscribe handler runs late, the report (sent once the
    Subscribe request was written) lands before its reset, the fault centre's record is
    published with nobody subscribed and then held: the bridge reports it again once
    ClusterD counts it new."""
    job = SimulatedJob(SimJob(JOB, world_size=8, devices_per_pod=4), wait_time=WAIT,
                       controller_timings=FAST_TIMINGS, clusterd_timings=CLUSTERD)
    async with job:
        await job.subscribed()
        job.sim.delay_next_subscribe(0.4)
        start = await resubscribing(job)
        job.training.inject_fault({3: 0})
        opened = await job.sim.wait_for(lambda e: e.kind == "stream-open" and e.at > start, timeout=10)
        report = next(e for e in job.sim.journal.rpcs("ReportProcessFault") if e.at > start)
        assert report.at < opened.at  # it raced the Subscribe and won: ClusterD had no subscriber
        lost = job.sim.journal.select("fault-lost", "fault-centre", JOB)
        assert lost and lost[-1].at < opened.at
        await eventually(lambda: retry_successes(job.sim) == 1, 3 * WAIT, what="the retry's success")
        assert job.metrics.sample("tft_bridge_fault_rereports_total", {"reason": "record_held"}) == 1
        assert not job.sim.violations and not job.training.violations


async def test_a_uce_reported_after_the_subscribes_reset_leaves_before_the_first_keep_alive() -> None:
    """Subscribe first: the report leaves once the Subscribe request is written, without
    waiting for the new stream's first message, and ClusterD starts its cycle at once."""
    slow_keepalive = 2.0  # the new stream's first keep-alive comes this long after the reset
    job = SimulatedJob(SimJob(JOB, world_size=8, devices_per_pod=4), wait_time=WAIT, keepalive_interval=slow_keepalive,
                       controller_timings=FAST_TIMINGS, clusterd_timings=CLUSTERD)
    async with job:
        await job.subscribed()
        start = await resubscribing(job)
        opened = await job.sim.wait_for(lambda e: e.kind == "stream-open" and e.at > start, timeout=10)
        job.training.inject_fault({3: 0})
        await eventually(lambda: retry_successes(job.sim) == 1, 3 * WAIT, what="the retry's success")
        report = next(e for e in job.sim.journal.rpcs("ReportProcessFault") if e.at > opened.at)
        stop = next(e for e in job.sim.journal.signals("stopTrain") if e.at > opened.at)
        keepalives = [e for e in job.sim.journal.signals("keep-alive") if e.at > opened.at]
        assert not keepalives or report.at < keepalives[0].at  # not held for the first message
        assert stop.at - report.at < 1.0  # a new record: ClusterD's next tick starts the cycle
        assert job.metrics.sample("tft_bridge_fault_rereports_total", {"reason": "record_held"}) == 0
        assert not job.sim.violations and not job.training.violations


async def test_a_wait_too_short_for_the_hold_gets_the_repeated_uce_recovered_as_a_process_fault() -> None:
    """The controller's wait ends before ClusterD would count the repeated UCE new: the
    bridge reports the rank as a process fault, which ClusterD starts a cycle for at once
    whatever its fault centre holds, and the job recovers by a restart instead of a retry."""
    short_wait = 2  # seconds: the same as the record's hold here
    job = SimulatedJob(SimJob(JOB, world_size=8, devices_per_pod=4), wait_time=short_wait,
                       controller_timings=FAST_TIMINGS, clusterd_timings=CLUSTERD)
    async with job:
        await job.subscribed()
        await first_retry(job.sim, job.training)
        second = asyncio.get_running_loop().time()
        job.training.inject_fault({2: 0})
        await job.sim.wait_for(lambda e: e.kind == "annotation" and e.at > second
                               and e.detail.get("value") == "recover-success", timeout=20)
        assert job.metrics.sample("tft_bridge_fault_rereports_total", {"reason": "as_process_fault"}) == 1
        reports = [e.detail["faults"] for e in job.sim.journal.rpcs("ReportProcessFault") if e.at > second]
        assert reports[:2] == [{2: 0}, {2: 1}]
        await eventually(lambda: job.training.state.value == "NORMAL", 10, what="training again")
        assert not job.sim.violations and not job.training.violations
