"""Recover-in-place end to end: the node hook must restart exactly the fault ranks.

Under recover-in-place ClusterD does not widen a business report's fault to its pod: the
controller is told only the faulty rank, and its repair rebuilds exactly that rank from
a peer (docs/mindio-controller.md section 4). A node hook that restarts every process of
the named node -- all it could do when it got only the node ranks -- restarts ranks under
the repair that it was not told about, and the repair hangs; the shipped example hook,
given the fault ranks, restarts only those and the recovery succeeds. The stub controller
reproduces the hang (``training.repair_hang_ranks``); its own node agent is switched off
(``training.auto_restart``) so the hook is the only thing that restarts anything.

The hook is a real command run by the bridge; the processes it "restarts" are the stub's
simulated ranks, so it writes what it was asked to restart to a file and the test plays
the node by connecting exactly those ranks again.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bridge.sim.clusterd import SimJob
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually
from .simjobs import annotation, start_job

pytestmark = pytest.mark.timeout(90)

JOB = "job-in-place"
EXAMPLE = Path(__file__).resolve().parent.parent / "contrib" / "node-action"
FAULTY = 5  # pod 1 holds ranks 4-7


def appender(tmp_path: Path) -> tuple[str, Path]:
    """A command line that appends its arguments as one line to a file."""
    log = tmp_path / "restarts"
    script = tmp_path / "append.py"
    script.write_text("import sys\nopen(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + '\\n')\n")
    return f"{sys.executable} {script} {log}", log


async def in_place_job(clean_jobs: list[SimulatedJob], hook: list[str], report_timeout: float = 30.0) -> SimulatedJob:
    spec = SimJob(JOB, world_size=8, devices_per_pod=4, strategies=("recover-in-place", "recover", "dump"))
    job = await start_job(clean_jobs, spec, report_timeout=report_timeout,
                          config_overrides={"hooks": {"node_command": hook, "timeout": 30.0}})
    job.training.auto_restart = False  # only the hook restarts processes
    return job


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def test_the_example_hook_restarts_only_the_fault_rank_and_the_recovery_succeeds(
        clean_jobs: list[SimulatedJob], tmp_path: Path) -> None:
    run, log = appender(tmp_path)
    job = await in_place_job(clean_jobs, [sys.executable, str(EXAMPLE), "--restart-rank", f"{run} {{rank}}"])
    job.training.inject_fault({FAULTY: 1})
    await eventually(lambda: lines(log), 30, what="the hook asked to restart ranks")
    assert lines(log) == [str(FAULTY)]
    job.training.connect_ranks([int(rank) for rank in lines(log)])  # the node restarts what it was told
    await annotation(job, "recover-success", timeout=30)
    change = job.sim.journal.signals("changeStrategy", job_id=JOB)[0]
    assert (change.detail["changeStrategy"], change.detail["extraParams"]) == ("recover", "recover-in-place")
    assert [n.args[0] for n in job.training.notifies("on_global_rank")] == [{FAULTY: 1}]
    assert job.training.repair_hang_ranks == ()
    await eventually(lambda: job.metrics.sample("tft_bridge_hook_runs_total",
                                                {"hook": "fault_nodes_restart", "result": "ok"}) == 1,
                     10, what="the hook run counted once it exited")


async def test_a_hook_that_restarts_the_whole_pod_hangs_the_repair(clean_jobs: list[SimulatedJob],
                                                                   tmp_path: Path) -> None:
    """What a node-ranks-only hook (or MindCluster's pod-restarting node agent) does: the
    controller repairs rank 5 while ranks 4, 6 and 7 restart under it; no result comes,
    and ClusterD gives up when its report wait runs out."""
    run, log = appender(tmp_path)
    job = await in_place_job(clean_jobs, [*run.split(), "node"], report_timeout=3.0)  # gets "ACTION NODE..."
    job.training.inject_fault({FAULTY: 1})
    await eventually(lambda: lines(log), 30, what="the hook asked to restart nodes")
    assert lines(log) == ["node fault_nodes_restart 1"]
    job.training.restart_pods([FAULTY])  # every process of pod 1
    await eventually(lambda: job.training.repair_hang_ranks == (4, 6, 7), 20, what="the repair hanging")
    await job.sim.wait_for(lambda e: e.kind == "state" and e.name == "FaultClearState", timeout=20)
    assert job.sim.journal.rpcs("ReportRecoverStatus", job_id=JOB) == []
    assert not [e for e in job.sim.journal.select("annotation", job_id=JOB) if e.detail.get("value") == "recover-success"]
