"""The rank table subscription against the simulated ClusterD's config.Config service."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from bridge.core.config import ClusterDConfig, RankTableConfig
from bridge.job.metrics import BridgeMetrics
from bridge.job.session.rank_table import RankTableSubscriber
from bridge.sim.clusterd import SimClusterD, SimJob

from .conftest import eventually
from .test_ranktable_validation import V10, V12

pytestmark = pytest.mark.timeout(30)
RT_JOB = "mindie-7"


@pytest.fixture
async def sim() -> AsyncIterator[SimClusterD]:
    server = SimClusterD([SimJob("uid-1", rank_table_job_id=RT_JOB)], rank_table_delay=0.01)
    await server.start()
    yield server
    await server.stop()


@asynccontextmanager
async def running(sim: SimClusterD, path: Path, metrics: BridgeMetrics,
                  hook: tuple[str, ...] = ()) -> AsyncIterator[RankTableSubscriber]:
    """A subscriber, subscribed; stopped (and its task awaited) on exit."""
    assert sim.address is not None
    subscriber = RankTableSubscriber(
        RankTableConfig(enabled=True, job_id=RT_JOB, path=str(path), hook_command=hook),
        ClusterDConfig(address=sim.address, reconnect_initial=0.02, reconnect_max=0.2), metrics)
    task = asyncio.create_task(subscriber.run())
    try:
        await sim.wait_for(lambda e: e.kind == "stream-open" and e.name == "SubscribeRankTable", timeout=5)
        yield subscriber
    finally:
        subscriber.stop()
        await task


def updates(metrics: BridgeMetrics, result: str) -> float:
    return metrics.sample("tft_bridge_ranktable_updates_total", {"result": result})


async def test_tables_of_both_versions_land_atomically_and_only_on_change(sim: SimClusterD, tmp_path: Path) -> None:
    path = tmp_path / "ranktable.json"
    metrics = BridgeMetrics()
    async with running(sim, path, metrics):
        await sim.push_rank_table(RT_JOB, json.dumps(V10))
        # the counter moves once the writer thread is done: wait for it, not for the file
        await eventually(lambda: updates(metrics, "written") == 1, what="the first table written")
        assert json.loads(path.read_text()) == V10
        await sim.push_rank_table(RT_JOB, json.dumps(V10, indent=1))  # the same table again, other spacing
        await eventually(lambda: updates(metrics, "unchanged") >= 1, what="the same table seen as unchanged")
        await sim.push_rank_table(RT_JOB, json.dumps(V12))
        await eventually(lambda: updates(metrics, "written") == 2, what="the changed table written")
        assert json.loads(path.read_text()) == V12
        assert oct(path.stat().st_mode & 0o777) == "0o640"


@pytest.mark.parametrize("bad", ["{garbage", json.dumps({**V10, "status": "pending"}),
                                 json.dumps({k: v for k, v in V10.items() if k != "server_group_list"})])
async def test_bad_tables_never_replace_the_good_one(sim: SimClusterD, tmp_path: Path, bad: str) -> None:
    path = tmp_path / "ranktable.json"
    metrics = BridgeMetrics()
    async with running(sim, path, metrics):
        await sim.push_rank_table(RT_JOB, json.dumps(V10))
        await eventually(lambda: updates(metrics, "written") == 1, what="the good table written")
        await sim.push_rank_table(RT_JOB, bad)
        await eventually(lambda: updates(metrics, "rejected") >= 1, what="the bad table rejected")
        assert json.loads(path.read_text()) == V10
        assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "rank_table"}) == updates(metrics, "rejected")


async def test_a_table_for_another_job_is_rejected(sim: SimClusterD, tmp_path: Path) -> None:
    path = tmp_path / "ranktable.json"
    metrics = BridgeMetrics()
    async with running(sim, path, metrics) as subscriber:
        from bridge._proto import config_pb2

        assert await subscriber.handle(config_pb2.RankTableStream(jobId="someone-else", rankTable=json.dumps(V10))) \
            == "rejected"
        assert not path.exists()


async def test_a_second_register_ends_the_stream_and_we_register_again(sim: SimClusterD, tmp_path: Path) -> None:
    path = tmp_path / "ranktable.json"
    metrics = BridgeMetrics()
    async with running(sim, path, metrics):
        first = len(sim.journal.select(kind="stream-open", name="SubscribeRankTable"))
        assert sim.address is not None
        import grpc

        from bridge._proto import config_pb2, config_pb2_grpc

        async with grpc.aio.insecure_channel(sim.address) as channel:  # another client registers the job
            await config_pb2_grpc.ConfigStub(channel).Register(config_pb2.ClientInfo(jobId=RT_JOB, role="intruder"))
        await sim.wait_for(lambda e: e.kind == "stream-end" and e.name == "SubscribeRankTable", timeout=5)
        await eventually(lambda: len(sim.journal.select(kind="stream-open", name="SubscribeRankTable")) > first)
        roles = [e.detail.get("role") for e in sim.journal.rpcs("config.Register")]
        assert roles[:2] == ["tft-bridge", "intruder"] and "tft-bridge" in roles[2:]  # registered again
        changed = copy.deepcopy(V12)
        await sim.push_rank_table(RT_JOB, json.dumps(changed))
        await eventually(lambda: path.exists() and json.loads(path.read_text()) == V12)


async def test_hook_runs_on_change(sim: SimClusterD, tmp_path: Path) -> None:
    path = tmp_path / "ranktable.json"
    marker = tmp_path / "hook-ran"
    metrics = BridgeMetrics()
    async with running(sim, path, metrics, hook=("/bin/sh", "-c", f'echo "$1 $2" > {marker}', "hook")):
        await sim.push_rank_table(RT_JOB, json.dumps(V10))
        # the shell creates the file before echo writes it: wait for the hook to finish
        await eventually(lambda: metrics.sample("tft_bridge_hook_runs_total", {"hook": "ranktable_changed", "result": "ok"}) == 1)
        assert marker.read_text().split() == ["ranktable_changed", str(path)]


async def test_run_keeps_the_rank_table_file_current(tmp_path: Path) -> None:
    from bridge.sim.mindio_ttp import FAST_TIMINGS
    from bridge.sim.scenario import SimulatedJob

    path = tmp_path / "rt.json"
    job = SimulatedJob(SimJob("uid-2", rank_table_job_id=RT_JOB), controller_timings=FAST_TIMINGS,
                       config_overrides={"ranktable": {"enabled": True, "job_id": RT_JOB, "path": str(path)}})
    async with job:
        await job.sim.wait_for(lambda e: e.kind == "stream-open" and e.name == "SubscribeRankTable", timeout=5)
        await job.sim.push_rank_table("uid-2", json.dumps(V12))
        await eventually(lambda: updates(job.metrics, "written") == 1, what="the table written")
        assert json.loads(path.read_text()) == V12
