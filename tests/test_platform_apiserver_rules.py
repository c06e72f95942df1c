"""The stand-in API server refuses and changes what a real kube-apiserver refuses and
changes, driven by the official ``kubernetes`` client (the way the node service and the
agent talk to it): pod status and its subresource, binding, immutable fields, graceful
deletion, bookmarks, selectors, validation, error bodies, paging, TLS with bearer
tokens and RBAC, a connection kept alive after an error, and a graceful stop."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes")
yaml = pytest.importorskip("yaml")

from bridge.node.kube import PodApi  # noqa: E402
from bridge.platform.podgroup_api import PodGroupApi  # noqa: E402
from bridge.core import kube  # noqa: E402
from bridge.sim.kube.apiserver import PODS, StandInApiServer  # noqa: E402
from bridge.sim.kube.ascendjob import SimJob, SimJobs, pod_manifest  # noqa: E402
from bridge.sim.kube.selectors import FieldSelector, LabelSelector, SelectorError  # noqa: E402

from .conftest import eventually_sync  # noqa: E402

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def server() -> Iterator[StandInApiServer]:
    with StandInApiServer() as srv:
        yield srv


@pytest.fixture
def core(server: StandInApiServer) -> Iterator[Any]:
    client = kube.api_client(server=server.url)
    try:
        yield kube.kubernetes_module().client.CoreV1Api(client)
    finally:
        client.close()


def call(method: Any, *args: Any, **kwargs: Any) -> tuple[int, Any]:
    """(HTTP status, JSON body) of a client call; an error answer too, never raised."""
    from kubernetes.client.exceptions import ApiException

    try:
        response = method(*args, _preload_content=False, _request_timeout=5, **kwargs)
        return response.status, json.loads(response.data or b"null")
    except ApiException as error:
        return error.status, json.loads(error.body or b"null")


def a_pod(name: str = "p", **spec: Any) -> dict[str, Any]:
    pod = pod_manifest(SimJob("job"), 0)
    pod["metadata"]["name"] = name
    pod["spec"].update(spec)
    return pod


def test_a_pod_is_created_without_the_status_it_was_sent_with(core: Any) -> None:
    body = a_pod(nodeName="node-1")
    body["status"] = {"phase": "Running", "hostIP": "10.0.0.1", "podIP": "10.0.0.1"}
    code, created = call(core.create_namespaced_pod, "default", body)
    assert code == 201
    assert created["status"]["phase"] == "Pending" and "hostIP" not in created["status"]
    assert created["spec"]["terminationGracePeriodSeconds"] == 30


def test_status_only_through_its_subresource(core: Any) -> None:
    call(core.create_namespaced_pod, "default", a_pod())
    code, patched = call(core.patch_namespaced_pod, "p", "default",
                         {"metadata": {"labels": {"x": "1"}}, "status": {"hostIP": "10.0.0.1"}})
    assert code == 200 and patched["metadata"]["labels"]["x"] == "1" and "hostIP" not in patched["status"]
    code, patched = call(core.patch_namespaced_pod_status, "p", "default",
                         {"status": {"hostIP": "10.0.0.1", "phase": "Running"}, "metadata": {"labels": {"y": "1"}}})
    assert code == 200 and patched["status"]["hostIP"] == "10.0.0.1" and patched["status"]["phase"] == "Running"
    assert "y" not in patched["metadata"]["labels"]  # a status write changes the status only
    patched["status"]["podIP"] = "10.0.0.1"
    code, replaced = call(core.replace_namespaced_pod_status, "p", "default", patched)
    assert code == 200 and replaced["status"]["podIP"] == "10.0.0.1"
    code, _ = call(core.read_namespaced_pod_status, "p", "default")
    assert code == 200


def test_binding_is_the_only_way_to_a_node(core: Any, server: StandInApiServer) -> None:
    call(core.create_namespaced_pod, "default", a_pod())
    code, error = call(core.patch_namespaced_pod, "p", "default", {"spec": {"nodeName": "node-1"}})
    assert code == 422 and error["reason"] == "Invalid"
    assert error["details"]["causes"][0]["field"] == "spec.nodeName"
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p"},
               "target": {"apiVersion": "v1", "kind": "Node", "name": "node-1"}}
    code, status = call(core.create_namespaced_pod_binding, "p", "default", binding)
    assert code == 201 and status["status"] == "Success"
    assert server.store.get("default", "p", PODS)["spec"]["nodeName"] == "node-1"
    code, error = call(core.create_namespaced_pod_binding, "p", "default",
                       {**binding, "target": {"kind": "Node", "name": "node-2"}})
    assert code == 409 and "already assigned" in error["message"]
    code, error = call(core.patch_namespaced_pod, "p", "default", {"spec": {"nodeName": "node-2"}})
    assert code == 422
    code, _ = call(core.patch_namespaced_pod, "p", "default",
                   {"spec": {"containers": [{"name": "ascend", "image": "training:v2"}]}})
    assert code == 200  # an image is the one container field an update may change


def test_a_deletion_timestamp_is_set_by_deletion_only(core: Any) -> None:
    call(core.create_namespaced_pod, "default", a_pod())
    code, error = call(core.patch_namespaced_pod, "p", "default",
                       {"metadata": {"deletionTimestamp": "2030-01-01T00:00:00Z"}})
    assert code == 422 and error["details"]["causes"][0]["field"] == "metadata.deletionTimestamp"


def watch_events(server: StandInApiServer, count: int, **query: str) -> list[dict[str, Any]]:
    """The first ``count`` events of a pod watch from now on (raw HTTP, one connection)."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=10)
    path = "/api/v1/namespaces/default/pods?" + "&".join(f"{k}={v}" for k, v in {"watch": "1", **query}.items())
    connection.request("GET", path)
    response = connection.getresponse()
    return [json.loads(line) for _, line in zip(range(count), response)]


