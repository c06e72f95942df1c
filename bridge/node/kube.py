"""Pods on this node and Events on them, through the official ``kubernetes`` client.

As MindCluster's own node daemons do (device-plugin, NodeD), the service learns its
node's pods by a list + watch with ``fieldSelector=spec.nodeName=<node>``; the opt-in
label selector narrows it to the jobs that asked for a bridge. Pods arrive as plain
dicts in the API's own shape (the client's JSON, not its models), like PodGroups do in
``bridge/core/kube.py``, whose error classes and watch stream this reuses.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bridge.core.kube import BoundedApi, WatchStream, kubernetes_module, classify, open_watch, watch_arguments

COMPONENT = "tft-bridge-node"


class CoreV1Calls:
    """The core/v1 calls the service makes (list or watch pods, get a pod, get its Node,
    create an Event), made through the ``ApiClient`` as the generated ``CoreV1Api`` makes
    them: the same path, query parameters, ``Accept``/``Content-Type``, ``BearerToken`` auth
    and, with ``_preload_content=False``, the same raw response or ``ApiException``; without
    loading the generated class's module, the largest share of the service's memory
    (docs/operations.md). Unknown keyword arguments raise ``KeyError``."""

    QUERY = {"field_selector": "fieldSelector", "label_selector": "labelSelector",
             "resource_version": "resourceVersion", "timeout_seconds": "timeoutSeconds", "watch": "watch",
             "allow_watch_bookmarks": "allowWatchBookmarks"}

    def __init__(self, client: Any) -> None:
        self._client = client

    def _call(self, method: str, path: str, path_params: dict[str, str], body: Any = None, *,
              _preload_content: bool = False, _request_timeout: Any = None, **params: Any) -> Any:
        assert not _preload_content, "raw responses only: the callers decode the JSON themselves"
        query = [(self.QUERY[key], value) for key, value in params.items() if value is not None]
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = self._client.param_serialize(method=method, resource_path=path, path_params=path_params,
                                               query_params=query, header_params=headers, body=body,
                                               auth_settings=["BearerToken"])
        response = self._client.call_api(*request, _request_timeout=_request_timeout)
        if not 200 <= response.status <= 299:
            response.read()
            raise kubernetes_module().client.exceptions.ApiException.from_response(http_resp=response, body=None,
                                                                             data=None)
        return response.response

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> Any:
        return self._call("GET", "/api/v1/pods", {}, **kwargs)

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> Any:
        return self._call("GET", "/api/v1/namespaces/{namespace}/pods", {"namespace": namespace}, **kwargs)

    def read_namespaced_pod(self, name: str, namespace: str, **kwargs: Any) -> Any:
        return self._call("GET", "/api/v1/namespaces/{namespace}/pods/{name}", {"namespace": namespace,
                                                                                "name": name}, **kwargs)

    def read_node(self, name: str, **kwargs: Any) -> Any:
        return self._call("GET", "/api/v1/nodes/{name}", {"name": name}, **kwargs)

    def create_namespaced_event(self, namespace: str, body: dict[str, Any], **kwargs: Any) -> Any:
        return self._call("POST", "/api/v1/namespaces/{namespace}/events", {"namespace": namespace}, body, **kwargs)


class PodApi(BoundedApi):
    """List, watch and get the pods bound to one node; post Events. Every call bounded."""

    def __init__(self, client: Any, node_name: str, request_timeout: float = 10.0,
                 connect_timeout: float = 5.0) -> None:
        super().__init__(client, request_timeout, connect_timeout)
        self._core = CoreV1Calls(client)
        self.node_name = node_name
        self.field_selector = f"spec.nodeName={node_name}"

    def list(self, namespace: str | None, selector: str | None) -> tuple[list[dict[str, Any]], str]:
        kwargs: dict[str, Any] = {"field_selector": self.field_selector, "_preload_content": False,
                                  "_request_timeout": self._timeouts()}
        if selector:
            kwargs["label_selector"] = selector
        try:
            if namespace:
                response = self._core.list_namespaced_pod(namespace, **kwargs)
            else:
                response = self._core.list_pod_for_all_namespaces(**kwargs)
            data = json.loads(response.data)
        except Exception as error:
            raise classify(error) from error
        items = [item for item in data.get("items") or [] if isinstance(item, dict)]
        return items, str((data.get("metadata") or {}).get("resourceVersion") or "")

    def watch(self, namespace: str | None, selector: str | None, resource_version: str,
              timeout_seconds: int) -> WatchStream:
        kwargs = watch_arguments(resource_version, timeout_seconds, self.connect_timeout, self.request_timeout)
        kwargs["field_selector"] = self.field_selector
        if selector:
            kwargs["label_selector"] = selector
        if namespace:
            return open_watch(self._core.list_namespaced_pod, namespace, **kwargs)
        return open_watch(self._core.list_pod_for_all_namespaces, **kwargs)

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        """One pod by name (NotFound when it is gone): the positive evidence a stop needs."""
        try:
            response = self._core.read_namespaced_pod(name, namespace, _preload_content=False,
                                                      _request_timeout=self._timeouts())
            return dict(json.loads(response.data))
        except Exception as error:
            raise classify(error) from error

    def node(self, name: str) -> dict[str, Any]:
        """The Node ``name`` (NotFound when the cluster has none of that name)."""
        try:
            response = self._core.read_node(name, _preload_content=False, _request_timeout=self._timeouts())
            return dict(json.loads(response.data))
        except Exception as error:
            raise classify(error) from error

    def event(self, pod: dict[str, Any], reason: str, message: str, kind: str = "Warning") -> None:
        """A core/v1 Event on ``pod`` (what ``kubectl describe pod`` shows)."""
        meta = pod.get("metadata") or {}
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name', 'pod')}.", "namespace": meta.get("namespace")},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta.get("name"),
                               "namespace": meta.get("namespace"), "uid": meta.get("uid")},
            "reason": reason, "message": message[:1024], "type": kind,
            "source": {"component": COMPONENT, "host": self.node_name},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "reportingComponent": COMPONENT, "reportingInstance": self.node_name,
        }
        try:
            self._core.create_namespaced_event(meta.get("namespace"), body, _preload_content=False,
                                               _request_timeout=self._timeouts())
        except Exception as error:
            raise classify(error) from error


SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
#: Where the unit's LoadCredential=kubeconfig:... puts the file (systemd >= 247).
CREDENTIALS_DIRECTORY = "/run/credentials/"
NEXT_STEP = ("write it with contrib/kubernetes/node-kubeconfig.sh (it waits for the ServiceAccount's token), install "
             "it as /etc/tft-bridge/node-kubeconfig, then systemctl restart tft-bridge-node")


def credentials_problem(kubeconfig: str, context: str, server: str, config_path: str,
                        env: Mapping[str, str] | None = None) -> str | None:
    """Why the service would have no usable Kubernetes credentials, naming the file and the
    next step (None: they look usable; the API server has the last word). Read once at start."""
    if server:
        return None
    if not kubeconfig:
        environ = os.environ if env is None else env
        if environ.get("KUBERNETES_SERVICE_HOST") and Path(SERVICE_ACCOUNT_TOKEN).is_file():
            return None
        return (f"{config_path}: kubernetes.kubeconfig is not set and this is not a pod with a service account: set "
                f"it to the node's kubeconfig ({NEXT_STEP})")
    path = Path(kubeconfig)
    if not path.is_file():
        if kubeconfig.startswith(CREDENTIALS_DIRECTORY):
            return (f"{kubeconfig} (kubernetes.kubeconfig in {config_path}) does not exist: the unit's "
                    f"LoadCredential=kubeconfig:/etc/tft-bridge/node-kubeconfig did not deliver it. Check the drop-in "
                    f"(systemctl cat tft-bridge-node) and that its source file exists; LoadCredential= needs systemd "
                    f"247 or later (docs/node-service.md, 'Credentials and RBAC', has the fallback). {NEXT_STEP}")
        return f"{kubeconfig} (kubernetes.kubeconfig in {config_path}) does not exist: {NEXT_STEP}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        return f"{kubeconfig} (kubernetes.kubeconfig in {config_path}) cannot be read: {error}"
    try:
        import yaml

        document = yaml.safe_load(text)
    except Exception as error:  # yaml.YAMLError; or PyYAML missing with the client
        return f"{kubeconfig} is not a kubeconfig (YAML): {error}: {NEXT_STEP}"
    if not document:
        return f"{kubeconfig} is empty: {NEXT_STEP}"
    if not isinstance(document, dict):
        return f"{kubeconfig} is not a kubeconfig (expected a mapping with clusters, users, contexts): {NEXT_STEP}"
    wanted = context or str(document.get("current-context") or "")
    contexts = {str(c.get("name")): c.get("context") or {} for c in document.get("contexts") or []
                if isinstance(c, dict)}
    if not wanted or wanted not in contexts:
        return (f"{kubeconfig} has no context {wanted!r} (kubernetes.context, else its current-context; it has "
                f"{', '.join(sorted(contexts)) or 'none'}): {NEXT_STEP}")
    user_name = str(contexts[wanted].get("user") or "")
    users = {str(u.get("name")): u.get("user") or {} for u in document.get("users") or [] if isinstance(u, dict)}
    user = users.get(user_name)
    if user is None:
        return f"{kubeconfig}: context {wanted!r} names user {user_name!r}, which it does not define: {NEXT_STEP}"
    if not any(user.get(key) for key in ("token", "tokenFile", "client-certificate", "client-certificate-data",
                                         "exec", "auth-provider", "username")):
        return (f"{kubeconfig}: user {user_name!r} has no token (an empty token: the ServiceAccount's token Secret "
                f"was not filled yet when the file was written). Wait until `kubectl -n tft-bridge get secret "
                f"tft-bridge-node-token -o jsonpath='{{.data.token}}'` prints a token, then {NEXT_STEP}")
    return None
