"""``tft-bridge report-fault`` on the real peers: a node agent that sees a training
process die hands its rank to the bridge, which reports it to ClusterD at once, before
the controller notices the lost heartbeats (about 8 s), and the job recovers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..processes import ROOT
from .peers import BridgeDaemon, find_real_peers
from .realjob import RealJob
from .tier import skip_unless_the_tier_runs_here

skip_unless_the_tier_runs_here()

pytestmark = [pytest.mark.real_peers, pytest.mark.timeout(300)]


def report_fault(config: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bridge.cli", "report-fault", "--config", str(config),
                           "--state-dir", str(state), *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def daemon_job(peers: Path, logs: Path, short: Path) -> tuple[RealJob, Path]:
    """A job on ``tft-bridge run``, its logs in ``logs``, whose state directory (the
    socket's home, as systemd passes it) is under ``short``: a unix socket's path has at
    most 107 bytes."""
    job = RealJob(peers, logs, "daemon")
    assert isinstance(job.entry, BridgeDaemon)
    job.entry.state_directory = state = short / "s"
    return job, state


def test_a_rank_handed_to_the_bridge_is_recovered(tmp_path: Path, peer_logs: Path) -> None:
    peers = find_real_peers()
    assert peers is not None
    job, state = daemon_job(peers, peer_logs, tmp_path)
    with job:
        try:
            job.start()
            assert isinstance(job.entry, BridgeDaemon)
            config = job.entry.config_path
            refused = report_fault(config, state, "--job-id", "another-job", "2:1")
            assert refused.returncode == 3 and "this bridge serves job" in refused.stderr, refused.stderr
            mark = job.clusterd.log.mark()
            job.ranks.kill([2])
            killed = time.monotonic()
            done = report_fault(config, state, "2:1")
            assert done.returncode == 0, done.stderr
            assert "handed to the bridge of job conformance-job-1: 2:1" in done.stdout
            index, _ = job.clusterd.wait_log("receive ReportProcessFault", mark, 10, "the fault at ClusterD")
            assert job.clusterd.log.lines()[index].at - killed < 5.0  # not the controller's ~8 s heartbeat loss
            job.clusterd.wait_annotation("ProcessRecoverStatus", lambda v: v == "recover-success", 120)
            assert job.entry.exit_code() is None
        except Exception:
            print(job.dump())
            raise


def test_a_rank_that_dies_while_a_recovery_waits_is_recovered_with_it(tmp_path: Path, peer_logs: Path) -> None:
    """The case the controller never reports (docs/mindio-controller.md): a rank that
    dies after the stop-complete of a recovery. Handed over, it reaches ClusterD before its
    globalFault, which then names its pod too, and the node agent restarts both pods."""
    peers = find_real_peers()
    assert peers is not None
    job, state = daemon_job(peers, peer_logs, tmp_path)
    with job:
        try:
            job.start()
            mark = job.clusterd.log.mark()
            job.ranks.kill([0])  # the first fault: pod 0
            job.clusterd.wait_log("receive ReportStopComplete", mark, 60, "the cycle's stop-complete")
            job.ranks.kill([3])  # dies while the controller waits for ClusterD's globalFault
            done = report_fault(job.entry.config_path, state, "3:1")  # type: ignore[attr-defined]
            assert done.returncode == 0, done.stderr
            job.clusterd.wait_annotation("ProcessRecoverStatus", lambda v: v == "recover-success", 120)
            assert [0, 1, 2, 3] in job.clusterd.fault_lists(mark)  # both pods restarted
        except Exception:
            print(job.dump())
            raise
