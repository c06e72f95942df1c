"""The cause of a fault in its record, on the real peers: an NPU fault reported through
ClusterD's device info (the harness's ``POST /fault/device``), the rank on that NPU dies,
the job recovers, and ``tft-bridge history`` names the node, the NPU, the fault code and
its level as ClusterD's Fault service published them. ClusterD v7.3.2 (its harness)
serves no Fault service: the record says so. A launcher on the seed API, which keeps no
recorder, logs the same cause."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import eventually_sync
from ..processes import ROOT
from .peers import BridgeDaemon, HarnessOptions, find_real_peers
from .realjob import RealJob
from .tier import skip_unless_the_tier_runs_here

skip_unless_the_tier_runs_here()

pytestmark = [pytest.mark.real_peers, pytest.mark.timeout(300)]


def history(directory: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "bridge.cli", "history", "--state-dir", str(directory), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize(("release", "cause"), [
    ("master", "cause     ClusterD: node-1 NPU 0: 80C98000 (RestartNPU)"),
    ("7.3.2", "cause     ClusterD: not available (this ClusterD release does not serve its Fault service)"),
])
def test_history_names_the_npu_and_fault_code_of_a_recovered_fault(peer_logs: Path, release: str, cause: str) -> None:
    peers = find_real_peers()
    assert peers is not None
    with RealJob(peers, peer_logs, "daemon", HarnessOptions(release=release)) as job:
        try:
            job.start()
            assert isinstance(job.entry, BridgeDaemon)
            job.clusterd.post("/fault/device", rank=2)  # rank 2: node-1, NPU 0 (2 devices per node)
            job.ranks.kill([2])  # the process on the failed NPU dies; the controller reports it
            job.clusterd.wait_annotation("ProcessRecoverStatus", lambda v: v == "recover-success", 120)
            cycle = eventually_sync(lambda: next((c for c in job.entry.cycles()  # type: ignore[attr-defined]
                                                  if c.get("outcome") == "success"), None), 60,
                                    "the recovered cycle in the flight recorder")
            text = history(job.entry.recorder_dir, "--cycle", cycle["key"])  # type: ignore[attr-defined]
            assert cause in text, text
        except Exception:
            print(job.dump())
            raise


def test_a_seed_api_launcher_logs_the_npu_and_fault_code_before_the_recovery(peer_logs: Path) -> None:
    """The seed API keeps no flight recorder: the cause, as ClusterD's Fault service
    published it, is in the launcher's log, before the recovery the fault causes."""
    peers = find_real_peers()
    assert peers is not None
    with RealJob(peers, peer_logs, "seed") as job:
        try:
            job.start()
            mark = job.entry.log.mark()
            job.clusterd.post("/fault/device", rank=2)  # rank 2: node-1, NPU 0 (2 devices per node)
            cause = re.escape(f"ClusterD's fault centre for job {job.options.job_uid}: node-1 NPU 0: 80C98000 "
                              "(RestartNPU)")
            ((at, _),) = eventually_sync(lambda: job.entry.log.find(cause, mark)[:1], 60, "the cause logged")
            job.ranks.kill([2])  # the process on the failed NPU dies; the controller reports it
            job.clusterd.wait_annotation("ProcessRecoverStatus", lambda v: v == "recover-success", 120)
            callbacks = [i for i, _ in job.entry.log.find(r"^LAUNCHER .*\"report_fault_ranks\"", mark)]
            assert callbacks and at < callbacks[0]  # logged before the controller reported the rank
        except Exception:
            print(job.dump())
            raise
