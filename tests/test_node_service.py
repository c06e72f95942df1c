"""``tft-bridge node`` on the stand-in API server, driven by the real ``kubernetes``
client: jobs' pods appear, move and go; the service starts, adopts and stops their
bridges (real ``tft-bridge run`` processes with the stub controller)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("kubernetes")

from bridge.platform.sim.apiserver import StandInApiServer  # noqa: E402
from bridge.sim.scenario import free_port  # noqa: E402

from .conftest import eventually_sync  # noqa: E402
from .nodesim import NodeRig, SimJob, SimJobs, events, rigs, spawn_sim_clusterd  # noqa: E402
from .processes import reap  # noqa: E402
from .test_cli_run import wait_for_line  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server() -> Iterator[StandInApiServer]:
    with StandInApiServer() as srv:
        yield srv


def test_a_job_gets_its_bridge_from_its_pod_and_loses_it_with_the_pod(server: StandInApiServer,
                                                                        tmp_path: Path) -> None:
    job = SimJob("job-a", pods=2, devices_per_pod=4, ttp_port=free_port(), extra_env={"MINDIO_WAIT_MINDX_TIME": "40"})
    port = free_port()
    clusterd = spawn_sim_clusterd(job.uid, port)
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    try:
        wait_for_line(clusterd, "simulated ClusterD")
        with rigs(NodeRig(server, tmp_path / "state", f"127.0.0.1:{port}")) as (rig,):
            rig.start()
            pods = cluster.create(job)
            record = rig.wait_running(job)
            assert record["pod_uid"] == pods[0]["metadata"]["uid"] and record["port"] == job.ttp_port
            config = rig.bridge_config(job)
            assert config["job_id"] == job.uid
            assert config["controller"]["bind_ip"] == "127.0.0.1"
            assert config["controller"]["port"] == job.ttp_port
            assert config["controller"]["world_size"] == 8
            assert config["controller"]["enable_arf"] is True
            assert config["controller"]["wait_mindx_time"] == 40
            assert config["clusterd"]["address"] == f"127.0.0.1:{port}"
            wait_for_line(clusterd, "stream-open SubscribeProcessManageSignal", timeout=30)
            eventually_sync(lambda: events(server, pods[0], "TftBridgeStarted"), 10, "the Started event")
            assert rig.metrics is not None and rig.metrics.starts.labels("job")._value.get() == 1
            cluster.delete(job)
            rig.wait_stopped(job)
            assert rig.metrics.stops.labels("replaced")._value.get() + rig.metrics.stops.labels(
                "deleted")._value.get() == 1
            assert not (rig.job_dir(job) / "controller.json").exists()  # no orphan marker: no rank was left
    finally:
        clusterd.send_signal(signal.SIGTERM)
        reap(clusterd)
