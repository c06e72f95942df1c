"""The orphaned job: a bridge restart while the job keeps running.

The real controller cannot adopt running ranks (a controller started again on the same
address rejects every heartbeat of ranks it did not start), so after a crash, an OOM
kill or a restart mid-training the job trains on with no fault tolerance and hangs at
its next fault. Before the fix nothing showed it. Now the marker a controller's start
writes (bridge/job/session/orphan.py) survives such an end, and the next bridge says so -- CRITICAL
log, ``tft_bridge_orphaned_job`` = 1, STATUS= -- until a rank connects to its own
controller (the job was restarted).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.job.metrics import BridgeMetrics
from bridge.job.session.orphan import MARKER_NAME, STALE_MARKER_AGE, ControllerMarker, OrphanWatch, sweep_stale_markers
from bridge.core.state_dir import state_directory
from bridge.sim.clusterd import SimJob
from bridge.sim.scenario import SimulatedJob, free_port

from .conftest import eventually, eventually_sync
from .processes import reap, spawn_bridge
from .simjobs import RecordingNotifier, start_job

pytestmark = pytest.mark.timeout(90)
JOB = "job-orphan"


async def started(jobs: list[SimulatedJob], state: Path, **kwargs: Any) -> SimulatedJob:
    return await start_job(jobs, SimJob(JOB, world_size=8, devices_per_pod=4),
                           config_overrides={"controller": {"state_directory": str(state)}}, **kwargs)


def orphaned(job: SimulatedJob) -> float:
    return job.metrics.sample("tft_bridge_orphaned_job")


async def stop(jobs: list[SimulatedJob], job: SimulatedJob) -> int:
    jobs.remove(job)
    return await job.stop()


# --------------------------------------------------------------------------- the marker file

def test_the_marker_is_written_atomically_and_read_back(tmp_path: Path) -> None:
    metrics = BridgeMetrics()
    marker = ControllerMarker(tmp_path / "state", metrics)
    assert marker.read() is None
    assert marker.write({"pid": 7, "address": "10.0.0.1:8000"})
    assert marker.read() == {"pid": 7, "address": "10.0.0.1:8000"}
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [MARKER_NAME]  # no temporary left
    assert marker.remove() and marker.read() is None


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]"])
def test_an_unreadable_marker_still_counts_as_left_over_and_is_counted(tmp_path: Path, content: bytes,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    metrics = BridgeMetrics()
    (tmp_path / MARKER_NAME).write_bytes(content)
    watch = OrphanWatch(ControllerMarker(tmp_path, metrics), metrics, JOB)
    assert watch.check_leftover()
    assert metrics.sample("tft_bridge_orphaned_job") == 1
    assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "orphan_marker"}) == 1
    assert any(r.levelno == logging.CRITICAL for r in caplog.records)


def test_a_marker_that_cannot_be_written_never_stops_the_bridge(tmp_path: Path) -> None:
    metrics = BridgeMetrics()
    blocker = tmp_path / "file"
    blocker.write_text("")
    watch = OrphanWatch(ControllerMarker(blocker / "state", metrics), metrics, JOB)  # a file as a parent
    watch.controller_started("127.0.0.1:8000")
    assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "orphan_marker"}) == 1


def test_the_state_directory_follows_the_unit() -> None:
    assert state_directory("/srv/x", JOB, env={"STATE_DIRECTORY": "/var/lib/tft-bridge/j1"}) == Path("/srv/x")
    assert state_directory("", JOB, env={"STATE_DIRECTORY": "/var/lib/tft-bridge/j1:/other"}) == \
        Path("/var/lib/tft-bridge/j1")
    assert state_directory("", "a/../b", env={}) == Path("/var/lib/tft-bridge/a_.._b")


# --------------------------------------------------------------------------- crash, then the next bridge

def crash_a_running_bridge(tmp_path: Path, state: Path) -> None:
    """``tft-bridge run`` as a real process, SIGKILLed once its controller runs (an OOM
    kill, ``kill -9``): no stop code runs at all."""
    config = tmp_path / "crash.toml"
    config.write_text(f"""