def test_graceful_deletion(core: Any, server: StandInApiServer) -> None:
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    job = SimJob("g", pods=1)
    cluster.create(job)
    name = cluster.pod(job)["metadata"]["name"]
    rv = server.store.resource_version
    code, deleting = call(core.delete_namespaced_pod, name, job.namespace)
    assert code == 200 and deleting["metadata"]["deletionTimestamp"]
    assert deleting["metadata"]["deletionGracePeriodSeconds"] == 30
    code, still = call(core.read_namespaced_pod, name, job.namespace)
    assert code == 200 and still["metadata"]["deletionTimestamp"]  # the kubelet has not confirmed yet
    code, _ = call(core.delete_namespaced_pod, name, job.namespace, grace_period_seconds=0)
    assert code == 200
    code, _ = call(core.read_namespaced_pod, name, job.namespace)
    assert code == 404
    kinds = [(e["type"], bool(e["object"]["metadata"].get("deletionTimestamp")))
             for e in watch_events(server, 2, resourceVersion=rv)]
    assert kinds == [("MODIFIED", True), ("DELETED", True)]


def test_a_short_grace_period_ends_on_its_own_and_an_unbound_pod_goes_at_once(core: Any,
                                                                             server: StandInApiServer) -> None:
    cluster = SimJobs(server.store, {"node-1": "127.0.0.1"})
    job = SimJob("short", pods=1)
    cluster.create(job)
    name = cluster.pod(job)["metadata"]["name"]
    code, deleting = call(core.delete_namespaced_pod, name, job.namespace,
                          body={"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 1})
    assert code == 200 and deleting["metadata"]["deletionGracePeriodSeconds"] == 1
    eventually_sync(lambda: call(core.read_namespaced_pod, name, job.namespace)[0] == 404, 10,
                    "the pod gone after its grace period")
    call(core.create_namespaced_pod, "default", a_pod("unbound"))
    call(core.delete_namespaced_pod, "unbound", "default")
    assert call(core.read_namespaced_pod, "unbound", "default")[0] == 404


def test_bookmarks_when_asked_for(server: StandInApiServer) -> None:
    server.bookmark_interval = 0.2
    server.store.create_object(PODS, a_pod())
    rv = server.store.resource_version
    first = watch_events(server, 1, resourceVersion=rv, allowWatchBookmarks="true", timeoutSeconds="5")
    assert first[0]["type"] == "BOOKMARK" and first[0]["object"]["metadata"]["resourceVersion"] == rv
    assert first[0]["object"]["kind"] == "Pod"
    without = watch_events(server, 5, resourceVersion=rv, timeoutSeconds="1")
    assert without == []


def test_the_watcher_follows_bookmarks(server: StandInApiServer) -> None:
    """The product's list+watch sends allowWatchBookmarks and copes with them."""
    server.bookmark_interval = 0.1
    api = PodApi(kube.api_client(server=server.url), "node-1", request_timeout=3, connect_timeout=1)
    try:
        _, rv = api.list(None, None)
        stream = api.watch(None, None, rv, 2)
        seen = [event["type"] for event in stream]
        assert "BOOKMARK" in seen
    finally:
        api.close()


def test_selectors_parsed_as_the_real_server(core: Any, server: StandInApiServer) -> None:
    for name, team in (("a", "x"), ("b", "y"), ("c", None)):
        pod = a_pod(name)
        pod["metadata"]["labels"] = {"team": team} if team else {}
        server.store.create_object(PODS, pod)

    def names(**kwargs: str) -> list[str] | int:
        code, body = call(core.list_namespaced_pod, "default", **kwargs)
        return [i["metadata"]["name"] for i in body["items"]] if code == 200 else code

    assert names(label_selector="team in (x, y)") == ["a", "b"]
    assert names(label_selector="team notin (x)") == ["b", "c"]
    assert names(label_selector="!team") == ["c"]
    assert names(label_selector="team") == ["a", "b"]
    assert names(label_selector="team=x,team!=y") == ["a"]
    assert names(label_selector="tft-bridge/enabled=true=x") == 400
    assert names(label_selector="team=x,") == 400
    assert names(label_selector="team in ()") == 400
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="status.hostIP=10.0.0.1") == 400
    code, body = call(core.list_namespaced_pod, "default", field_selector="status.hostIP=10.0.0.1")
    assert body["kind"] == "Status" and "field label not supported: status.hostIP" in body["message"]


@pytest.mark.parametrize("text", ["a=b=c", "a b", "a in b", "a in (b", "!a=b", "=b", "a,", ",a", "a==", "-a",
                                  "a in ()", "a>b", "a/b/c=d", "a=" + "v" * 64])
def test_malformed_label_selectors(text: str) -> None:
    if text == "a==":  # an empty value is a value
        assert LabelSelector.parse(text).matches({"a": ""})
        return
    with pytest.raises(SelectorError):
        LabelSelector.parse(text)


def test_label_selector_semantics() -> None:
    s = LabelSelector.parse("env in (prod, qa), tier notin (front), !legacy, app, n>3")
    assert s.matches({"env": "qa", "app": "x", "n": "4"})
    assert not s.matches({"env": "dev", "app": "x", "n": "4"})
    assert not s.matches({"env": "qa", "tier": "front", "app": "x", "n": "4"})
    assert not s.matches({"env": "qa", "legacy": "", "app": "x", "n": "4"})
    assert not s.matches({"env": "qa", "app": "x", "n": "3"})
    assert LabelSelector.parse("example.com/role=a").matches({"example.com/role": "a"})
    with pytest.raises(SelectorError):
        FieldSelector.parse("spec.nodeName in (a)", "pods")
    assert FieldSelector.parse("spec.nodeName=node-1", "pods").matches({"spec": {"nodeName": "node-1"}})


def test_validation_of_pods_and_events(core: Any, server: StandInApiServer) -> None:
    code, error = call(core.create_namespaced_pod, "default", {"metadata": {"name": "empty"}, "spec": {"containers": []}})
    assert code == 422 and error["details"]["causes"][0]["field"] == "spec.containers"
    assert error["details"]["kind"] == "Pod" and error["details"]["name"] == "empty"
    event = {"metadata": {"generateName": "p."}, "involvedObject": {"kind": "Pod", "name": "p", "uid": "u"},
             "reason": "R", "message": "m", "type": "Normal"}
    code, error = call(core.create_namespaced_event, "training", event)  # no involvedObject.namespace
    assert code == 422 and error["details"]["causes"][0]["field"] == "involvedObject.namespace"
    assert call(core.create_namespaced_event, "default", event)[0] == 201  # old clients' leniency, in default only
    event["involvedObject"]["namespace"] = "other"
    assert call(core.create_namespaced_event, "training", event)[0] == 422
    event["involvedObject"]["namespace"] = "training"
    assert call(core.create_namespaced_event, "training", event)[0] == 201


def test_error_bodies_are_status_objects_with_details(core: Any) -> None:
    code, error = call(core.read_namespaced_pod, "missing", "default")
    assert code == 404 and error["kind"] == "Status" and error["reason"] == "NotFound"
    assert error["details"] == {"name": "missing", "kind": "pods"}
    call(core.create_namespaced_pod, "default", a_pod())
    code, error = call(core.create_namespaced_pod, "default", a_pod())
    assert code == 409 and error["reason"] == "AlreadyExists" and error["details"]["name"] == "p"


def test_a_resource_version_that_is_no_number_is_an_internal_error(core: Any) -> None:
    assert call(core.list_namespaced_pod, "default", resource_version="abc")[0] == 500
    assert call(core.list_namespaced_pod, "default", watch=True, resource_version="abc", timeout_seconds=1)[0] == 500


def test_list_items_carry_no_kind_but_custom_resources_do(core: Any, server: StandInApiServer) -> None:
    server.store.create_object(PODS, a_pod())
    server.store.create("default", "group")
    code, body = call(core.list_namespaced_pod, "default")
    assert body["kind"] == "PodList" and "kind" not in body["items"][0] and "apiVersion" not in body["items"][0]
    assert call(core.read_namespaced_pod, "p", "default")[1]["kind"] == "Pod"  # a GET has them
    api = PodGroupApi(kube.api_client(server=server.url), request_timeout=3)
    try:
        items, _ = api.list(None, None)
        assert items[0]["kind"] == "PodGroup"
    finally:
        api.close()


def test_every_write_records_its_manager(core: Any) -> None:
    code, created = call(core.create_namespaced_pod, "default", a_pod())
    managers = [(e["manager"], e["operation"], e.get("subresource", "")) for e in created["metadata"]["managedFields"]]
    assert managers == [("OpenAPI-Generator", "Update", "")]  # the client's User-Agent up to its first "/"
    code, patched = call(core.patch_namespaced_pod_status, "p", "default", {"status": {"hostIP": "10.0.0.1"}})
    entries = patched["metadata"]["managedFields"]
    assert [e.get("subresource", "") for e in entries] == ["", "status"] and "f:status" in entries[1]["fieldsV1"]
    code, listed = call(core.list_namespaced_pod, "default")
    assert listed["items"][0]["metadata"]["managedFields"] == entries


def test_limit_and_continue(core: Any, server: StandInApiServer) -> None:
    for i in range(5):
        server.store.create_object(PODS, a_pod(f"p{i}"))
    code, first = call(core.list_namespaced_pod, "default", limit=2)
    assert [i["metadata"]["name"] for i in first["items"]] == ["p0", "p1"]
    assert first["metadata"]["remainingItemCount"] == 3 and first["metadata"]["continue"]
    seen = [i["metadata"]["name"] for i in first["items"]]
    token = first["metadata"]["continue"]
    while token:
        code, page = call(core.list_namespaced_pod, "default", limit=2, _continue=token)
        assert code == 200 and page["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
        seen += [i["metadata"]["name"] for i in page["items"]]
        token = page["metadata"].get("continue")
    assert seen == [f"p{i}" for i in range(5)]
    server.store.create_object(PODS, a_pod("late"))
    server.store.compact()  # etcd compacted past the first page's revision
    assert call(core.list_namespaced_pod, "default", limit=2, _continue=first["metadata"]["continue"])[0] == 410


def test_an_error_answered_early_leaves_no_body_on_the_connection(server: StandInApiServer) -> None:
    """The next request on a kept-alive connection must not read the last one's body."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=5)
    try:
        payload = json.dumps({"metadata": {"name": "x"}, "padding": "y" * 4000}).encode()
        connection.request("POST", "/api/v1/namespaces/default/nothings", body=payload,
                           headers={"Content-Type": "application/json"})
        first = connection.getresponse()
        assert first.status == 404 and json.loads(first.read())["kind"] == "Status"
        connection.request("DELETE", "/api/v1/namespaces/default/pods/missing", body=b'{"gracePeriodSeconds": 0}',
                           headers={"Content-Type": "application/json"})
        second = connection.getresponse()
        assert second.status == 404 and json.loads(second.read())["reason"] == "NotFound"
        connection.request("GET", "/api/v1/namespaces/default/pods")
        third = connection.getresponse()
        assert third.status == 200 and json.loads(third.read())["kind"] == "PodList"
    finally:
        connection.close()


# --------------------------------------------------------------------------- TLS, tokens, RBAC


def rbac_rules() -> list[dict[str, Any]]:
    documents = list(yaml.safe_load_all((ROOT / "contrib" / "kubernetes" / "rbac.yaml").read_text()))
    return next(d for d in documents if d["kind"] == "ClusterRole")["rules"]


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[tuple[StandInApiServer, str]]:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    user = "system:serviceaccount:tft-bridge:tft-bridge-node"
    with StandInApiServer(certfile=str(tmp_path / "server.pem"), tokens={"good-token": user},
                          rbac={user: rbac_rules()}) as srv:
        SimJobs(srv.store, {"node-1": "127.0.0.1"}).create(SimJob("job"))
        yield srv, str(tmp_path / "ca.pem")


def kubeconfig(tmp_path: Path, url: str, ca: str, token: str | None) -> str:
    user = f"    token: {token}\n" if token is not None else "    username: nobody\n"
    path = tmp_path / f"kubeconfig-{token}"
    path.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\n"
                    f"clusters:\n- name: s\n  cluster:\n    server: {url}\n    certificate-authority: {ca}\n"
                    f"users:\n- name: u\n  user:\n{user}"
                    "contexts:\n- name: c\n  context:\n    cluster: s\n    user: u\n")
    return str(path)


def test_tls_with_a_bearer_token_and_the_contrib_rbac(secure: tuple[StandInApiServer, str], tmp_path: Path) -> None:
    server, ca = secure
    assert server.url.startswith("https://")
    api = PodApi(kube.api_client(kubeconfig=kubeconfig(tmp_path, server.url, ca, "good-token")), "node-1",
                 request_timeout=3, connect_timeout=1)
    try:
        items, rv = api.list(None, "tft-bridge/enabled=true")
        assert len(items) == 2
        api.get("default", items[0]["metadata"]["name"])
        api.event(items[0], "TftBridgeRefused", "a test")
        assert api.node("node-1")["metadata"]["name"] == "node-1"  # the start-up check of the node name
        core = kube.kubernetes_module().client.CoreV1Api(api._client)
        code, error = call(core.patch_namespaced_pod, items[0]["metadata"]["name"], "default",
                           {"metadata": {"labels": {"x": "1"}}})
        assert code == 403 and error["reason"] == "Forbidden"
        assert 'cannot patch resource "pods"' in error["message"]
    finally:
        api.close()


@pytest.mark.parametrize("token", ["wrong-token", None])
def test_no_or_a_wrong_token_is_401(secure: tuple[StandInApiServer, str], tmp_path: Path, token: str | None) -> None:
    server, ca = secure
    api = PodApi(kube.api_client(kubeconfig=kubeconfig(tmp_path, server.url, ca, token)), "node-1",
                 request_timeout=3, connect_timeout=1)
    try:
        with pytest.raises(kube.RequestFailed) as caught:
            api.list(None, None)
        assert caught.value.status == 401
    finally:
        api.close()


def open_watch(server: StandInApiServer) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=10)
    connection.request("GET", f"/api/v1/pods?watch=1&resourceVersion={server.store.resource_version}")
    response = connection.getresponse()
    assert response.status == 200
    return connection, response


def refused(server: StandInApiServer) -> bool:
    try:
        socket.create_connection((server.host, server.port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_graceful_stop_keeps_open_watches_until_its_timeout_and_accepts_nothing_new() -> None:
    """kube-apiserver on SIGTERM (default settings): the listener closes, idle keep-alive
    connections close, a request in flight is answered, open watches keep streaming until
    the HTTP server's shutdown timeout, then the process exit cuts them mid-body."""
    with StandInApiServer(shutdown_timeout=1.5) as server:
        watch_conn, watch = open_watch(server)
        idle = http.client.HTTPConnection(server.host, server.port, timeout=10)
        idle.request("GET", "/api/v1/pods")
        assert idle.getresponse().read() and idle.sock is not None
        slow = http.client.HTTPConnection(server.host, server.port, timeout=10)
        server.delay = 0.5  # requests from now on are held: this one is in flight at the stop
        slow.request("GET", "/api/v1/pods")
        eventually_sync(lambda: server.requests_matching("GET", "/api/v1/pods")[2:], 5, "the slow request received")
        started = time.monotonic()
        server.terminate()
        assert refused(server), "a new connection was accepted after the graceful stop began"
        idle.sock.settimeout(5)
        assert idle.sock.recv(1) == b"", "an idle keep-alive connection was kept open"
        answer = slow.getresponse()
        assert answer.status == 200 and answer.getheader("Connection") == "close" and json.loads(answer.read())
        server.store.create_object(PODS, a_pod("during-the-stop"))  # another apiserver's write reaches etcd
        event = json.loads(watch.readline())
        assert event["type"] == "ADDED" and event["object"]["metadata"]["name"] == "during-the-stop"
        with pytest.raises(http.client.IncompleteRead):  # cut: no terminating chunk
            watch.read()
        assert time.monotonic() - started >= 1.4, "the watch was cut before the shutdown timeout"
        assert server.wait_stopped(5) and not server.listening
        watch_conn.close()
        idle.close()
        slow.close()
        server.delay = 0.0
        server.start()  # the same port, the same data
        names = [p["metadata"]["name"] for p in json.loads(urllib.request.urlopen(f"{server.url}/api/v1/pods",
                                                                                  timeout=5).read())["items"]]
        assert names == ["during-the-stop"]


def test_a_kill_cuts_open_watches_at_once() -> None:
    with StandInApiServer() as server:  # the default shutdown timeout: 60 s, as the real server's
        assert server.shutdown_timeout == 60.0
        watch_conn, watch = open_watch(server)
        server.terminate()
        server.store.create_object(PODS, a_pod("still-served"))
        assert json.loads(watch.readline())["object"]["metadata"]["name"] == "still-served"
        started = time.monotonic()
        server.kill()  # the supervisor's SIGKILL, long before the 60 s
        with pytest.raises(http.client.IncompleteRead):
            watch.read()
        assert time.monotonic() - started < 5 and refused(server) and server.wait_stopped(5)
        watch_conn.close()


def test_the_product_watch_keeps_its_stream_through_a_graceful_stop(server: StandInApiServer) -> None:
    """The node service's watch (the real client) receives what happens during the stop,
    then fails as Unavailable when the stream is cut: the reflector lists again."""
    server.shutdown_timeout = 1.0
    api = PodApi(kube.api_client(server=server.url), "node-1", request_timeout=3, connect_timeout=1)
    try:
        _, rv = api.list(None, None)
        stream = iter(api.watch(None, None, rv, 30))
        server.terminate()
        pod = server.store.create_object(PODS, a_pod("late"))
        server.store.bind(pod["metadata"]["namespace"], "late", "node-1")  # the scheduler, via another apiserver
        seen: list[dict[str, Any]] = []
        for event in stream:
            if event["type"] != "BOOKMARK":
                seen.append(event)
                break
        assert seen and seen[0]["object"]["metadata"]["name"] == "late"
        with pytest.raises(kube.Unavailable):
            for _ in stream:  # BOOKMARKs still come until the cut
                pass
        with pytest.raises(kube.Unavailable):
            api.list(None, None)
        server.start()
        assert [p["metadata"]["name"] for p in api.list(None, None)[0]] == ["late"]
    finally:
        api.close()
