"""The orphaned job: a bridge restart while the job keeps running.

The real controller cannot adopt running ranks (a controller started again on the same
address rejects every heartbeat of ranks it did not start), so after a crash, an OOM
kill or a restart mid-training the job trains on with no fault tolerance and hangs at
its next fault. Before the fix nothing showed it. Now the marker a controller's start
writes (bridge/orphan.py) survives such an end, and the next bridge says so -- CRITICAL
log, ``tft_bridge_orphaned_job`` = 1, STATUS= -- until a rank connects to its own
controller (the job was restarted).
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from typing import Any

import pytest

from bridge.metrics import BridgeMetrics
from bridge.orphan import MARKER_NAME, ControllerMarker, OrphanWatch
from bridge.state import state_directory
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
    caplog.set_level(logging.INFO, logger="bridge.orphan")
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
