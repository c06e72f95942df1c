"""``tft-bridge report-fault``: faults handed to the running bridge over its owner-only
socket are reported to ClusterD on the controller's own path; refusals are clear. The
seed API does not serve it (bridge/recover_manager.py says why): it opens no socket."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from typing import Any

import pytest

from bridge.cli import main
from bridge.job.reports.controller_flow import Step
from bridge.job.reports.operator_faults import SOCKET_NAME, LocalReports, bind_private, bridge_running, request, step_refusal
from bridge.job.metrics import BridgeMetrics
from bridge.sim.clusterd import SimJob
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .seedapi import ServerThread, hosting_the_controller, server, training  # noqa: F401 - fixtures
from .simjobs import annotation, start_job

pytestmark = pytest.mark.timeout(60)

JOB = "job-local-report"


def job_config(tmp_path: Path, job: SimulatedJob, job_id: str = JOB) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f'job_id = "{job_id}"\n[controller]\nworld_size = {job.job.world_size}\n'
                    f'state_directory = "{job.config.controller.state_directory}"\n', encoding="utf-8")
    return path


async def report_fault(*argv: str) -> int:
    """The CLI in a thread: its blocking socket call must not stall the bridge's loop."""
    return await asyncio.to_thread(main, ["report-fault", *argv])


async def serving(job: SimulatedJob) -> Path:
    path = Path(job.config.controller.state_directory) / SOCKET_NAME
    await eventually(path.exists, 10, what="the report-fault socket")
    return path


async def test_a_handed_fault_starts_a_recovery(jobs: list[SimulatedJob], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    job = await start_job(jobs, SimJob(JOB, world_size=8, devices_per_pod=4))
    path = await serving(job)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # owner only
    assert await report_fault("--config", str(job_config(tmp_path, job)), "5:1") == 0
    assert "handed to the bridge of job job-local-report: 5:1" in capsys.readouterr().out
    fault = await job.sim.wait_for(lambda e: e.kind == "rpc" and e.name == "ReportProcessFault", timeout=10)
    assert fault.detail["faults"] == {5: 1}
    # ClusterD's cycle runs as for the controller's own report: stopTrain names rank 5,
    # the controller is stopped with it, the pod is recovered
    await annotation(job, "recover-success")
    assert [n.args[0] for n in job.training.notifies("stop_train")] == [{5: 1}]
    assert job.metrics.sample("tft_bridge_local_fault_reports_total", {"result": "accepted"}) == 1
    assert not job.sim.violations


async def test_refusals_are_clear_and_counted(jobs: list[SimulatedJob], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    job = await start_job(jobs, SimJob(JOB, world_size=8, devices_per_pod=4))
    path = await serving(job)
    other = tmp_path / "other"
    other.mkdir()
    assert await report_fault("--config", str(job_config(other, job, "job-other")), "5:1") == 3
    assert "this bridge serves job 'job-local-report', not 'job-other'" in capsys.readouterr().err
    assert await report_fault("--config", str(job_config(tmp_path, job)), "5:9") == 2  # said before asking
    assert "fault type must be 0, 1 or 2" in capsys.readouterr().err
    assert await report_fault("--config", str(job_config(tmp_path, job)), "8:1") == 2
    assert "rank 8 is outside the job's world (0..7)" in capsys.readouterr().err
    # a client that skips the CLI's own checks meets the bridge's
    answer = await asyncio.to_thread(request, path, JOB, "3:1,x:1")
    assert answer["ok"] is False and answer["reason"] == "bad_input" and "rank must be ASCII decimal digits" \
        in answer["error"]
    assert job.metrics.sample("tft_bridge_local_fault_reports_total", {"result": "wrong_job"}) == 1
    assert job.metrics.sample("tft_bridge_local_fault_reports_total", {"result": "bad_input"}) == 1
    assert job.metrics.sample("tft_bridge_bad_inputs_total", {"kind": "report_fault_request"}) == 1
    assert not job.sim.journal.rpcs("ReportProcessFault", JOB)  # nothing reached ClusterD


async def test_no_bridge_running_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "job.toml"
    config.write_text(f'job_id = "{JOB}"\n[controller]\nworld_size = 8\nstate_directory = "{tmp_path}"\n',
                      encoding="utf-8")
    assert await report_fault("--config", str(config), "5:1") == 3
    assert f"no bridge is running for job '{JOB}' (no socket at {tmp_path / SOCKET_NAME})" in capsys.readouterr().err
    (tmp_path / SOCKET_NAME).touch()  # a leftover file answers nothing
    assert await report_fault("--config", str(config), "5:1") == 3
    assert "no bridge answers on" in capsys.readouterr().err


def test_the_socket_is_bound_privately_and_leaves_nothing_behind(tmp_path: Path) -> None:
    sock = bind_private(tmp_path / SOCKET_NAME)
    try:
        assert stat.S_IMODE((tmp_path / SOCKET_NAME).stat().st_mode) == 0o600
        assert [p.name for p in tmp_path.iterdir()] == [SOCKET_NAME]  # the private staging directory is gone
        assert bridge_running(tmp_path / SOCKET_NAME)
    finally:
        sock.close()
    assert not bridge_running(tmp_path / SOCKET_NAME)  # a leftover file answers nothing


@pytest.mark.parametrize("step", list(Step))
def test_which_steps_refuse_a_handed_fault(step: Step) -> None:
    refused = step_refusal(step)
    assert (refused is not None) == (step in (Step.PAUSE_SENT, Step.PAUSED, Step.DUMPING, Step.EXITING, Step.EXITED))


async def test_a_fault_during_an_operator_pause_is_refused(tmp_path: Path) -> None:
    """Taken as the controller's report it would make the bridge refuse the pause's
    continue, which the paused controller still waits for: refused, nothing handed on."""
    handed: list[object] = []
    metrics = BridgeMetrics()
    server = LocalReports(JOB, 8, tmp_path, handed.append, metrics, accepting=lambda: True, live=lambda: True,
                          step=lambda: Step.PAUSED)
    task = asyncio.create_task(server.run())
    try:
        await eventually((tmp_path / SOCKET_NAME).exists, 5, what="the socket")
        answer = await asyncio.to_thread(request, tmp_path / SOCKET_NAME, JOB, "5:1")
        assert answer["ok"] is False and answer["reason"] == "refused"
        assert "training is paused by ClusterD" in answer["error"]
        assert handed == [] and metrics.sample("tft_bridge_local_fault_reports_total", {"result": "refused"}) == 1
    finally:
        server.stop()
        await task
    assert not (tmp_path / SOCKET_NAME).exists()  # removed when the bridge stops


def test_the_seed_api_opens_no_report_fault_socket(server: ServerThread, training: Any, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher on the seed API has no configuration file for the command to find its
    socket by, nor a world size to check ranks against: the other side services run, this
    one does not, and nothing is bound even where a state directory is given."""
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    manager = hosting_the_controller(server, training)
    try:
        assert manager.side is not None and manager.side.local_reports is None
        assert set(manager.side.tasks) == {"om", "fault-info"}
        assert not (tmp_path / SOCKET_NAME).exists() and list(tmp_path.iterdir()) == []
    finally:
        manager.close()
