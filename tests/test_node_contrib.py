"""contrib/kubernetes: the AscendJob fragment gives a pod the node service serves, and
the RBAC allows every request the service makes (checked against the requests the
stand-in API server saw), and no write to any pod."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("kubernetes")

from bridge.node.config import DEFAULT_SELECTOR  # noqa: E402
from bridge.node.kube import PodApi  # noqa: E402
from bridge.node.podspec import JobSpec, evaluate  # noqa: E402
from bridge.core import kube  # noqa: E402
from bridge.sim.kube.apiserver import PODS, PodGroupStore, Selector, StandInApiServer  # noqa: E402
from bridge.sim.kube.ascendjob import SimJob, SimJobs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONTRIB = ROOT / "contrib" / "kubernetes"


def operator_pod(template: dict[str, Any], uid: str) -> dict[str, Any]:
    """The Master template as the cluster makes pod 0 of it: ascend-operator creates it
    (the env it adds, the user's image), the scheduler binds it, the kubelet writes its
    status; the pod as the API server then shows it."""
    pod = copy.deepcopy(template)
    container = pod["spec"]["containers"][0]
    container["image"] = "training:latest"  # the user's, beside the fragment's lines
    container["env"] = [{"name": "MINDX_TASK_ID", "value": uid}, {"name": "MINDX_SERVER_IP", "value": "10.96.0.20"},
                        {"name": "WORLD_SIZE", "value": "16"}, {"name": "RANK", "value": "0"},
                        {"name": "PROCESS_RECOVER", "value": "on"}, *container["env"]]
    pod["metadata"].update(name="default-test-pytorch-master-0", namespace="default",
                           ownerReferences=[{"kind": "AscendJob", "uid": uid, "controller": True}])
    store = PodGroupStore()
    store.create_object(PODS, pod)
    store.bind("default", pod["metadata"]["name"], "node-1")
    return store.patch("default", pod["metadata"]["name"], {"status": {"phase": "Running", "hostIP": "10.0.0.21",
                                                                       "podIP": "10.0.0.21"}}, PODS, "status")


def test_the_fragment_makes_a_pod_the_service_serves() -> None:
    job = yaml.safe_load((CONTRIB / "ascendjob-fragment.yaml").read_text())
    master = job["spec"]["replicaSpecs"]["Master"]["template"]
    pod = operator_pod(master, "job-uid-1")
    assert Selector.parse(DEFAULT_SELECTOR).matches(pod["metadata"]["labels"])
    spec = evaluate(pod, host_ip="", clusterd_address="", resolve=lambda name: None)
    assert isinstance(spec, JobSpec), spec
    assert (spec.job_id, spec.port, spec.world_size, spec.bind_ip, spec.enable_arf, spec.wait_mindx_time,
            spec.clusterd_address) == ("job-uid-1", 8000, 16, "10.0.0.21", True, 30, "10.96.0.20:8899")


def allowed(rules: list[dict[str, Any]], verb: str, resource: str) -> bool:
    return any("" in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"] for rule in rules)


def verb_of(method: str, path: str, query: dict[str, str]) -> tuple[str, str]:
    resource = PODS if "/pods" in path else "events" if "/events" in path else "nodes" if "/nodes" in path else path
    named = path.rstrip("/").split("/")[-1] not in ("pods", "events", "nodes")
    if method == "GET":
        return ("watch" if query.get("watch") in ("1", "true", "True") else "get" if named else "list"), resource
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method], resource


def test_the_rbac_allows_every_request_of_the_service_and_no_pod_write() -> None:
    documents = list(yaml.safe_load_all((CONTRIB / "rbac.yaml").read_text()))
    role = next(d for d in documents if d["kind"] == "ClusterRole")
    rules = role["rules"]
    with StandInApiServer() as server:
        SimJobs(server.store, {"node-1": "127.0.0.1"}).create(SimJob("job"))
        api = PodApi(kube.api_client(server=server.url), "node-1", request_timeout=3, connect_timeout=1)
        try:
            items, version = api.list(None, DEFAULT_SELECTOR)
            for _ in api.watch(None, DEFAULT_SELECTOR, version, 1):
                pass
            api.get("default", items[0]["metadata"]["name"])
            api.event(items[0], "TftBridgeRefused", "a test")
            api.node("node-1")  # the start-up check of the node name
        finally:
            api.close()
        made = {verb_of(*request) for request in server.requests}
    assert made == {("list", PODS), ("watch", PODS), ("get", PODS), ("create", "events"), ("get", "nodes")}
    for verb, resource in made:
        assert allowed(rules, verb, resource), (verb, resource)
    for verb in ("create", "update", "patch", "delete"):
        assert not allowed(rules, verb, PODS)
