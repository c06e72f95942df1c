"""The simulations answer to the real peers: each scenario on both, the transcripts compared.

Every scenario of tests/conformance/differential.py runs on the real peers (ClusterD's
service code in the harness, a real MindIO TFT build hosted by ``tft-bridge run``, fake
ranks, the node agent) and, side by side in the same test, on the simulated ClusterD of
the same release and the stub controller; the two transcripts must agree on ClusterD's
RPCs, signals, outcome and cycle paths, the controller's callbacks and notifies, the
bridge's own record and the exit code. A difference fails with both transcripts printed.
The release matrix: the scenarios marked for v7.3.2 run on its harness against the
simulation's ``7.3`` profile. Where they differ, the real peer is right: fix the
simulation (docs/testing.md, "The differential").

Skipped, in one line, like the rest of the tier (tests/conformance/test_real_peers.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from .differential import Scenario, cases, differences, report, run_real, run_sim
from .peers import find_real_peers, kill_all_on_sigterm
from .tier import skip_unless_the_tier_runs_here

skip_unless_the_tier_runs_here()

pytestmark = [pytest.mark.real_peers, pytest.mark.timeout(400)]


@pytest.mark.parametrize(("scenario", "release"), cases(), ids=[f"{s.name}-{r}" for s, r in cases()])
async def test_sim_matches_real(scenario: Scenario, release: str, peer_logs: Path) -> None:
    peers = find_real_peers()
    assert peers is not None
    kill_all_on_sigterm()  # CI's budget stops this process with SIGTERM: the peers go with it
    workdir = peer_logs
    for side in ("real", "sim"):
        (workdir / side).mkdir(parents=True, exist_ok=True)
    # Side by side: the real run in a thread (it waits on child processes and their
    # logs), the simulated one on this loop.
    real_run = asyncio.ensure_future(asyncio.to_thread(run_real, scenario, release, peers, workdir / "real"))
    try:
        sim = await run_sim(scenario, release, workdir / "sim")
    finally:
        real = await real_run
    found = differences(real, sim, outage=scenario.clusterd_outage > 0)
    assert not found, report(scenario, release, real, sim, found) + f"\nlogs in {workdir}"
