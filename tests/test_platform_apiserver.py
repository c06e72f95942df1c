"""The stand-in Kubernetes API server, driven through the official client and the
agent's ``kube`` layer: if the stand-in were kinder than the real server, the agent's
tests would prove nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("kubernetes")

from bridge.core import kube  # noqa: E402
from bridge.platform.podgroup_api import PodGroupApi  # noqa: E402
from bridge.sim.kube.apiserver import PodGroupStore, StandInApiServer, merge_patch  # noqa: E402

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
def server() -> Iterator[StandInApiServer]:
    with StandInApiServer() as srv:
        yield srv


@pytest.fixture
def api(server: StandInApiServer) -> Iterator[PodGroupApi]:
    client = PodGroupApi(kube.api_client(server=server.url), request_timeout=3, connect_timeout=1)
    try:
        yield client
    finally:
        client.close()


def test_merge_patch_rfc7386() -> None:
    patched = merge_patch({"a": {"b": 1, "c": 2}, "d": 1}, {"a": {"b": None, "e": 3}, "d": None})
    assert patched == {"a": {"c": 2, "e": 3}}
    assert merge_patch({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}


def test_list_get_and_selectors(server: StandInApiServer, api: PodGroupApi) -> None:
    server.store.create("a", "one", {"k": "v"}, {"team": "x"})
    server.store.create("b", "two", {}, {"team": "y"})
    items, rv = api.list(None, None)
    assert [i["metadata"]["name"] for i in items] == ["one", "two"] and rv == server.store.resource_version
    assert [i["metadata"]["name"] for i in api.list("b", None)[0]] == ["two"]
    assert [i["metadata"]["name"] for i in api.list(None, "team=x")[0]] == ["one"]
    assert [i["metadata"]["name"] for i in api.list(None, "team!=x")[0]] == ["two"]
    assert api.get("a", "one")["metadata"]["annotations"] == {"k": "v"}
    with pytest.raises(kube.NotFound):
        api.get("a", "missing")
    assert ("GET", "/apis/scheduling.volcano.sh/v1beta1/podgroups", {"labelSelector": "team=x"}) in server.requests


def test_conditional_merge_patch(server: StandInApiServer, api: PodGroupApi) -> None:
    obj = server.store.create("a", "one", {"keep": "1", "drop": "2"})
    rv = obj["metadata"]["resourceVersion"]
    patched = api.patch("a", "one", {"metadata": {"resourceVersion": rv, "annotations": {"drop": None, "new": "3"}}})
    assert patched["metadata"]["annotations"] == {"keep": "1", "new": "3"}
    assert patched["metadata"]["resourceVersion"] != rv
    with pytest.raises(kube.Conflict):  # the same stale version again
        api.patch("a", "one", {"metadata": {"resourceVersion": rv, "annotations": {"x": "1"}}})
    assert "x" not in server.store.annotations("a", "one")
    with pytest.raises(kube.NotFound):
        api.patch("a", "missing", {"metadata": {"annotations": {"x": "1"}}})


def test_a_write_that_changes_nothing_is_no_write(server: StandInApiServer) -> None:
    obj = server.store.create("a", "one", {"ProcessRecoverStatus": "retry-success"})
    again = server.store.patch_annotations("a", "one", {"ProcessRecoverStatus": "retry-success"})
    assert again["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]


def test_only_merge_patches_are_accepted(server: StandInApiServer) -> None:
    import urllib.error
    import urllib.request

    server.store.create("a", "one")
    request = urllib.request.Request(
        f"{server.url}/apis/scheduling.volcano.sh/v1beta1/namespaces/a/podgroups/one",
        data=b'{"metadata": {}}', method="PATCH", headers={"Content-Type": "application/strategic-merge-patch+json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=3)
    assert caught.value.code == 415


def test_watch_streams_changes_and_selector_transitions(server: StandInApiServer, api: PodGroupApi) -> None:
    server.store.create("a", "one", {}, {"team": "x"})
    _, rv = api.list("a", "team=x")
    stream = api.watch("a", "team=x", rv, timeout_seconds=5)
    server.store.patch_annotations("a", "one", {"k": "1"})
    server.store.patch_labels("a", "one", {"team": "y"})  # leaves the selection
    server.store.patch_labels("a", "one", {"team": "x"})  # comes back
    server.store.create("b", "other", {}, {"team": "x"})  # another namespace
    server.store.delete("a", "one")
    kinds = []
    for event in stream:
        kinds.append(event["type"])
        if len(kinds) == 4:
            stream.close()
    assert kinds == ["MODIFIED", "DELETED", "ADDED", "DELETED"]


def test_watch_expiry_as_event_and_as_http(server: StandInApiServer, api: PodGroupApi) -> None:
    server.store.create("a", "one")
    _, rv = api.list(None, None)
    server.store.patch_annotations("a", "one", {"k": "1"})
    server.store.compact()
    events = list(api.watch(None, None, rv, timeout_seconds=5))
    assert events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410
    server.expire_mode = "http"
    with pytest.raises(kube.Expired):
        api.watch(None, None, rv, timeout_seconds=5)
    stream = api.watch(None, None, server.store.resource_version, timeout_seconds=5)
    server.store.expire_watches()  # the watch is registered: api.watch has read its response headers
    assert [e["type"] for e in stream] == ["ERROR"]


def test_watch_ends_at_its_timeout(server: StandInApiServer, api: PodGroupApi) -> None:
    started = time.monotonic()
    assert list(api.watch(None, None, server.store.resource_version, timeout_seconds=1)) == []
    # The timing is the behaviour under test: the server ends the watch at its 1 s
    # timeout (never before); the 3 s ceiling only fails a watch that ignored it, and
    # leaves 2 s for a local HTTP read on a loaded machine.
    assert 0.9 < time.monotonic() - started < 3


def test_a_watch_that_ends_cleanly_leaves_its_connection_open(server: StandInApiServer) -> None:
    """The real apiserver (Go's server) keeps a connection alive after a watch's chunked body
    ends; a client pools it and sends its next request on it. A stand-in that closed it would
    fail that request (urllib3 retries no read), a failure the real server never causes."""
    import http.client
    import json

    server.store.create("a", "one")
    connection = http.client.HTTPConnection(server.host, server.port, timeout=5)
    try:
        connection.request("GET", f"/apis/scheduling.volcano.sh/v1beta1/podgroups?watch=1&timeoutSeconds=1"
                                  f"&resourceVersion={server.store.resource_version}")
        watch = connection.getresponse()
        assert watch.status == 200 and watch.read() == b""
        connection.request("GET", "/apis/scheduling.volcano.sh/v1beta1/namespaces/a/podgroups/one")
        got = connection.getresponse()
        assert got.status == 200 and json.loads(got.read())["metadata"]["name"] == "one"
    finally:
        connection.close()


def test_restart_drops_connections_and_refuses_for_a_while(server: StandInApiServer, api: PodGroupApi) -> None:
    server.store.create("a", "one")
    stream = api.watch(None, None, server.store.resource_version, timeout_seconds=10)
    # A restart is stop() then start(): "down" lasts exactly until the test brings it back
    stopping = threading.Thread(target=server.stop)
    stopping.start()
    with pytest.raises(kube.Unavailable):
        list(stream)
    stopping.join()
    with pytest.raises(kube.Unavailable):
        api.list(None, None)
    server.start()  # the same port
    assert [i["metadata"]["name"] for i in api.list(None, None)[0]] == ["one"]  # the data survived


def test_store_update_is_conditional() -> None:
    store = PodGroupStore()
    obj = store.create("a", "one", {"x": "1"})
    obj["metadata"]["annotations"]["x"] = "2"
    store.update(obj)
    obj["metadata"]["annotations"]["x"] = "3"
    with pytest.raises(Exception, match="modified"):
        store.update(obj)
    assert store.annotations("a", "one") == {"x": "2"}


def test_kubeconfig_path(server: StandInApiServer, tmp_path: Path) -> None:
    server.store.create("a", "one")
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: standin\n"
        f"clusters:\n- name: standin\n  cluster:\n    server: {server.url}\n"
        "users:\n- name: agent\n  user:\n    token: not-checked\n"
        "contexts:\n- name: standin\n  context:\n    cluster: standin\n    user: agent\n")
    api = PodGroupApi(kube.api_client(kubeconfig=str(path)), request_timeout=3)
    try:
        assert [i["metadata"]["name"] for i in api.list(None, None)[0]] == ["one"]
    finally:
        api.close()