job_id = "{JOB}"
[clusterd]
address = "127.0.0.1:{free_port()}"
startup_wait = 0.2
[controller]
module = "stub"
bind_ip = "127.0.0.1"
port = {free_port()}
world_size = 8
state_directory = "{state}"
[metrics]
enabled = false
[recorder]
enabled = false
""")
    process = spawn_bridge("run", "--config", str(config))
    try:
        eventually_sync(lambda: (state / MARKER_NAME).exists() or process.poll() is not None, 30,
                        what="the crashing bridge's controller started")
        assert process.poll() is None, process.communicate()[0]
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=30)
    finally:
        reap(process)
    left = json.loads((state / MARKER_NAME).read_text())
    assert left["pid"] == process.pid and left["job_id"] == JOB


async def test_a_crashed_bridge_leaves_the_job_flagged_until_a_rank_connects(
        tmp_path: Path, jobs: list[SimulatedJob], notifier: RecordingNotifier, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="bridge.job.session.orphan")
    state = tmp_path / "state"
    crash_a_running_bridge(tmp_path, state)
    # The job's ranks are attached to the dead controller: none connects to the new one.
    job = await started(jobs, state, connected_ranks=0)
    assert orphaned(job) == 1
    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(critical) == 1 and "ORPHANED" in critical[0].getMessage()
    await eventually(lambda: any("ORPHANED" in s for s in notifier.statuses), what="STATUS= saying so")
    # The job is restarted: its fresh ranks register with this controller.
    job.training.connect_ranks(range(8))
    await eventually(lambda: orphaned(job) == 0, what="the suspicion cleared by a connected rank")
    assert any(r.levelno == logging.INFO and "no longer orphaned" in r.getMessage() for r in caplog.records)
    await eventually(lambda: "ORPHANED" not in notifier.statuses[-1], what="STATUS= no longer saying so")


async def test_a_restart_while_ranks_are_connected_orphans_the_job(
        tmp_path: Path, jobs: list[SimulatedJob], caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM mid-training (``systemctl restart`` for an upgrade): the ranks outlive the
    controller, so the marker stays and the next bridge reports the job."""
    state = tmp_path / "state"
    first = await started(jobs, state)
    assert orphaned(first) == 0
    await eventually(lambda: first.bridge is not None and first.bridge.controller.connected(), what="ranks connected")
    assert await stop(jobs, first) == 0
    assert (state / MARKER_NAME).exists()
    assert any("keeping the controller marker" in r.getMessage() for r in caplog.records)
    second = await started(jobs, state, connected_ranks=0)
    assert orphaned(second) == 1


async def test_a_stop_with_no_rank_connected_leaves_no_marker(tmp_path: Path, jobs: list[SimulatedJob]) -> None:
    state = tmp_path / "state"
    first = await started(jobs, state, connected_ranks=0)
    assert (state / MARKER_NAME).exists()
    assert await stop(jobs, first) == 0
    assert not (state / MARKER_NAME).exists()
    second = await started(jobs, state, connected_ranks=0)
    assert orphaned(second) == 0


async def test_kill_master_leaves_no_marker_although_ranks_are_connected(
        tmp_path: Path, jobs: list[SimulatedJob]) -> None:
    """killMaster: ClusterD reschedules the job, its ranks are going away."""
    state = tmp_path / "state"
    job = await started(jobs, state)
    await job.sim.kill_master(JOB)
    assert await job.wait_exit(15) == 75
    assert not (state / MARKER_NAME).exists()


async def test_a_second_restart_does_not_forget_the_orphaned_job(tmp_path: Path, jobs: list[SimulatedJob]) -> None:
    """While the suspicion stands no rank connects, so the HA switch alone would call the
    stop clean: the marker must stay anyway."""
    state = tmp_path / "state"
    crash_a_running_bridge(tmp_path, state)
    first = await started(jobs, state, connected_ranks=0)
    assert orphaned(first) == 1
    assert await stop(jobs, first) == 0
    assert (state / MARKER_NAME).exists()
    second = await started(jobs, state, connected_ranks=0)
    assert orphaned(second) == 1


# --------------------------------------------------------------------------- the usual teardown

#: The stub controller's heartbeat loss (real ~8 s) and the bridge's wait for it (real
#: 12 s), both shortened by the same factor.
HEARTBEAT_LOSS = 0.3
RANK_LOSS_WAIT = 1.5


async def teardown_job(jobs: list[SimulatedJob], state: Path, rank_loss_wait: float) -> SimulatedJob:
    job = await start_job(jobs, SimJob(JOB, world_size=8, devices_per_pod=4), heartbeat_loss=HEARTBEAT_LOSS,
                          config_overrides={"controller": {"state_directory": str(state),
                                                           "rank_loss_wait": rank_loss_wait}})
    await eventually(lambda: job.bridge is not None and job.bridge.controller.connected(), what="ranks connected")
    return job


