"""``tft-bridge node`` on the stand-in API server, driven by the real ``kubernetes``
client: jobs' pods appear, move and go; the service starts, adopts and stops their
bridges (real ``tft-bridge run`` processes with the stub controller)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("kubernetes")

from bridge.sim.kube.apiserver import StandInApiServer  # noqa: E402
from bridge.sim.scenario import free_port  # noqa: E402

from bridge.node.metrics import read_sample  # noqa: E402

from .conftest import eventually_sync  # noqa: E402
from .nodesim import LoggedProcess, NodeRig, SimJob, SimJobs, events, rigs  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server() -> Iterator[StandInApiServer]:
    with StandInApiServer() as srv:
        yield srv


@pytest.fixture
def clusterd(tmp_path: Path) -> Iterator[tuple[str, SimJob, LoggedProcess]]:
    """A simulated ClusterD that knows one job (``job-a``), commanded on its stdin."""
    job = SimJob("job-a", pods=2, devices_per_pod=4, ttp_port=free_port())
    port = free_port()
    process = LoggedProcess([sys.executable, "-m", "bridge.cli", "sim-clusterd", "--listen", f"127.0.0.1:{port}", "--job", job.uid, "--world-size", "8",
                             "--devices-per-pod", "4", "--keepalive", "0.5", "--phase-delay", "0.1"],
                            tmp_path / "clusterd.log")
    try:
        process.wait_for("simulated ClusterD")
        yield f"127.0.0.1:{port}", job, process
    finally:
        process.close()


def test_a_job_gets_its_bridge_from_its_pod_and_loses_it_with_the_pod(server: StandInApiServer, tmp_path: Path,
                                                                        clusterd: tuple) -> None:
    address, job, sim = clusterd
    job.extra_env["MINDIO_WAIT_MINDX_TIME"] = "40"
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    with rigs(NodeRig(server, tmp_path / "state", address)) as (rig,):
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
        assert config["clusterd"]["address"] == address
        assert config["recorder"]["directory"] == config["controller"]["state_directory"] == str(rig.job_dir(job))
        sim.wait_for("stream-open SubscribeProcessManageSignal", timeout=30)
        eventually_sync(lambda: events(server, pods[0], "TftBridgeStarted"), 10, "the Started event")
        assert rig.metrics is not None and rig.metrics.starts.labels("job")._value.get() == 1
        cluster.delete(job)
        rig.wait_stopped(job)
        assert rig.metrics.stops.labels("deleted")._value.get() == 1
        assert not (rig.job_dir(job) / "controller.json").exists()  # no orphan marker: no rank was left


def refusal_events(server: StandInApiServer, pod: dict) -> list[str]:
    return [e["message"] for e in events(server, pod, "TftBridgeRefused")]


def test_every_refusal_is_an_event_a_log_line_and_a_metric(server: StandInApiServer, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    holder = __import__("socket").socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    served_port = free_port()
    cases = {
        "not_host_network": SimJob("no-hostnet", host_network=False, ttp_port=free_port()),
        "ids_disagree": SimJob("bad-ids", extra_env={"MINDX_TASK_ID": "another-job"}, ttp_port=free_port()),
        "no_world_size": SimJob("vnpu", world_size=None, ttp_port=free_port()),
        "taskd_controller": SimJob("taskd-on", taskd_off=False, ttp_port=free_port()),
        "bad_value": SimJob("bad-port", extra_env={"TTP_PORT": "80"}),
        "port_taken": SimJob("taken", ttp_port=taken),
        "bridge_config": SimJob("short-wait", extra_env={"MINDIO_WAIT_MINDX_TIME": "2"}, ttp_port=free_port()),
    }
    first = SimJob("first", ttp_port=served_port)
    second = SimJob("same-port", ttp_port=served_port)  # the port of another job's bridge on this node
    try:
        with rigs(NodeRig(server, tmp_path / "state", f"127.0.0.1:{free_port()}")) as (rig,):
            service = rig.start()
            cluster.create(first)
            rig.wait_running(first)
            pods = {reason: cluster.create(job)[0] for reason, job in cases.items()}
            pods["port_taken (bridge)"] = cluster.create(second)[0]
            for reason, pod in pods.items():
                key = reason.split(" ")[0]
                messages = eventually_sync(lambda pod=pod: refusal_events(server, pod), 15, f"the {reason} event")
                assert messages[0].startswith(f"{key}: "), messages
            assert f"job {first.uid}'s bridge" in refusal_events(server, pods["port_taken (bridge)"])[0]
            assert "MINDIO_WAIT_MINDX_TIME" in refusal_events(server, pods["bridge_config"])[0]
            assert rig.metrics is not None
            scraped = rig.scrape()
            for reason in cases:
                want = 2 if reason == "port_taken" else 1
                assert scraped["tft_bridge_node_refusals_total"][(("reason", reason),)] == want, reason
                assert scraped["tft_bridge_node_refused_jobs"][(("reason", reason),)] == want, reason
            assert set(rig.records()) == {first.uid}  # no bridge for any refused job
            for reason in cases:
                assert any(reason in r.getMessage() and "gets no bridge" in r.getMessage() for r in caplog.records)
            for job in (*cases.values(), second):
                assert service.refused  # still refused, not retried into a bridge
                assert job.uid not in service.jobs
            # A refusal is posted once per pod and reason, not at every pass.
            assert len(refusal_events(server, pods["not_host_network"])) == 1
    finally:
        holder.close()


def test_a_clusterd_name_the_host_cannot_resolve_is_refused(server: StandInApiServer, tmp_path: Path) -> None:
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    job = SimJob("dns", clusterd_ip="clusterd-grpc-svc.mindx-dl.invalid", ttp_port=free_port())
    with rigs(NodeRig(server, tmp_path / "state", "")) as (rig,):
        rig.start()
        pod = cluster.create(job)[0]
        messages = eventually_sync(lambda: refusal_events(server, pod), 15, "the refusal event")
        assert messages[0].startswith("clusterd_unresolvable: ") and "mindx-dl.invalid" in messages[0]
        assert not rig.records()


def test_a_graceful_api_server_restart_touches_no_bridge(server: StandInApiServer, tmp_path: Path,
                                                         clusterd: tuple) -> None:
    """The API server restarted as systemd or the kubelet restarts it (SIGTERM: new
    connections refused, the open watch held until the process ends, then cut; the same
    port again): the pod watch comes back on its own and the bridge is not touched."""
    address, job, _ = clusterd
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    with rigs(NodeRig(server, tmp_path / "state", address)) as (rig,):
        rig.start()
        cluster.create(job)
        pid = rig.wait_running(job)["pid"]
        eventually_sync(lambda: rig.metrics.watch_up._value.get() == 1, 20, "the pod watch open")
        eventually_sync(lambda: rig.metrics.starts.labels("job")._value.get() == 1, 20, "the start counted")
        starts = rig.scrape()["tft_bridge_node_bridge_starts_total"]
        errors = rig.metrics.watch_restarts.labels("error")._value.get()
        server.terminate(1.0)
        assert server.store.watcher_count == 1 and rig.metrics.watch_up._value.get() == 1  # held, not cut
        eventually_sync(lambda: rig.metrics.watch_restarts.labels("error")._value.get() > errors, 20,
                        "the watch cut at the end of the graceful stop")
        assert server.wait_stopped(10)
        lists_before = len(server.requests_matching("GET", "/api/v1/pods"))
        server.start()  # the same port, the same data
        eventually_sync(lambda: rig.metrics.watch_up._value.get() == 1 and server.store.watcher_count == 1
                        and len(server.requests_matching("GET", "/api/v1/pods")) > lists_before, 30,
                        "the pod watch back on the restarted server")
        assert rig.running() == {job.uid: pid}
        samples = rig.scrape()
        assert samples["tft_bridge_node_bridge_starts_total"] == starts
        assert not any(samples["tft_bridge_node_bridge_stops_total"].values())
        assert not samples.get("tft_bridge_node_bridge_exits_total")
        cluster.delete(job)  # the watch is live: the deletion reaches the service through it
        rig.wait_stopped(job)
        assert rig.metrics.stops.labels("deleted")._value.get() == 1


def test_two_jobs_share_a_node_and_one_metrics_endpoint(server: StandInApiServer, tmp_path: Path,
                                                        clusterd: tuple) -> None:
    address, job_a, _ = clusterd
    job_b = SimJob("job-b", ttp_port=free_port())
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    with rigs(NodeRig(server, tmp_path / "state", address)) as (rig,):
        rig.start()
        cluster.create(job_a)
        cluster.create(job_b)
        a, b = rig.wait_running(job_a), rig.wait_running(job_b)
        assert a["pid"] != b["pid"] and a["port"] != b["port"] and a["metrics_port"] != b["metrics_port"]
        assert rig.job_dir(job_a) != rig.job_dir(job_b)

        def both_scraped() -> dict | None:
            info = rig.scrape().get("tft_bridge_build_info", {})
            jobs = {dict(labels).get("tft_job") for labels in info}
            return info if {job_a.uid, job_b.uid} <= jobs else None

        eventually_sync(both_scraped, 30, "both jobs' series on the node endpoint")
        up = rig.scrape()["tft_bridge_node_job_scrape_up"]
        assert up == {(("tft_job", job_a.uid),): 1.0, (("tft_job", job_b.uid),): 1.0}
        # not Prometheus's scrape-job label: a relayed `job` would be renamed or clobber it
        assert all("job" not in dict(labels) for family in rig.scrape().values() for labels in family)
        running = rig.scrape()["tft_bridge_node_job_bridge_running"]
        assert running == {(("tft_job", job_a.uid),): 1.0, (("tft_job", job_b.uid),): 1.0}
        cluster.delete(job_b)
        rig.wait_stopped(job_b)
        assert job_a.uid in rig.running()  # the other job's bridge is untouched


def test_a_restart_of_the_node_service_orphans_nothing(server: StandInApiServer, tmp_path: Path,
                                                       clusterd: tuple) -> None:
    """SIGKILL of the service process: the bridge runs on, is adopted by the next
    service (not restarted: same process), and stopped by it when the job goes."""
    address, job, _ = clusterd
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    with rigs(NodeRig(server, tmp_path / "state", address)) as (rig,):
        rig.spawn()
        cluster.create(job)
        first = rig.wait_running(job)
        rig.kill_process()
        assert rig.running() == {job.uid: first["pid"]}
        rig.start()  # the next service, in-process so its state can be read
        eventually_sync(lambda: rig.metrics.adopted._value.get() == 1, 10, "the bridge adopted")
        assert rig.running() == {job.uid: first["pid"]}  # the same keeper: nothing restarted
        assert rig.metrics.starts.labels("job")._value.get() == 0
        eventually_sync(lambda: rig.scrape().get("tft_bridge_orphaned_job"), 20, "the adopted bridge's series")
        assert rig.scrape()["tft_bridge_orphaned_job"] == {(("tft_job", job.uid),): 0.0}
        cluster.delete(job)
        rig.wait_stopped(job)
        assert rig.metrics.stops.labels("deleted")._value.get() == 1


def test_the_api_server_down_or_slow_stops_nothing(server: StandInApiServer, tmp_path: Path,
                                                   clusterd: tuple) -> None:
    address, job, _ = clusterd
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    with rigs(NodeRig(server, tmp_path / "state", address)) as (rig,):
        rig.start()
        cluster.create(job)
        pid = rig.wait_running(job)["pid"]
        server.terminate(0.5)  # a restart: SIGTERM, its watches held, then the process ends
        assert server.wait_stopped(10)
        cluster.delete(job)  # in etcd; nobody can tell the node while the server is down
        eventually_sync(lambda: rig.metrics.watch_restarts.labels("error")._value.get() >= 2, 20,
                        "the watch failing against the down server")
        assert rig.running() == {job.uid: pid}
        server.delay = 3.0  # back, but slower than every request's timeout
        server.start()
        eventually_sync(lambda: rig.metrics.watch_restarts.labels("error")._value.get() >= 4, 30,
                        "the watch timing out against the slow server")
        assert rig.running() == {job.uid: pid}
        server.delay = 0.0
        rig.wait_stopped(job)  # the first complete list is the evidence
        assert rig.metrics.stops.labels("deleted")._value.get() == 1


def test_pod_0_rescheduled_to_another_node_moves_the_bridge(server: StandInApiServer, tmp_path: Path,
                                                            clusterd: tuple) -> None:
    address, job, _ = clusterd
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1", "node-2": "127.0.0.2"})
    with rigs(NodeRig(server, tmp_path / "n1", address, node="node-1"),
              NodeRig(server, tmp_path / "n2", address, node="node-2")) as (one, two):
        one.start()
        two.start()
        cluster.create(job, {0: "node-1", 1: "node-2"})
        assert one.wait_running(job)["bind_ip"] == "127.0.0.1"
        moved = cluster.reschedule(job, "node-2")
        one.wait_stopped(job)
        # the old pod's graceful delete (its deletionTimestamp) or the new pod of the same
        # name with another UID, whichever the service saw first; one stop either way
        stops = {evidence: one.metrics.stops.labels(evidence)._value.get() for evidence in ("deleted", "replaced")}
        assert sum(stops.values()) == 1, stops
        record = two.wait_running(job, pod_uid=moved["metadata"]["uid"])
        assert record["bind_ip"] == "127.0.0.2" and two.bridge_config(job)["controller"]["bind_ip"] == "127.0.0.2"
        assert job.uid not in one.running()


def test_a_new_incarnation_gets_a_fresh_bridge(server: StandInApiServer, tmp_path: Path, clusterd: tuple) -> None:
    address, job, _ = clusterd
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    with rigs(NodeRig(server, tmp_path / "state", address)) as (rig,):
        rig.start()
        cluster.create(job)
        first = rig.wait_running(job)
        pods = cluster.restart(job)  # same job UID, every pod new
        second = rig.wait_running(job, pod_uid=pods[0]["metadata"]["uid"])
        assert second["pid"] != first["pid"]
        eventually_sync(lambda: rig.metrics.starts.labels("incarnation")._value.get() == 1, 5, "the start counted")


def test_exit_codes_follow_the_unit_contract(server: StandInApiServer, tmp_path: Path, clusterd: tuple) -> None:
    """killMaster (75): a fresh bridge for the job; an operator's SIGTERM (exit 0): none."""
    address, job, sim = clusterd
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    with rigs(NodeRig(server, tmp_path / "state", address)) as (rig,):
        rig.start()
        pod = cluster.create(job)[0]
        first = rig.wait_running(job)
        sim.wait_for("stream-open SubscribeProcessManageSignal", timeout=30)
        sim.command("kill-master")
        # the record of the fresh bridge (never pid 0: written once its keeper runs)
        second = eventually_sync(lambda: (r := rig.records().get(job.uid)) and r["pid"] not in (0, first["pid"])
                                 and r, 40, "a fresh bridge after killMaster")
        assert rig.metrics.exits.labels("75")._value.get() == 1
        eventually_sync(lambda: rig.metrics.starts.labels("rescheduled")._value.get() == 1, 5, "the start counted")
        import os

        # Once its endpoint answers, the bridge handles SIGTERM (before that it dies of it: exit 143).
        eventually_sync(lambda: read_sample(second["metrics_port"], "tft_bridge_controller_ranks_connected", 1.0)
                        is not None, 20, "the fresh bridge serving")
        os.kill(second["pid"], signal.SIGTERM)  # an operator stops it
        eventually_sync(lambda: rig.metrics.exits.labels("0")._value.get() == 1, 30, "the exit 0")
        eventually_sync(lambda: events(server, pod, "TftBridgeStopped"), 10, "the Stopped event")
        assert job.uid not in rig.running()
        # its pod runs on without a bridge: the node endpoint says so (its series are gone)
        eventually_sync(lambda: rig.scrape().get("tft_bridge_node_job_bridge_running")
                        == {(("tft_job", job.uid),): 0.0}, 10, "the job shown without a bridge")
        assert rig.metrics.starts.labels("failure")._value.get() == 0


