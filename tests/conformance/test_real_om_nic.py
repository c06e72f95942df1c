"""A NIC switch through the bridge on the real peers, with nodes in a super pod.

The shipped harness's nodes have no super pod, so ClusterD refuses a NIC switch there
(tests/conformance/test_real_om.py). This runs only with a harness whose nodes' device
info names a super pod (a ``-super-pod ID`` flag the shipped harness does not have yet),
named by ``TFT_BRIDGE_SUPERPOD_HARNESS``: the bridge declines the
switch at once (``result`` false) and ClusterD takes its failure path, a recovery cycle
with no fault ranks, which the job's strategies decide (docs/clusterd.md section 12).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..conftest import eventually_sync
from ..om_operator import Operator
from .peers import HarnessOptions, find_real_peers
from .realjob import RealJob
from .tier import skip_unless_the_tier_runs_here

skip_unless_the_tier_runs_here()

BINARY = os.environ.get("TFT_BRIDGE_SUPERPOD_HARNESS", "")
pytestmark = [pytest.mark.real_peers, pytest.mark.timeout(300),
              pytest.mark.skipif(not Path(BINARY).is_file(),
                                 reason="TFT_BRIDGE_SUPERPOD_HARNESS names no harness built with -super-pod")]


@dataclass
class SuperPodOptions(HarnessOptions):
    def argv(self, binary: Path, port: int, ctl_port: int) -> list[str]:
        return [*super().argv(binary, port, ctl_port), "-super-pod", "0"]


def last_step(job: RealJob) -> int:
    return max((int(e.get("step", 0)) for e in job.ranks.events("step")), default=-1)


@pytest.mark.parametrize(("strategies", "verdict"), [("recover,dump", None), ("retry,recover,dump", "dump-success")])
def test_nic_switch_is_declined_and_clusterd_takes_its_failure_path(peer_logs: Path, strategies: str,
                                                                    verdict: str | None) -> None:
    """With retry configured ClusterD dumps the job (it exits, to be restarted); without,
    it chooses recover and the controller's repair of no ranks waits for new workers that
    never come (measured; the simulation does the same)."""
    peers = find_real_peers()
    assert peers is not None
    with RealJob(peers, peer_logs, "daemon", SuperPodOptions(strategies=strategies)) as job:
        job.clusterd.binary = Path(BINARY)
        try:
            job.start()
            eventually_sync(lambda: last_step(job) >= 5, 60, "training under way")
            mark = job.clusterd.log.mark()

            async def switch() -> tuple[int, str, str]:
                async with Operator(job.clusterd.address) as operator:
                    status = await operator.switch_nic(job.options.job_uid, {"node-1": [("0", True)]})
                    if status.code != 0:
                        return status.code, status.info, ""
                    return status.code, status.info, await operator.response(job.options.job_uid, "switch_nic", 60)

            # the fault centre reads the nodes' device info shortly after start: until then "not exist"
            code, info, outcome = eventually_sync(lambda: (r := asyncio.run(switch()))[0] == 0 and r, 30,
                                                  "ClusterD accepting the switch")
            assert outcome == "switch nic failed, switch nic failed", (code, info, outcome)
            job.clusterd.wait_log("nic swtich result: false", mark, 30, "the declined switch at ClusterD")
            if verdict is None:
                job.clusterd.wait_log("choose strategy:recover", mark, 60, "recover chosen")
                job.entry.log.wait_for("arf wait new workers register", 0, 30, "the repair of no ranks waiting")
                assert job.clusterd.annotation("ProcessRecoverStatus") is None
            else:
                job.clusterd.wait_annotation("ProcessRecoverStatus", lambda v: v == verdict, 120)
                assert job.entry.wait_exit(60) == 76  # the controller was told to exit: restarted by its unit
            _, path = job.clusterd.log.find(r"action path = \{(INIT\(startSwitchNic\).*)\}", mark)[-1]
            assert "WaitSwitchNicFinishedState(switchNicFail)-->NotifyStopTrainState" in path.group(1)
        except Exception:
            print(job.dump())
            raise
