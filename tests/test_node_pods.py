"""The node service on pods as the cluster makes them: created without a status, bound,
then the kubelet's status; a pod the service cannot serve is visible, never silent; and
a node name the cluster does not know stops the start with a message naming both."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("kubernetes")

from bridge.sim.kube.apiserver import PODS, StandInApiServer  # noqa: E402
from bridge.sim.kube.ascendjob import kubelet_status, pod_manifest, pod_name  # noqa: E402
from bridge.sim.scenario import free_port  # noqa: E402

from .conftest import eventually_sync  # noqa: E402
from .nodesim import NodeRig, SimJob, SimJobs, events, rigs  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server() -> Iterator[StandInApiServer]:
    with StandInApiServer() as srv:
        yield srv


def gauge(rig: NodeRig, name: str, reason: str) -> float:
    return rig.scrape().get(name, {}).get((("reason", reason),), -1.0)


def with_node_keys(rig: NodeRig, lines: str) -> NodeRig:
    rig.config_path.write_text(rig.config_path.read_text().replace("[kubernetes]", f"{lines}\n[kubernetes]", 1))
    rig.reload()
    return rig


def test_a_pod_waits_for_its_host_ip_without_a_refusal(server: StandInApiServer, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Bound, no status yet (the kubelet has not run it): no ERROR line, no Warning Event;
    the bridge starts once the kubelet writes status.hostIP."""
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    job = SimJob("waits", ttp_port=free_port())
    caplog.set_level(logging.INFO)
    with rigs(NodeRig(server, tmp_path / "state", f"127.0.0.1:{free_port()}")) as (rig,):
        rig.start()
        pods = cluster.create(job, run=False)
        assert "hostIP" not in pods[0]["status"]
        eventually_sync(lambda: gauge(rig, "tft_bridge_node_ignored_pods", "host_ip_pending") == 1, 15,
                        "the pod counted as waiting for its host IP")
        assert gauge(rig, "tft_bridge_node_ignored_pods", "not_controller") == 1  # the worker pod
        assert not rig.records() and not events(server, pods[0])
        cluster.run(job, 0)
        rig.wait_running(job)
        eventually_sync(lambda: events(server, pods[0], "TftBridgeStarted"), 10, "the Started event")
        assert not events(server, pods[0], "TftBridgeRefused")
        assert gauge(rig, "tft_bridge_node_refused_jobs", "host_ip_unknown") == 0
        eventually_sync(lambda: gauge(rig, "tft_bridge_node_ignored_pods", "host_ip_pending") == 0, 10,
                        "the wait over")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("tft_bridge.node")]


def test_a_host_ip_that_never_comes_is_refused_after_the_bound(server: StandInApiServer, tmp_path: Path) -> None:
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    job = SimJob("never", ttp_port=free_port())
    rig = with_node_keys(NodeRig(server, tmp_path / "state", f"127.0.0.1:{free_port()}"), "host_ip_wait = 1.0")
    with rigs(rig):
        rig.start()
        pod = cluster.create(job, run=False)[0]
        messages = eventually_sync(lambda: [e["message"] for e in events(server, pod, "TftBridgeRefused")], 15,
                                   "the refusal after node.host_ip_wait")
        assert messages[0].startswith("host_ip_unknown: ") and "node.host_ip_wait" in messages[0]
        assert gauge(rig, "tft_bridge_node_refused_jobs", "host_ip_unknown") == 1
        cluster.run(job, 0)  # late, but it came: the job gets its bridge after all
        rig.wait_running(job)


def create_pod(server: StandInApiServer, job: SimJob, drop: str) -> dict:
    """Pod 0 of ``job`` without the variable ``drop``: created, bound, run (as the cluster does)."""
    manifest = pod_manifest(job, 0)
    env = manifest["spec"]["containers"][0]["env"]
    env[:] = [e for e in env if e["name"] != drop]
    server.store.create_object(PODS, manifest)
    server.store.bind(job.namespace, pod_name(job, 0), "node-1")
    return server.store.patch(job.namespace, pod_name(job, 0), {"status": kubelet_status(job, 0, "127.0.0.1")},
                              PODS, "status")


def test_every_pod_it_ignores_is_counted_and_an_opted_in_one_is_told(server: StandInApiServer,
                                                                     tmp_path: Path) -> None:
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    no_rank = create_pod(server, SimJob("no-rank", pods=1, ttp_port=free_port()), "RANK")
    no_id = create_pod(server, SimJob("no-id", pods=1, ttp_port=free_port()), "MINDX_TASK_ID")
    leaving = SimJob("leaving", pods=2, ttp_port=free_port())
    with rigs(NodeRig(server, tmp_path / "state", f"127.0.0.1:{free_port()}")) as (rig,):
        rig.start()
        cluster.create(leaving)
        rig.wait_running(leaving)
        cluster.delete(leaving, index=1, finish=False)  # graceful: the kubelet has not confirmed yet
        ignored = eventually_sync(lambda: events(server, no_rank, "TftBridgeIgnored"), 15, "the Ignored event")
        assert ignored[0]["message"].startswith("no_rank: ") and ignored[0]["type"] == "Warning"
        refused = eventually_sync(lambda: events(server, no_id, "TftBridgeRefused"), 15, "the refusal")
        assert refused[0]["message"].startswith("ids_disagree: ") and "MINDX_TASK_ID" in refused[0]["message"]

        def counts() -> dict[str, float]:
            return {reason: gauge(rig, "tft_bridge_node_ignored_pods", reason)
                    for reason in ("no_rank", "deleting", "not_controller")}

        eventually_sync(lambda: counts() == {"no_rank": 1, "deleting": 1, "not_controller": 0}, 15,
                        f"the ignored pods counted by reason (now {counts()})")
        assert len(events(server, no_rank, "TftBridgeIgnored")) == 1  # once per pod and reason
        assert not rig.service.refused.get(no_rank["metadata"]["uid"])