def test_a_fault_is_recovered_through_the_simulated_clusterd(server: StandInApiServer, tmp_path: Path,
                                                              clusterd: tuple) -> None:
    """The bridge the service started from the pod carries a rank's UCE to the simulated
    ClusterD and its retry back; the node endpoint shows the cycle under the job's label.
    Its ranks are still connected when the pods go: the stop waits for them."""
    import sys

    from .processes import ROOT

    address, job, _ = clusterd
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    extra = f'bridge_command = ["{sys.executable}", "{ROOT / "tests" / "node_stub_bridge.py"}"]'
    rig = NodeRig(server, tmp_path / "state", address)
    # The ranks' leave wait on a shorter clock (8 s, not the rig's 20): long enough that the
    # bridge is still up when the test looks right after the deletion, short enough not to
    # idle the suite.
    text = rig.config_path.read_text().replace("[kubernetes]", f"{extra}\n[kubernetes]", 1)
    rig.config_path.write_text(text.replace("ranks_leave_wait = 20.0", "ranks_leave_wait = 8.0"))
    rig.reload()
    assert rig.config.node.ranks_leave_wait == 8.0
    with rigs(rig):
        rig.start()
        cluster.create(job)
        rig.wait_running(job)

        def sample(name: str, **labels: str) -> float:
            series = rig.scrape().get(name, {})
            return sum(v for key, v in series.items() if labels.items() <= dict(key).items())

        eventually_sync(lambda: sample("tft_bridge_controller_ranks_connected", tft_job=job.uid) == 1, 30,
                        "the simulated ranks connected")
        (rig.job_dir(job) / "inject-fault").write_text("3")
        eventually_sync(lambda: sample("tft_bridge_recovery_cycles_total", tft_job=job.uid, outcome="success"), 60,
                        "the recovery through the simulated ClusterD")
        assert sample("tft_bridge_faults_reported_total", tft_job=job.uid) >= 1
        cluster.delete(job)
        eventually_sync(lambda: rig.service.jobs[job.uid].stop_evidence == "deleted", 15, "the job seen gone")
        assert job.uid in rig.running()  # ranks still attached: not stopped yet
        rig.wait_stopped(job, timeout=60)  # node.ranks_leave_wait (8 s) ran out
        assert rig.metrics.stops.labels("deleted")._value.get() == 1
