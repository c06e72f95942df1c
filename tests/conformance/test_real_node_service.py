"""The node service end to end with the real peers: the job's pods on the stand-in API
server, the bridge the service started hosting the real MindIO controller, real ranks
(the processor library, ``fake_rank.py``) dialling it, and a fault recovered through
the real ClusterD (``clusterd-harness``). Skipped, in one line, like the rest of the
tier (tests/conformance/tier.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .tier import skip_unless_the_tier_runs_here

skip_unless_the_tier_runs_here()
pytest.importorskip("kubernetes")

from bridge.sim.kube.apiserver import StandInApiServer  # noqa: E402
from bridge.core.listen_ports import free_port  # noqa: E402

from ..conftest import eventually_sync  # noqa: E402
from ..nodesim import NodeRig, SimJob, SimJobs, rigs  # noqa: E402
from ..processes import ROOT  # noqa: E402
from .peers import ClusterDHarness, HarnessOptions, Ranks, find_real_peers, kill_all_on_sigterm  # noqa: E402

pytestmark = [pytest.mark.real_peers, pytest.mark.timeout(240)]

JOB_UID = "e2e-node-job-0001"


@pytest.fixture
def clusterd(peer_logs: Path) -> Iterator[ClusterDHarness]:
    """The real ClusterD for one job (2 pods x 2 devices), keep-alives every 5 s."""
    peers = find_real_peers()
    assert peers is not None
    kill_all_on_sigterm()
    harness = ClusterDHarness(peers, HarnessOptions(job_uid=JOB_UID, keepalive=5), peer_logs)
    try:
        yield harness.start(timeout=60)
    finally:
        harness.stop()


def test_a_fault_is_recovered_through_the_real_clusterd_by_the_bridge_the_node_started(
        tmp_path: Path, peer_logs: Path, clusterd: ClusterDHarness) -> None:
    peers = find_real_peers()
    assert peers is not None
    job = SimJob("e2e-job", uid=JOB_UID, pods=2, devices_per_pod=2, ttp_port=free_port())
    ranks = Ranks(peers, clusterd.options.world_size, job.ttp_port, peer_logs, step_sleep=0.3)
    with StandInApiServer() as server, rigs(NodeRig(server, tmp_path / "state", clusterd.address,
                                                    module="mindio_ttp.controller_ttp", keepalive=5.0,
                                                    env={"PYTHONPATH": f"{ROOT}:{peers / 'mindio'}"})) as (rig,):
        try:
            rig.start()
            SimJobs(server.store, {"node-1": "127.0.0.1"}).create(job)
            rig.wait_running(job)
            assert rig.bridge_config(job)["controller"]["module"] == "mindio_ttp.controller_ttp"
            clusterd.wait_log("receive Subscribe signal request", timeout=60)
            # The bridge counts itself subscribed at ClusterD's first keep-alive (up to 5 s later):
            # ranks start then, so the fault is not reported on a stream still opening.
            eventually_sync(lambda: rig.scrape().get("tft_bridge_subscription_up", {}).get((("job", JOB_UID),)),
                            30, "the bridge subscribed")
            ranks.start(fault_rank=1, fault_step=6, fault_kind="uce")
            eventually_sync(lambda: ranks.events("fault_inject", 1), 60, "rank 1's UCE")
            eventually_sync(lambda: _all_training_again(ranks), 120, "every rank training again after the recovery")
            clusterd.wait_log("receive ReportProcessFault", timeout=30)

            def recovered() -> float:
                series = rig.scrape().get("tft_bridge_recovery_cycles_total", {})
                return sum(v for labels, v in series.items() if dict(labels).get("outcome") == "success")

            eventually_sync(recovered, 60, "a successful cycle on the node's metrics endpoint")
            assert clusterd.annotation("ProcessRecoverStatus"), clusterd.state()
            ranks.kill(range(ranks.world_size))
            SimJobs(server.store, {"node-1": "127.0.0.1"}).delete(job)
            rig.wait_stopped(job, timeout=90)
            assert not (rig.job_dir(job) / "controller.json").exists(), rig.log(job)[-3000:]
        except BaseException:
            # The bridge's log lives in the node's state folder (a short path, for its
            # sockets); the peers' logs are already in ``peer_logs``.
            try:
                bridge_log = rig.log(job)
                (peer_logs / "bridge.log").write_text(bridge_log, encoding="utf-8")
                print(f"logs in {peer_logs}; ranks' events: "
                      f"{[(e.get('src'), e.get('kind')) for e in ranks.timeline()]}\n"
                      f"the bridge's log, its end:\n{bridge_log[-4000:]}\nClusterD's state: {clusterd.state()}")
            except Exception as error:  # noqa: BLE001 - a diagnostic must not hide the failure
                print(f"(diagnostics incomplete: {error!r})")
            raise
        finally:
            ranks.close()


def _all_training_again(ranks: Ranks) -> bool:
    """Every rank logged ``resumed``, or took a training step after its rollback. In one
    CI run a rank's ``resumed`` line was missing from the shared timeline while it went
    on stepping after its rollback with the others: the step is the proof that counts.
    One read of the timeline a poll."""
    kinds: dict[str, list[str]] = {}
    for event in ranks.timeline():
        kinds.setdefault(event.get("src", ""), []).append(event.get("kind", ""))
    return all(_training_again(kinds.get(f"rank{rank}", [])) for rank in range(ranks.world_size))


def _training_again(kinds: list[str]) -> bool:
    if "resumed" in kinds:
        return True
    rollbacks = [index for index, kind in enumerate(kinds) if kind == "cb_rollback"]
    return bool(rollbacks) and "step" in kinds[rollbacks[-1] + 1:]
