"""The node service end to end with the real peers: the job's pods on the stand-in API
server, the bridge the service started hosting the real MindIO controller, real ranks
(the processor library, ``fake_rank.py``) dialling it, and a fault recovered through
the real ClusterD (``clusterd-harness``). Skips with one line when the peers are absent.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("kubernetes")

from bridge.platform.sim.apiserver import StandInApiServer  # noqa: E402
from bridge.sim.scenario import free_port  # noqa: E402

from .conftest import eventually_sync  # noqa: E402
from .nodesim import LoggedProcess, NodeRig, SimJob, SimJobs, rigs  # noqa: E402
from .processes import ROOT, reap  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def real_peers() -> Path | None:
    """$TFT_BRIDGE_REAL_PEERS, else the first shared/real-peers above the repository."""
    given = os.environ.get("TFT_BRIDGE_REAL_PEERS")
    candidates = [Path(given)] if given else [parent / "shared" / "real-peers" for parent in ROOT.parents]
    for path in candidates:
        if (path / "bin" / "clusterd-harness").is_file() and (path / "mindio" / "mindio_ttp").is_dir():
            return path
    return None


PEERS = real_peers()
needs_peers = pytest.mark.skipif(PEERS is None or sys.version_info[:2] != (3, 11),
                                 reason="the real peers (shared/real-peers, CPython 3.11) are not here")


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[tuple[str, str, str, LoggedProcess]]:
    """The real ClusterD for one job (2 pods x 2 devices): its address, control URL, job
    uid, and the process (its log in a file: a pipe nobody drains would stall ClusterD)."""
    assert PEERS is not None
    job_uid = "e2e-node-job-0001"
    ctl = f"127.0.0.1:{free_port()}"
    process = LoggedProcess([str(PEERS / "bin" / "clusterd-harness"), "-addr", "127.0.0.1:0", "-job-uid", job_uid,
                             "-nodes", "2", "-devs", "2", "-strategies", "retry,recover,dump", "-keepalive", "5",
                             "-ctl", ctl], tmp_path / "clusterd.log")
    try:
        process.wait_for("HARNESS listening", timeout=60)
        address = re.search(r"HARNESS listening (\S+)", process.log.read_text()).group(1)  # type: ignore[union-attr]
        yield address, f"http://{ctl}", job_uid, process
    finally:
        process.close()


def spawn_rank(rank: int, world: int, port: int, tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    assert PEERS is not None
    return subprocess.Popen([sys.executable, str(PEERS / "fake_rank.py"), str(rank), str(world), str(port)],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "MINDIO_PKG_DIR": str(PEERS / "mindio"), "STEP_SLEEP": "0.3",
                                 "TIMELINE": str(tmp_path / f"rank{rank}.jsonl"), **env})


def timeline(tmp_path: Path, rank: int) -> list[dict]:
    path = tmp_path / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@needs_peers
def test_a_fault_is_recovered_through_the_real_clusterd_by_the_bridge_the_node_started(
        tmp_path: Path, harness: tuple[str, str, str, LoggedProcess]) -> None:
    assert PEERS is not None
    address, ctl, job_uid, clusterd = harness
    job = SimJob("e2e-job", uid=job_uid, pods=2, devices_per_pod=2, ttp_port=free_port())
    world = 4
    ranks: list[subprocess.Popen[str]] = []
    with StandInApiServer() as server, rigs(NodeRig(server, tmp_path / "state", address,
                                                    module="mindio_ttp.controller_ttp", keepalive=5.0,
                                                    env={"PYTHONPATH": f"{ROOT}:{PEERS / 'mindio'}"})) as (rig,):
        try:
            rig.start()
            SimJobs(server.store, {"node-1": "127.0.0.1"}).create(job)
            rig.wait_running(job)
            assert rig.bridge_config(job)["controller"]["module"] == "mindio_ttp.controller_ttp"
            clusterd.wait_for("receive Subscribe signal request", timeout=60)
            # The bridge counts itself subscribed at ClusterD's first keep-alive (up to 5 s later):
            # ranks start then, so the fault is not reported on a stream still opening.
            eventually_sync(lambda: rig.scrape().get("tft_bridge_subscription_up", {}).get((("job", job_uid),)),
                            30, "the bridge subscribed")
            ranks = [spawn_rank(r, world, job.ttp_port, tmp_path, **({"FAULT_RANK": "1", "FAULT_STEP": "6",
                                                                     "FAULT_KIND": "uce"}))
                     for r in range(world)]
            eventually_sync(lambda: any(e["kind"] == "fault_inject" for e in timeline(tmp_path, 1)), 60,
                            "rank 1's UCE")
            eventually_sync(lambda: all(any(e["kind"] == "resumed" for e in timeline(tmp_path, r))
                                        for r in range(world)), 120, "every rank resumed after the recovery")
            clusterd.wait_for("receive ReportProcessFault", timeout=30)

            def recovered() -> float:
                series = rig.scrape().get("tft_bridge_recovery_cycles_total", {})
                return sum(v for labels, v in series.items() if dict(labels).get("outcome") == "success")

            eventually_sync(recovered, 60, "a successful cycle on the node's metrics endpoint")
            with urllib.request.urlopen(f"{ctl}/state", timeout=5) as response:
                state = json.loads(response.read())
            assert "ProcessRecoverStatus" in json.dumps(state)
            for rank in ranks:
                rank.kill()
            SimJobs(server.store, {"node-1": "127.0.0.1"}).delete(job)
            rig.wait_stopped(job, timeout=90)
            assert not (rig.job_dir(job) / "controller.json").exists(), rig.log(job)[-3000:]
        finally:
            for rank in ranks:
                reap(rank)
