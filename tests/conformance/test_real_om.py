"""ClusterD's operator stress test on the real peers: the bridge declines it at once and
training resumes (before, ClusterD waited in NotifyStressTestState with training paused),
on both entry points: the daemon and a launcher on the seed API.

A NIC switch cannot run here: the harness's nodes have no super pod and ClusterD refuses
it (``node:... should operate in superPodID``, 413); tests/test_om.py runs it on the
simulation, and this file checks the refusal is the real server's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ..conftest import eventually_sync
from ..om_operator import Operator
from .peers import HarnessOptions, find_real_peers
from .realjob import RealJob
from .tier import skip_unless_the_tier_runs_here

skip_unless_the_tier_runs_here()

pytestmark = [pytest.mark.real_peers, pytest.mark.timeout(240)]


def last_step(job: RealJob) -> int:
    return max((int(e.get("step", 0)) for e in job.ranks.events("step")), default=-1)


async def operate(address: str, job_id: str) -> tuple[int, str]:
    async with Operator(address) as operator:
        status = await operator.stress_test(job_id, [0])
        outcome = await operator.response(job_id, "stress_test", timeout=60) if status.code == 0 else status.info
        return status.code, outcome


@pytest.mark.parametrize(("entry", "release"), [("daemon", "master"), ("daemon", "7.3.2"), ("seed", "master")])
def test_stress_test_is_declined_and_training_resumes(peer_logs: Path, entry: str, release: str) -> None:
    peers = find_real_peers()
    assert peers is not None
    with RealJob(peers, peer_logs, entry, HarnessOptions(release=release)) as job:
        try:
            job.start()
            eventually_sync(lambda: last_step(job) >= 5, 60, "training under way")
            mark = job.clusterd.log.mark()
            code, outcome = asyncio.run(operate(job.clusterd.address, job.options.job_uid))
            assert code == 0, outcome
            # the bridge answered "exec failed" for every rank, ClusterD told the operator
            assert outcome.startswith("stress test finish"), outcome
            assert "exec failed" in outcome
            job.clusterd.wait_log("stress test result", mark, 30, "ReplyStressTestResult at ClusterD")
            path = eventually_sync(lambda: next((p for p in job.clusterd.cycle_paths(mark) if "startStressTest" in p),
                                                None), 60, "the OM cycle closing")
            assert "WaitStressTestFinishedState(receiveReport)" in path and path.endswith("-->INIT"), path
            assert "NotifyStopTrainState" not in path  # nothing isolated, nothing recovered
            # training goes on after the stress test
            resumed_from = last_step(job)
            eventually_sync(lambda: last_step(job) >= resumed_from + 10, 60, "training resumed after the stress test")
            assert job.entry.exit_code() is None
            assert job.entry.log.find("stress-test ranks")  # the bridge's log line
        except Exception:
            print(job.dump())
            raise


def test_nic_switch_is_refused_without_a_super_pod(peer_logs: Path) -> None:
    """The real server's refusal, mirrored by the simulation's ``SimJob.super_pod_id < 0``;
    nothing is paused."""
    peers = find_real_peers()
    assert peers is not None
    with RealJob(peers, peer_logs, "daemon") as job:
        job.start()

        async def switch() -> tuple[int, str]:
            async with Operator(job.clusterd.address) as operator:
                status = await operator.switch_nic(job.options.job_uid, {"node-1": [("0", True)]})
                return status.code, status.info

        # Until the fault centre has read the nodes' device info it answers "not exist"
        # (checkNicsParam looks there after the rank table): poll for the verdict.
        refusal = (413, "node:node-1 should operate in superPodID")
        answer = eventually_sync(lambda: (a := asyncio.run(switch())) == refusal and a, 30, "the super-pod refusal")
        assert answer == refusal
