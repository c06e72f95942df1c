"""The flight recorder wired into a running bridge: a real recovery through the
simulated ClusterD and the stub controller is read back with ``tft-bridge history``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bridge.cli import main
from bridge.sim.clusterd import SimJob
from bridge.sim.mindio_ttp import FAST_TIMINGS
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .simjobs import annotation

pytestmark = pytest.mark.timeout(60)

JOB = "job-rec"


@pytest.fixture
async def recorded(tmp_path: Path) -> AsyncIterator[tuple[SimulatedJob, Path]]:
    job = SimulatedJob(SimJob(JOB, world_size=16, devices_per_pod=4), controller_timings=FAST_TIMINGS,
                       config_overrides={"recorder": {"enabled": True, "directory": str(tmp_path)}})
    await job.start()
    try:
        await job.subscribed()
        yield job, tmp_path
    finally:
        violations = list(job.sim.violations), list(job.training.violations)
        await job.stop()
        assert violations == ([], []), violations


def history_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:  # type: ignore[type-arg]
    capsys.readouterr()
    assert main(["history", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


async def test_a_recovery_is_recorded_and_read_back(recorded: tuple[SimulatedJob, Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    job, store = recorded
    job.training.inject_fault({5: 1})
    await annotation(job)
    assert job.bridge is not None
    writer = job.bridge.recording.writer
    assert writer is not None
    await eventually(lambda: writer.closed >= 1, 10, what="the cycle closed and written")
    uuid = job.sim.journal.signals("changeStrategy", job_id=JOB)[0].detail["uuid"]
    listing = history_json(capsys, "--state-dir", str(store))
    (cycle,) = listing["cycles"]
    assert (cycle["uuid"], cycle["outcome"], cycle["strategy"]) == (uuid, "success", "recover")
    # The first report names rank 5; the second (after on_global_rank) its whole pod.
    assert cycle["summary"]["faults"]["by_type"] == {"other": 4}
    assert cycle["summary"]["faults"]["ranks"] == "4:1,5:1,6:1,7:1"
    assert [p["name"] for p in cycle["summary"]["phases"]] == ["fault_to_stop", "stop_to_strategy",
                                                                "strategy_to_result"]
    full = history_json(capsys, "--state-dir", str(store), "--cycle", uuid)
    events = full["events"]
    callbacks = [e["name"] for e in events if e["kind"] == "callback"]
    assert callbacks[0] == "report_fault_ranks" and callbacks[-1] == "report_result"
    assert events[0]["faults"]["list"] == "5:1"
    assert {"report_stop_complete", "report_strategies"} <= set(callbacks)
    rpcs = {e["method"]: e for e in events if e["kind"] == "rpc"}
    assert {"ReportProcessFault", "ReportStopComplete", "ReportRecoverStrategy", "ReportRecoverStatus"} <= set(rpcs)
    assert all(e["code"] == 0 and e["latency"] > 0 for e in rpcs.values())
    notifies = [(e["action"], e["rc"]) for e in events if e["kind"] == "notify"]
    assert notifies == [("stop_train", 0), ("on_global_rank", 0), ("change_strategy", 0)]
    signals = [e for e in events if e["kind"] == "signal"]
    assert all(s["uuid"] == uuid for s in signals)
    assert any(s["strategy"] == "recover" for s in signals)
    waits = full["summary"]["waits"]
    assert waits["clusterd"] > 0 and waits["ranks"] > 0
    assert job.metrics.sample("tft_bridge_recorder_errors_total", {"reason": "queue_full"}) == 0


async def test_history_survives_a_restart_of_the_bridge(recorded: tuple[SimulatedJob, Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    job, store = recorded
    job.training.inject_fault({5: 1})
    await annotation(job)
    await job.stop()
    await job.start()  # a fresh bridge on the same state directory
    await job.subscribed()
    listing = history_json(capsys, "--state-dir", str(store))
    assert [c["outcome"] for c in listing["cycles"]] == ["success"]


async def test_an_unwritable_store_never_stops_a_recovery(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    job = SimulatedJob(SimJob(JOB, world_size=16, devices_per_pod=4), controller_timings=FAST_TIMINGS,
                       config_overrides={"recorder": {"enabled": True, "directory": str(blocker / "state")}})
    await job.start()
    try:
        await job.subscribed()
        await eventually(lambda: job.metrics.sample("tft_bridge_recorder_errors_total",
                                                    {"reason": "unwritable"}) >= 1, 10,
                         what="the unwritable store counted")
        job.training.inject_fault({5: 1})
        await annotation(job)
        assert job.bridge is not None and job.bridge.recording.writer is not None
        assert job.bridge.recording.writer.alive
    finally:
        violations = list(job.sim.violations), list(job.training.violations)
        assert await job.stop() == 0
    assert violations == ([], [])