async def test_the_usual_teardown_leaves_no_marker(tmp_path: Path, jobs: list[SimulatedJob],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The ranks are killed, then the bridge is stopped at once: the controller still
    counts them connected (its heartbeat loss has not run out), so the stop asks again
    until it no longer does, and removes the marker. The next bridge is not alarmed."""
    caplog.set_level(logging.INFO)
    state = tmp_path / "state"
    first = await teardown_job(jobs, state, RANK_LOSS_WAIT)
    first.training.disconnect_ranks(range(8))
    assert first.bridge is not None and first.bridge.controller.connected()  # the controller has not noticed yet
    assert await stop(jobs, first) == 0
    assert not (state / MARKER_NAME).exists()
    assert any("lost every training rank" in r.getMessage() for r in caplog.records)
    assert not any("keeping the controller marker" in r.getMessage() for r in caplog.records)
    second = await started(jobs, state, connected_ranks=0)
    assert orphaned(second) == 0
    assert not any(r.levelno == logging.CRITICAL for r in caplog.records)


async def test_without_the_wait_the_teardown_keeps_the_marker(tmp_path: Path, jobs: list[SimulatedJob]) -> None:
    """What the wait is for: stopped right after the kill, the controller still counts
    the ranks connected, and the marker of a job that ended stays behind."""
    state = tmp_path / "state"
    first = await teardown_job(jobs, state, 0.0)
    first.training.disconnect_ranks(range(8))
    assert await stop(jobs, first) == 0
    assert (state / MARKER_NAME).exists()


async def test_a_stop_while_the_ranks_train_on_waits_and_keeps_the_marker(
        tmp_path: Path, jobs: list[SimulatedJob]) -> None:
    state = tmp_path / "state"
    first = await teardown_job(jobs, state, RANK_LOSS_WAIT)
    started_at = time.monotonic()
    assert await stop(jobs, first) == 0
    assert time.monotonic() - started_at >= RANK_LOSS_WAIT  # the whole wait: the ranks stayed
    assert (state / MARKER_NAME).exists()


# --------------------------------------------------------------------------- stale markers

def place_marker(root: Path, job: str, pid: int, age_days: float, now: float, extra: str | None = None) -> Path:
    directory = root / job
    directory.mkdir(parents=True)
    path = directory / MARKER_NAME
    path.write_text(json.dumps({"job_id": job, "pid": pid, "address": "127.0.0.1:8000", "started_at": now}))
    stamp = now - age_days * 86_400
    os.utime(path, (stamp, stamp))
    if extra:
        (directory / extra).write_text("kept")
    return path


def a_dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid  # ended and reaped: no process has it (until the kernel reuses it)


def test_stale_markers_of_other_jobs_are_swept(tmp_path: Path) -> None:
    root, now, dead = tmp_path / "root", time.time(), a_dead_pid()
    own = place_marker(root, "own", dead, 30, now)
    gone = place_marker(root, "gone", dead, 8, now)
    gone_with_record = place_marker(root, "gone-recorded", dead, 8, now, extra="recorder.sqlite3")
    recent = place_marker(root, "recent", dead, 6, now)
    running = place_marker(root, "running", os.getpid(), 30, now)
    metrics = BridgeMetrics()
    removed = sweep_stale_markers(own.parent, metrics, now=now)
    assert sorted(removed) == sorted([gone, gone_with_record])
    assert not gone.parent.exists()  # emptied: its directory went too
    assert (gone_with_record.parent / "recorder.sqlite3").exists()  # a flight record stays
    assert own.exists() and recent.exists() and running.exists()
    assert STALE_MARKER_AGE == 7 * 86_400


async def test_a_bridge_with_the_default_state_layout_sweeps_at_start(
        tmp_path: Path, jobs: list[SimulatedJob], monkeypatch: pytest.MonkeyPatch) -> None:
    root, now = tmp_path / "root", time.time()
    gone = place_marker(root, "gone", a_dead_pid(), 8, now)
    monkeypatch.setenv("STATE_DIRECTORY", str(root / JOB))  # the unit's StateDirectory=tft-bridge/%i
    job = await start_job(jobs, SimJob(JOB, world_size=8, devices_per_pod=4), connected_ranks=0,
                          config_overrides={"controller": {"state_directory": ""}})
    assert not gone.exists()
    assert (root / JOB / MARKER_NAME).exists()
    await stop(jobs, job)


async def test_a_configured_state_directory_is_never_swept_around(
        tmp_path: Path, jobs: list[SimulatedJob]) -> None:
    root, now = tmp_path / "root", time.time()
    other = place_marker(root, "other", a_dead_pid(), 8, now)
    job = await started(jobs, root / JOB, connected_ranks=0)
    assert other.exists()
    await stop(jobs, job)