def test_a_node_name_the_cluster_does_not_know_stops_the_start(server: StandInApiServer, tmp_path: Path) -> None:
    SimJobs(server.store, {"node-1": "127.0.0.1"})  # the cluster's one Node
    with rigs(NodeRig(server, tmp_path / "wrong" / "state", "127.0.0.1:1", node="worker-7")) as (rig,):
        process = rig.spawn()
        assert process.wait(timeout=60) == 2  # a configuration error: systemd does not restart it
        log = (rig.state_root.parent / "worker-7.log").read_text()
        assert "'worker-7' (from node.name in " in log and str(rig.config_path) in log
        assert "kubectl get nodes" in log
    with rigs(NodeRig(server, tmp_path / "right" / "state", "127.0.0.1:1", node="node-1")) as (rig,):
        process = rig.spawn()
        log_path = rig.state_root.parent / "node-1.log"
        eventually_sync(lambda: log_path.exists() and "node service for node node-1" in log_path.read_text(), 60,
                        "the service started")
        assert process.poll() is None
        process.terminate()
        assert process.wait(timeout=30) == 0


def test_rbac_lets_the_service_read_its_node() -> None:
    yaml = pytest.importorskip("yaml")
    root = Path(__file__).resolve().parent.parent
    documents = list(yaml.safe_load_all((root / "contrib" / "kubernetes" / "rbac.yaml").read_text()))
    rules = next(d for d in documents if d["kind"] == "ClusterRole")["rules"]
    assert any("" in r["apiGroups"] and "nodes" in r["resources"] and "get" in r["verbs"] for r in rules)
    assert not any("nodes" in r["resources"] and {"list", "watch", "patch", "update"} & set(r["verbs"])
                   for r in rules)


def test_the_fragment_keeps_the_host_port_equal_to_ttp_port() -> None:
    """With hostNetwork the containerPort is a host port: it must follow TTP_PORT, and the
    fragment must say so where a user changes one of them."""
    yaml = pytest.importorskip("yaml")
    path = Path(__file__).resolve().parent.parent / "contrib" / "kubernetes" / "ascendjob-fragment.yaml"
    job = yaml.safe_load(path.read_text())
    master = job["spec"]["replicaSpecs"]["Master"]["template"]["spec"]
    container = master["containers"][0]
    ttp_port = int(next(e["value"] for e in container["env"] if e["name"] == "TTP_PORT"))
    assert master["hostNetwork"] is True
    assert [p["containerPort"] for p in container["ports"]] == [ttp_port]
    text = path.read_text()
    ports_comment = text[text.index("fieldPath: status.podIP"):text.index("- containerPort")]
    assert "TTP_PORT" in ports_comment and "host port" in ports_comment and "Pending" in ports_comment


def test_a_node_name_that_cannot_be_checked_is_a_warning_not_a_stop(tmp_path: Path) -> None:
    """An RBAC from before the check (no `get` on nodes): the API answers 403; the service
    says what is missing and starts (its bridges must not wait on the check)."""
    yaml = pytest.importorskip("yaml")
    root = Path(__file__).resolve().parent.parent
    documents = list(yaml.safe_load_all((root / "contrib" / "kubernetes" / "rbac.yaml").read_text()))
    rules = [r for r in next(d for d in documents if d["kind"] == "ClusterRole")["rules"] if "nodes" not in r["resources"]]
    user = "system:serviceaccount:tft-bridge:tft-bridge-node"
    with StandInApiServer(tokens={"node-token": user}, rbac={user: rules}) as server:
        SimJobs(server.store, {"node-1": "127.0.0.1"})
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\n"
                              f"clusters:\n- name: s\n  cluster:\n    server: {server.url}\n"
                              "users:\n- name: u\n  user:\n    token: node-token\n"
                              "contexts:\n- name: c\n  context:\n    cluster: s\n    user: u\n")
        rig = NodeRig(server, tmp_path / "state", "127.0.0.1:1", node="node-1")
        rig.config_path.write_text(rig.config_path.read_text().replace(f'server = "{server.url}"',
                                                                         f'kubeconfig = "{kubeconfig}"'))
        with rigs(rig):
            process = rig.spawn()
            log_path = rig.state_root.parent / "node-1.log"
            eventually_sync(lambda: log_path.exists() and "node service for node node-1" in log_path.read_text(),
                            60, "the service started")
            text = log_path.read_text()
            assert "cannot check that node 'node-1'" in text and "get` on nodes" in text and "403" in text
            assert process.poll() is None
            eventually_sync(lambda: server.requests_matching("GET", "/api/v1/pods"), 30, "the pod list")
            assert "401" not in log_path.read_text()


def test_no_variable_the_bridge_reads_reaches_it_from_the_service() -> None:
    """The generated file is a bridge's whole configuration: every variable the bridge
    reads (bridge/core/config.py) is dropped from the environment the service passes on."""
    from bridge.core.config import ENVIRONMENT
    from bridge.node import CHILD_ENV_DROPPED

    assert set(ENVIRONMENT) <= set(CHILD_ENV_DROPPED), set(ENVIRONMENT) - set(CHILD_ENV_DROPPED)
