"""What the node service keeps on disk: a finished job's directory is removed after
``node.retention`` and not before, never while its job has a bridge or a pod in view; a
session bridge's ``bridge.log`` is set aside past its limit at a start."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bridge.node.config import build_node_config
from bridge.node.launcher import Record, rotate_log
from bridge.node.metrics import NodeMetrics
from bridge.node.service import NodeService, Served

DAY = 86400.0


class NoApi:
    """The service's API is never called by a sweep."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the sweep called the API ({name})")


class Running:
    def __init__(self, record: Record) -> None:
        self.record = record

    def poll(self) -> int | None:
        return None

    def terminate(self) -> None:
        raise AssertionError("the sweep stopped a bridge")


def job_dir(root: Path, name: str, age: float) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    for file in ("bridge.toml", "exit.json", "recorder.sqlite3"):
        (directory / file).write_text("x")
        os.utime(directory / file, (time.time() - age, time.time() - age))
    return directory


def test_finished_jobs_directories_go_after_the_retention_and_no_other(tmp_path: Path) -> None:
    root = tmp_path / "state"
    config = build_node_config({"node": {"state_root": str(root), "retention": 2 * DAY}})
    service = NodeService(config, NoApi(), None, NodeMetrics(), bridge_argv=lambda path: [])  # type: ignore[arg-type]
    try:
        old = job_dir(root, "old-job", 3 * DAY)
        young = job_dir(root, "young-job", 1 * DAY)
        running = job_dir(root, "running-job", 9 * DAY)
        in_view = job_dir(root, "refused-job", 9 * DAY)
        recent_write = job_dir(root, "post-mortem", 9 * DAY)
        (recent_write / "history.txt").write_text("read an hour ago")  # one newer file keeps it
        record = Record(job_id="running-job", pod_uid="p", namespace="ns", pod_name="p-0", bind_ip="127.0.0.1",
                        port=1, metrics_port=2, launcher="session")
        service.jobs["running-job"] = Served(None, record, running, Running(record))
        removed = service.sweep({"refused-job"}, time.time())
        assert removed == [old]
        assert not old.exists() and young.exists() and running.exists() and in_view.exists() and recent_write.exists()
    finally:
        service.events.stop()


def test_a_retention_of_zero_keeps_everything(tmp_path: Path) -> None:
    root = tmp_path / "state"
    config = build_node_config({"node": {"state_root": str(root), "retention": 0}})
    assert config.node.retention == 0.0
    service = NodeService(config, NoApi(), None, NodeMetrics(), bridge_argv=lambda path: [])  # type: ignore[arg-type]
    try:
        old = job_dir(root, "old-job", 300 * DAY)
        service.reconcile()  # a pass with retention 0 sweeps nothing
        assert old.exists()
    finally:
        service.events.stop()


def test_a_bridge_log_past_its_limit_is_set_aside_at_a_start(tmp_path: Path) -> None:
    log = tmp_path / "bridge.log"
    rotate_log(log, limit=10)  # none yet: nothing to do
    log.write_text("0123456789")
    rotate_log(log, limit=10)
    assert log.exists()  # at the limit: kept
    log.write_text("first run, too long")
    (tmp_path / "bridge.log.1").write_text("the run before")
    rotate_log(log, limit=10)
    assert not log.exists() and (tmp_path / "bridge.log.1").read_text() == "first run, too long"
