"""An in-process stand-in for the Kubernetes API server: PodGroups, Pods, Nodes and Events.

It speaks the real paths and semantics the agent and the node service depend on, over
real HTTP/1.1 (or HTTPS with bearer tokens) on loopback, so the official ``kubernetes``
client talks to it unmodified, and it refuses what the real server refuses:

* Lists (``GET /apis/scheduling.volcano.sh/v1beta1[/namespaces/{ns}]/podgroups``,
  ``/api/v1[/namespaces/{ns}]/pods``, ``/api/v1/nodes``, events) with
  ``metadata.resourceVersion``; ``limit``/``continue`` paging (``metadata.continue``,
  ``remainingItemCount``); built-in resources' list items carry no ``kind``/``apiVersion``
  (custom resources' do), as the real server's typed lists.
* Selectors parsed as the real server parses them (``selectors.py``): set-based label
  terms (``in``, ``notin``, ``key``, ``!key``), a malformed selector a 400, a field
  selector on a field the resource does not declare selectable (``status.hostIP``) a 400.
* Watches (``watch=1``): chunked JSON lines ``{"type", "object"}`` from
  ``resourceVersion`` on (history replayed), ``ADDED`` for every object when no
  resourceVersion is given, ``timeoutSeconds`` honoured; an object that stops matching
  the selector is sent as ``DELETED``, one that starts matching as ``ADDED``; with
  ``allowWatchBookmarks=true`` a ``BOOKMARK`` every :attr:`StandInApiServer.bookmark_interval`.
  ``resourceVersion=abc`` is a 500, as the real server answers it.
* ``GET|PATCH|PUT|DELETE .../{name}``; PATCH takes ``application/merge-patch+json`` (and,
  for built-in resources, ``strategic-merge-patch+json``: lists keyed by name merge) and
  answers 415 otherwise; a ``metadata.resourceVersion`` in the patch or the PUT body that
  is not the current one is a 409 Conflict. A write that changes nothing is not a write
  (no new resourceVersion, no event).
* Pods as the real registry keeps them: ``status`` dropped on create (``phase: Pending``);
  written only through ``pods/{name}/status`` (PATCH/PUT; the status inside a patch of
  the pod itself is ignored); ``spec.nodeName`` set only through ``pods/{name}/binding``
  (POST a ``Binding``; 409 if already bound); any other change of the spec, and setting
  ``metadata.deletionTimestamp``, a 422; a pod without containers a 422. Graceful
  deletion: DELETE of a bound, non-terminal pod sets ``deletionTimestamp`` and
  ``deletionGracePeriodSeconds`` (``gracePeriodSeconds`` of the request, else the pod's
  ``terminationGracePeriodSeconds``, else 30) and sends MODIFIED; the pod is removed
  (DELETED) when a DELETE with ``gracePeriodSeconds=0`` comes (the kubelet's, once the
  containers ended) or its grace period has passed (:meth:`PodGroupStore.sweep`, run by
  the server standing in for the kubelet and the pod garbage collector).
* Events: ``POST /api/v1/namespaces/{ns}/events`` (``metadata.generateName`` honoured); an
  ``involvedObject.namespace`` other than the Event's namespace, or missing outside
  ``default``, is a 422.
  :meth:`PodGroupStore.events_for` shows what was recorded on an object.
* Errors are ``Status`` objects with ``reason``, ``code`` and ``details`` (name, group,
  kind; ``causes`` for a 422). A request body is read before any answer, so an error
  never leaves it on the keep-alive connection.
* Authentication and authorisation, when configured: HTTPS with the given certificate,
  ``Authorization: Bearer <token>`` mapped to a user (none or unknown: 401), and the
  user's RBAC rules (``{"apiGroups", "resources", "verbs"}``, as a ClusterRole writes
  them) deciding each request (denied: 403).
* Watch expiry: :meth:`PodGroupStore.compact` makes older resourceVersions answer 410
  (as an ``ERROR`` event carrying a ``Status``, or as HTTP 410 with
  ``expire_mode="http"``); :meth:`PodGroupStore.expire_watches` ends every open watch
  with that ``ERROR`` event; :meth:`StandInApiServer.expire_next_watch` refuses the
  next watch request that way.
* A graceful stop, :meth:`StandInApiServer.terminate`, is kube-apiserver's SIGTERM with
  its default settings: the listener closes at once (new connections refused), idle
  keep-alive connections are closed, a request in flight is answered (then its
  connection closed), and open watches stay open and keep streaming until
  ``shutdown_timeout`` (60 s, the real server's ``--request-timeout``) has passed or
  :meth:`StandInApiServer.kill` comes (the supervisor's SIGKILL); then they are cut
  without the end of their chunked body, as the process exit cuts them.
  :meth:`StandInApiServer.kill` (and :meth:`StandInApiServer.stop`, its name for
  teardowns) cuts every connection at once. A restart is one of them then
  :meth:`StandInApiServer.start`, which listens again on the same port with the same
  data (etcd survives). The caller decides how long it stays down.
* A slow server: :attr:`StandInApiServer.delay` holds every request that long before
  it is answered (a watch's events are not delayed once it is open).

Every write records its manager in ``metadata.managedFields`` (the request's User-Agent up
to its first ``/``; ``sim`` for direct store writes), with coarse field sets.

Not simulated: other resources, server-side apply, exact ``managedFields`` field sets, a ``continue``
served from the snapshot of its first page (later pages read the current objects), the
``--shutdown-delay-duration`` window (0 by default) and the 503/429 answers of the
non-default shutdown modes.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import queue
import socket
import ssl
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from bridge.sim.kube.selectors import FieldSelector, LabelSelector, SelectorError

log = logging.getLogger("bridge.sim.kube.apiserver")

GROUP_VERSION = "scheduling.volcano.sh/v1beta1"
PREFIX = "/apis/" + GROUP_VERSION
CORE_PREFIX = "/api/v1"
PODGROUPS = "podgroups"
PODS = "pods"
EVENTS = "events"
NODES = "nodes"
#: resource -> (apiVersion, kind, the path prefix it is served under)
RESOURCES: dict[str, tuple[str, str, str]] = {
    PODGROUPS: (GROUP_VERSION, "PodGroup", PREFIX),
    PODS: ("v1", "Pod", CORE_PREFIX),
    EVENTS: ("v1", "Event", CORE_PREFIX),
    NODES: ("v1", "Node", CORE_PREFIX),
}
CLUSTER_SCOPED = frozenset({NODES})
#: Built-in resources: typed lists whose items carry no kind/apiVersion.
BUILT_IN = frozenset({PODS, EVENTS, NODES})
DEFAULT_GRACE_SECONDS = 30
#: kube-apiserver's http.Server.Shutdown bound: ShutdownTimeout = --request-timeout (60 s).
DEFAULT_SHUTDOWN_TIMEOUT = 60.0

Selector = LabelSelector  # the name the tests and the agent's helpers know

#: The field manager of the write this thread is making (set by the HTTP handler per request).
_WRITER = threading.local()


def _kind_name(resource: str) -> str:
    return f"{resource}.scheduling.volcano.sh" if resource == PODGROUPS else resource


def _group(resource: str) -> str:
    return GROUP_VERSION.split("/")[0] if resource == PODGROUPS else ""


class ApiError(Exception):
    """An API error answered as a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = dict(details) if details else None

    def status(self) -> dict[str, Any]:
        return status_object(self.code, self.reason, self.message, self.details)


def status_object(code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}
    if details:
        status["details"] = dict(details)
    return status


def _details(resource: str, name: str = "", **extra: Any) -> dict[str, Any]:
    details: dict[str, Any] = {"name": name} if name else {}
    if _group(resource):
        details["group"] = _group(resource)
    details["kind"] = resource
    details.update(extra)
    return details


def not_found(resource: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{_kind_name(resource)} "{name}" not found', _details(resource, name))


def invalid(resource: str, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """A 422: ``causes`` are (field, reason, message), e.g. ("spec.containers", "FieldValueRequired", ...)."""
    kind = RESOURCES[resource][1]
    text = ", ".join(f"{path}: {message}" for path, _, message in causes)
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {text}',
                    {"name": name, **({"group": _group(resource)} if _group(resource) else {}), "kind": kind,
                     "causes": [{"reason": reason, "message": message, "field": path}
                                for path, reason, message in causes]})


def gone(rv: str) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {rv}")


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def _resource_version(text: str) -> int:
    """A resourceVersion query parameter as the server reads it: not a number is a 500."""
    try:
        value = int(text)
        if value < 0:
            raise ValueError
        return value
    except ValueError:
        raise ApiError(500, "InternalError", f'Internal error occurred: strconv.ParseUint: parsing "{text}": '
                       "invalid syntax", {"causes": [{"message": f'strconv.ParseUint: parsing "{text}": '
                                                                  "invalid syntax"}]}) from None


def _labels(obj: Mapping[str, Any] | None) -> Mapping[str, str]:
    if not obj:
        return {}
    return obj.get("metadata", {}).get("labels") or {}


def _now_text(offset: float = 0.0) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + offset))


# --------------------------------------------------------------------------- store


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """A strategic merge patch as far as pods need it: a merge patch, except that lists of
    objects keyed by ``name`` (containers, env, volumes, ports) merge item by item."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        current = result.get(key)
        if value is None:
            result.pop(key, None)
        elif _named_list(value) and _named_list(current):
            merged = {item["name"]: item for item in copy.deepcopy(current)}
            for item in value:
                merged[item["name"]] = strategic_merge_patch(merged.get(item["name"]), item)
            result[key] = list(merged.values())
        else:
            result[key] = strategic_merge_patch(current, value)
    return result


def _named_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, dict) and "name" in i for i in value)


@dataclass
class Watcher:
    """One open watch: what it selects, and its event queue (filled under the store's lock by
    any writer's thread, drained by the watch's handler thread; None ends it)."""


    namespace: str | None
    selector: LabelSelector
    resource: str = PODGROUPS
    fields: FieldSelector = FieldSelector()
    events: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)

    def sees(self, obj: Mapping[str, Any] | None) -> bool:
        return obj is not None and self.selector.matches(_labels(obj)) and self.fields.matches(obj)

    def offer(self, resource: str, kind: str, old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> None:
        """Queue ``kind`` for ``new`` as this watcher sees it (resource, namespace, selectors)."""
        if resource != self.resource:
            return
        if self.namespace is not None and new["metadata"].get("namespace", "") != self.namespace:
            return
        was = self.sees(old)
        now = self.sees(new)
        if kind == "DELETED":
            if was or now:
                self.events.put({"type": "DELETED", "object": copy.deepcopy(new)})
            return
        if now:
            self.events.put({"type": "MODIFIED" if was else "ADDED", "object": copy.deepcopy(new)})
        elif was:
            self.events.put({"type": "DELETED", "object": copy.deepcopy(new)})


def _spec_without_mutable(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A pod spec without what an update may change (container images, activeDeadlineSeconds,
    tolerations): two specs that differ after this differ where the real server says 422."""
    out = copy.deepcopy(dict(spec))
    out.pop("activeDeadlineSeconds", None)
    out.pop("tolerations", None)
    for key in ("containers", "initContainers"):
        for container in out.get(key) or []:
            if isinstance(container, dict):
                container.pop("image", None)
    return out


def _validate_pod(pod: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    spec = pod.get("spec")
    if not isinstance(spec, Mapping):
        return [("spec.containers", "FieldValueRequired", "Required value")]
    containers = spec.get("containers")
    if not isinstance(containers, list) or not containers:
        return [("spec.containers", "FieldValueRequired", "Required value")]
    causes = []
    for index, container in enumerate(containers):
        if not isinstance(container, Mapping) or not container.get("name"):
            causes.append((f"spec.containers[{index}].name", "FieldValueRequired", "Required value"))
        elif not container.get("image"):
            causes.append((f"spec.containers[{index}].image", "FieldValueRequired", "Required value"))
    return causes


def _validate_event(event: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """core/v1 Event validation: ``involvedObject.namespace`` must be the Event's, or
    missing only for an Event in ``default`` (and ``kube-system`` for one with an eventTime)."""
    namespace = (event.get("metadata") or {}).get("namespace") or ""
    theirs = (event.get("involvedObject") or {}).get("namespace") or ""
    if theirs == namespace:
        return []
    lenient = ("", "default", "kube-system") if event.get("eventTime") else ("", "default")
    if not theirs and namespace in lenient:
        return []
    return [("involvedObject.namespace", "FieldValueInvalid",
             f'Invalid value: "{theirs}": does not match event.namespace')]


class PodGroupStore:
    """The stand-in's objects (PodGroups, and Pods, Nodes and Events beside them) with one
    resourceVersion counter, an event history and live watchers; thread-safe. The
    methods without a ``resource`` argument are PodGroup methods, as before."""

    def __init__(self, history_limit: int = 10_000) -> None:
        self._lock = threading.RLock()
        self._rv = 100
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (resource, namespace, name)
        # (rv, resource, type, previous object or None, object)
        self._history: deque[tuple[int, str, str, dict[str, Any] | None, dict[str, Any]]] = deque(
            maxlen=history_limit)
        self._oldest = self._rv  # watches from below this rv get 410
        self._watchers: list[Watcher] = []
        self._deadlines: dict[tuple[str, str], float] = {}  # terminating pod -> monotonic end of its grace

    # ----------------------------------------------------------------- reads

    @property
    def resource_version(self) -> str:
        with self._lock:
            return str(self._rv)

    def get(self, namespace: str, name: str, resource: str = PODGROUPS) -> dict[str, Any]:
        with self._lock:
            obj = self._objects.get((resource, namespace, name))
            if obj is None:
                raise not_found(resource, name)
            return copy.deepcopy(obj)

    def annotations(self, namespace: str, name: str) -> dict[str, str]:
        return dict(self.get(namespace, name)["metadata"].get("annotations") or {})

    def list(self, namespace: str | None, selector: LabelSelector = LabelSelector(), resource: str = PODGROUPS,
             fields: FieldSelector = FieldSelector()) -> tuple[list[dict[str, Any]], str]:
        with self._lock:
            items = [copy.deepcopy(obj) for (kind, ns, _), obj in sorted(self._objects.items())
                     if kind == resource and (namespace is None or ns == namespace)
                     and selector.matches(_labels(obj)) and fields.matches(obj)]
            return items, str(self._rv)

    def page(self, namespace: str | None, selector: LabelSelector, resource: str, fields: FieldSelector,
             limit: int, token: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """One page of a list (``limit`` 0: all) after ``token`` ("" = the first page), and the
        list's metadata: resourceVersion, and ``continue``/``remainingItemCount`` when more remain."""
        with self._lock:
            rv, after = self._rv, ""
            if token:
                try:
                    decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
                    rv, after = int(decoded["rv"]), str(decoded["start"])
                except (ValueError, KeyError, TypeError):
                    raise bad_request("continue key is not valid: illegal base64 data") from None
                if rv < self._oldest:
                    raise ApiError(410, "Expired", "The provided continue parameter is too old to display a "
                                   "consistent list result. You can start a new list without the continue "
                                   "parameter.")
            keyed = [("/".join((ns, name)), obj) for (kind, ns, name), obj in sorted(self._objects.items())
                     if kind == resource and (namespace is None or ns == namespace)
                     and selector.matches(_labels(obj)) and fields.matches(obj)]
            keyed = [(key, obj) for key, obj in keyed if key > after]
            chosen = keyed[:limit] if limit > 0 else keyed
            metadata: dict[str, Any] = {"resourceVersion": str(rv)}
            if limit > 0 and len(keyed) > limit:
                last = chosen[-1][0]
                metadata["continue"] = base64.urlsafe_b64encode(
                    json.dumps({"rv": rv, "start": last}).encode()).decode()
                metadata["remainingItemCount"] = len(keyed) - limit
            return [copy.deepcopy(obj) for _, obj in chosen], metadata

    def events_for(self, uid: str) -> list[dict[str, Any]]:
        """The Events recorded with ``involvedObject.uid == uid``, oldest first."""
        with self._lock:
            return [copy.deepcopy(obj) for (kind, _, _), obj in self._objects.items()
                    if kind == EVENTS and (obj.get("involvedObject") or {}).get("uid") == uid]

    # ----------------------------------------------------------------- writes

    def create(self, namespace: str, name: str, annotations: Mapping[str, str] | None = None,
               labels: Mapping[str, str] | None = None) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "apiVersion": GROUP_VERSION,
            "kind": "PodGroup",
            "metadata": {"name": name, "namespace": namespace,
                         "annotations": dict(annotations or {}), "labels": dict(labels or {})},
            "spec": {"minMember": 1},
            "status": {"phase": "Running"},
        }
        return self.create_object(PODGROUPS, obj)

    def create_object(self, resource: str, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create ``obj`` (a Pod, an Event, a Node, a PodGroup): the server sets uid,
        creationTimestamp and resourceVersion, and a name from ``generateName``; a Pod's
        status is the server's (``Pending``), never the caller's."""
        new = copy.deepcopy(dict(obj))
        meta = new.setdefault("metadata", {})
        api_version, kind, _ = RESOURCES[resource]
        new["apiVersion"], new["kind"] = api_version, kind
        if resource in CLUSTER_SCOPED:
            meta.pop("namespace", None)
        with self._lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
            namespace, name = meta.get("namespace") or "", meta.get("name") or ""
            if not name:
                raise invalid(resource, "", [("metadata.name", "FieldValueRequired", "Required value: name or "
                                                                                      "generateName is required")])
            if resource == PODS:
                causes = _validate_pod(new)
                if causes:
                    raise invalid(resource, name, causes)
                new["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
                new["spec"].setdefault("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
                new["spec"].setdefault("schedulerName", "default-scheduler")
            elif resource == EVENTS:
                causes = _validate_event(new)
                if causes:
                    raise invalid(resource, name, causes)
            if (resource, namespace, name) in self._objects:
                raise ApiError(409, "AlreadyExists", f'{_kind_name(resource)} "{name}" already exists',
                               _details(resource, name))
            for server_owned in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion", "managedFields"):
                meta.pop(server_owned, None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now_text()
            return self._commit(resource, "ADDED", None, new)

    def patch(self, namespace: str, name: str, patch: Mapping[str, Any],
              resource: str = PODGROUPS, subresource: str = "", strategic: bool = False) -> dict[str, Any]:
        """A merge patch (``strategic``: lists keyed by name merged) of the object or
        (``subresource="status"``) of its status; ``metadata.resourceVersion`` in it is a precondition."""
        with self._lock:
            current = self._current(resource, namespace, name)
            body = copy.deepcopy(dict(patch))
            meta = body.get("metadata")
            if isinstance(meta, dict) and "resourceVersion" in meta:
                wanted = meta.pop("resourceVersion")
                self._check_rv(resource, current, wanted, name)
            merged = strategic_merge_patch(current, body) if strategic else merge_patch(current, body)
            return self._write(resource, current, merged, subresource)

    def patch_annotations(self, namespace: str, name: str, changes: Mapping[str, str | None]) -> dict[str, Any]:
        """An unconditional annotation patch (how ClusterD writes ProcessConfirmFault)."""
        return self.patch(namespace, name, {"metadata": {"annotations": dict(changes)}})

    def patch_labels(self, namespace: str, name: str, changes: Mapping[str, str | None]) -> dict[str, Any]:
        return self.patch(namespace, name, {"metadata": {"labels": dict(changes)}})

    def update(self, obj: Mapping[str, Any], resource: str = PODGROUPS, subresource: str = "") -> dict[str, Any]:
        """PUT: the whole object (or its status); a non-empty ``metadata.resourceVersion`` must be current."""
        meta = obj.get("metadata") or {}
        namespace, name = meta.get("namespace", "") or "", meta.get("name", "")
        with self._lock:
            current = self._current(resource, namespace, name)
            if meta.get("resourceVersion"):
                self._check_rv(resource, current, meta["resourceVersion"], name)
            return self._write(resource, current, copy.deepcopy(dict(obj)), subresource)

    def bind(self, namespace: str, name: str, node: str) -> dict[str, Any]:
        """``pods/{name}/binding``: what the scheduler does; the only way to set ``spec.nodeName``."""
        with self._lock:
            current = self._current(PODS, namespace, name)
            if current["metadata"].get("deletionTimestamp"):
                raise ApiError(409, "Conflict", f"Operation cannot be fulfilled on pods/binding \"{name}\": pod "
                               f"{name} is being deleted, cannot be assigned to a host", _details("pods/binding", name))
            if current["spec"].get("nodeName"):
                raise ApiError(409, "Conflict", f"Operation cannot be fulfilled on pods/binding \"{name}\": pod "
                               f"{name} is already assigned to node \"{current['spec']['nodeName']}\"",
                               _details("pods/binding", name))
            new = copy.deepcopy(current)
            new["spec"]["nodeName"] = node
            conditions = [c for c in new["status"].get("conditions") or [] if c.get("type") != "PodScheduled"]
            new["status"]["conditions"] = [*conditions, {"type": "PodScheduled", "status": "True",
                                                         "lastTransitionTime": _now_text()}]
            return self._commit(PODS, "MODIFIED", current, new, "binding")

    def delete(self, namespace: str, name: str, resource: str = PODGROUPS,
               grace_seconds: int | None = None) -> dict[str, Any]:
        """DELETE. A bound, running pod is deleted gracefully: ``deletionTimestamp`` set
        (MODIFIED), removed by a later delete with ``grace_seconds=0`` or by :meth:`sweep`
        once its grace period has passed. Anything else is removed at once (DELETED)."""
        with self._lock:
            current = self._current(resource, namespace, name)
            if resource == PODS:
                grace = grace_seconds if grace_seconds is not None else int(
                    current["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))
                phase = (current.get("status") or {}).get("phase")
                if not current["spec"].get("nodeName") or phase in ("Succeeded", "Failed"):
                    grace = 0
                if grace > 0:
                    meta = current["metadata"]
                    if meta.get("deletionTimestamp") and int(meta.get("deletionGracePeriodSeconds") or 0) <= grace:
                        return copy.deepcopy(current)  # already terminating, at least this soon
                    new = copy.deepcopy(current)
                    new["metadata"]["deletionTimestamp"] = _now_text(grace)
                    new["metadata"]["deletionGracePeriodSeconds"] = grace
                    self._deadlines[(namespace, name)] = time.monotonic() + grace
                    return self._commit(resource, "MODIFIED", current, new)
            return self._remove(resource, namespace, name)

    def sweep(self, now: float | None = None) -> int:
        """Remove every terminating pod whose grace period has passed (the kubelet and the
        pod garbage collector of the real cluster); how many were removed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [key for key, deadline in self._deadlines.items() if deadline <= now]
            for namespace, name in due:
                if (PODS, namespace, name) in self._objects:
                    self._remove(PODS, namespace, name)
                else:
                    self._deadlines.pop((namespace, name), None)
            return len(due)

    # ----------------------------------------------------------------- watch control

    def subscribe(self, namespace: str | None, selector: LabelSelector, from_rv: str | None,
                  resource: str = PODGROUPS, fields: FieldSelector = FieldSelector()) -> Watcher:
        """A watcher fed from ``from_rv`` on (or ADDED for everything when it is None/"0")."""
        watcher = Watcher(namespace, selector, resource, fields)
        with self._lock:
            if from_rv in (None, "", "0"):
                for obj in self.list(namespace, selector, resource, fields)[0]:
                    watcher.events.put({"type": "ADDED", "object": obj})
            else:
                start = _resource_version(from_rv)
                if start < self._oldest:
                    raise gone(from_rv)
                for rv, kind_of, kind, old, new in self._history:
                    if rv > start:
                        watcher.offer(kind_of, kind, old, new)
            self._watchers.append(watcher)
        return watcher

    def bookmark(self, watcher: Watcher) -> str | None:
        """The resourceVersion a BOOKMARK may carry now: the current one, when ``watcher``
        has been sent everything up to it (nothing queued); else None."""
        with self._lock:
            return str(self._rv) if watcher.events.empty() else None

    def unsubscribe(self, watcher: Watcher) -> None:
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def compact(self) -> None:
        """Forget the history: a watch from any older resourceVersion now gets 410."""
        with self._lock:
            self._history.clear()
            self._oldest = self._rv

    def expire_watches(self) -> None:
        """End every open watch with an ERROR event (Status 410), as etcd compaction does."""
        with self._lock:
            watchers, self._watchers = self._watchers, []
            for watcher in watchers:
                watcher.events.put({"type": "ERROR", "object": gone(str(self._oldest)).status()})

    def close_watches(self) -> None:
        with self._lock:
            watchers, self._watchers = self._watchers, []
            for watcher in watchers:
                watcher.events.put(None)

    @property
    def watcher_count(self) -> int:
        with self._lock:
            return len(self._watchers)

    # ----------------------------------------------------------------- internals

    def _current(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self._objects.get((resource, namespace, name))
        if obj is None:
            raise not_found(resource, name)
        return obj

    @staticmethod
    def _check_rv(resource: str, current: Mapping[str, Any], wanted: object, name: str) -> None:
        if str(wanted) != current["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict",
                           f'Operation cannot be fulfilled on {_kind_name(resource)} "{name}": '
                           "the object has been modified; please apply your changes to the latest "
                           "version and try again", _details(resource, name))

    def _write(self, resource: str, current: dict[str, Any], new: dict[str, Any], subresource: str) -> dict[str, Any]:
        """An update of ``current`` to ``new`` under the real server's rules: identity and
        server-owned metadata kept; for a pod, its status only through the status
        subresource, its spec and a deletion never through an update."""
        name = current["metadata"]["name"]
        if subresource not in ("", "status"):
            raise not_found(resource, name)
        meta = new.setdefault("metadata", {})
        old_meta = current["metadata"]
        for immutable in ("name", "namespace", "uid"):
            if immutable in meta and meta[immutable] != old_meta.get(immutable, meta[immutable]) and meta[immutable]:
                raise invalid(resource, name, [(f"metadata.{immutable}", "FieldValueInvalid",
                                                "field is immutable")])
        if meta.get("deletionTimestamp") and not old_meta.get("deletionTimestamp"):
            raise invalid(resource, name, [("metadata.deletionTimestamp", "FieldValueInvalid",
                                            "field is immutable; may only be changed via deletion")])
        for owned in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "namespace",
                      "managedFields"):
            if owned in old_meta:
                meta[owned] = old_meta[owned]
            else:
                meta.pop(owned, None)
        new["apiVersion"], new["kind"] = current["apiVersion"], current["kind"]
        if resource == PODS:
            if subresource == "status":
                new = {**copy.deepcopy(current), "status": new.get("status") or {}}
            else:
                new["status"] = copy.deepcopy(current.get("status") or {})
                spec = new.get("spec") if isinstance(new.get("spec"), dict) else {}
                if _spec_without_mutable(spec) != _spec_without_mutable(current["spec"]):
                    field_name = "spec.nodeName" if spec.get("nodeName") != current["spec"].get("nodeName") \
                        else "spec"
                    raise invalid(resource, name, [(field_name, "FieldValueForbidden",
                                                    "Forbidden: pod updates may not change fields other than "
                                                    "`spec.containers[*].image`, `spec.initContainers[*].image`, "
                                                    "`spec.activeDeadlineSeconds`, `spec.tolerations` (only "
                                                    "additions to existing tolerations)")])
        return self._commit(resource, "MODIFIED", current, new, subresource)

    def _remove(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        current = self._objects.pop((resource, namespace, name))
        if resource == PODS:
            self._deadlines.pop((namespace, name), None)
        self._rv += 1
        gone_obj = copy.deepcopy(current)
        gone_obj["metadata"]["resourceVersion"] = str(self._rv)
        self._publish(resource, "DELETED", current, gone_obj)
        return copy.deepcopy(gone_obj)

    def _commit(self, resource: str, kind: str, old: dict[str, Any] | None, new: dict[str, Any],
                subresource: str = "") -> dict[str, Any]:
        if old is not None and _same(old, new):
            return copy.deepcopy(old)  # a no-op write: no new resourceVersion, no event
        _record_manager(new, old, subresource)
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        meta = new["metadata"]
        self._objects[(resource, meta.get("namespace") or "", meta["name"])] = new
        self._publish(resource, kind, old, new)
        return copy.deepcopy(new)

    def _publish(self, resource: str, kind: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        snapshot = copy.deepcopy(new)
        self._history.append((self._rv, resource, kind, copy.deepcopy(old) if old else None, snapshot))
        for watcher in self._watchers:
            watcher.offer(resource, kind, old, snapshot)


def _record_manager(new: dict[str, Any], old: Mapping[str, Any] | None, subresource: str) -> None:
    """Add (or renew) the writing manager's entry in ``metadata.managedFields``."""
    manager = getattr(_WRITER, "manager", "") or "sim"
    touched = sorted(key for key in new if key not in ("apiVersion", "kind")
                     and (old is None or new.get(key) != old.get(key)))
    entry: dict[str, Any] = {"manager": manager, "operation": "Update", "apiVersion": new.get("apiVersion", "v1"),
                             "time": _now_text(), "fieldsType": "FieldsV1",
                             "fieldsV1": {f"f:{key}": {} for key in touched}}
    if subresource:
        entry["subresource"] = subresource
    entries = [e for e in new["metadata"].get("managedFields") or []
               if (e.get("manager"), e.get("subresource", "")) != (manager, subresource)]
    new["metadata"]["managedFields"] = [*entries, entry]


def _same(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    def strip(obj: Mapping[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(dict(obj))
        out.get("metadata", {}).pop("resourceVersion", None)
        out.get("metadata", {}).pop("managedFields", None)
        for key in ("annotations", "labels"):
            if not out.get("metadata", {}).get(key):
                out.get("metadata", {}).pop(key, None)
        return out

    return strip(old) == strip(new)


# --------------------------------------------------------------------------- HTTP

_VERBS = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}


@dataclass(frozen=True)
class Route:
    resource: str
    namespace: str | None  # None: every namespace (or a cluster-scoped resource)
    name: str | None
    subresource: str = ""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HttpServer
    timeout = 30  # idle keep-alive connections are dropped after this long

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection, add=True)
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.settimeout(self.timeout)
            self.connection.do_handshake()

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._track(self.connection, add=False)

    def parse_request(self) -> bool:
        """A request line arrived: the connection is busy until its answer is sent."""
        self.server.owner._mark_busy(self.connection, True)
        return super().parse_request()

    def handle_one_request(self) -> None:
        super().handle_one_request()
        owner = self.server.owner
        owner._mark_busy(self.connection, False)
        if owner._terminating.is_set():
            self.close_connection = True  # no keep-alive once a graceful stop began

    def _closing_header(self) -> None:
        if self.server.owner._terminating.is_set():
            self.send_header("Connection", "close")

    # ----------------------------------------------------------------- dispatch

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        owner = self.server.owner
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        owner.requests.append((method, url.path, query))
        try:
            raw = self._read_body()  # always, first: an early error must not leave it on the connection
        except (ConnectionError, OSError, ValueError):
            self.close_connection = True
            return
        if owner.delay > 0 and owner._closing.wait(owner.delay):
            self.close_connection = True
            return
        try:
            user = self._authenticate()
            route = _route(url.path)
            watching = query.get("watch") in ("1", "true", "True")
            self._authorize(user, method, route, watching)
            body = _json_body(raw) if method in ("PATCH", "PUT", "POST") else None
            _WRITER.manager = (self.headers.get("User-Agent") or "unknown").split("/")[0]
            try:
                self._serve(method, route, query, body, raw, watching)
            finally:
                _WRITER.manager = ""
        except ApiError as error:
            self._send(error.code, error.status())
        except SelectorError as error:
            self._send(400, bad_request(str(error)).status())
        except (ConnectionError, OSError):
            self.close_connection = True

    def _serve(self, method: str, route: Route, query: Mapping[str, str], body: Any, raw: bytes,
               watching: bool) -> None:
        owner = self.server.owner
        resource, namespace, name, sub = route.resource, route.namespace, route.name, route.subresource
        api_version, kind, _ = RESOURCES[resource]
        hook = owner.before_write
        if hook is not None and method in ("PATCH", "PUT") and namespace and name:
            hook(namespace, name, body)
        if method == "GET" and name is None:
            fields = FieldSelector.parse(query.get("fieldSelector"), resource)
            selector = LabelSelector.parse(query.get("labelSelector"))
            if watching:
                self._watch(resource, namespace, query, selector, fields)
                return
            if query.get("resourceVersion"):
                _resource_version(query["resourceVersion"])
            limit = _int_param(query, "limit")
            items, metadata = owner.store.page(namespace, selector, resource, fields, limit,
                                               query.get("continue") or "")
            if resource in BUILT_IN:
                for item in items:
                    item.pop("kind", None)
                    item.pop("apiVersion", None)
            self._send(200, {"apiVersion": api_version, "kind": f"{kind}List", "metadata": metadata,
                             "items": items})
        elif method == "GET" and name is not None and not sub:
            self._send(200, owner.store.get(namespace or "", name, resource))
        elif method == "GET" and name is not None and sub == "status" and resource == PODS:
            self._send(200, owner.store.get(namespace or "", name, resource))
        elif method == "POST" and name is None and (namespace is not None or resource in CLUSTER_SCOPED):
            if not isinstance(body, dict):
                raise bad_request(f"the body must be a {kind}")
            meta = body.setdefault("metadata", {})
            if resource not in CLUSTER_SCOPED:
                if meta.get("namespace", namespace) != namespace:
                    raise bad_request("the namespace of the provided object does not match the namespace sent on "
                                      "the request")
                meta["namespace"] = namespace
            self._send(201, owner.store.create_object(resource, body))
        elif method == "POST" and resource == PODS and sub == "binding" and namespace and name:
            if not isinstance(body, dict) or not isinstance(body.get("target"), dict):
                raise invalid(PODS, name, [("target", "FieldValueRequired", "Required value")])
            target = body["target"]
            if target.get("kind") not in (None, "", "Node") or not target.get("name"):
                raise invalid(PODS, name, [("target.kind", "FieldValueNotSupported",
                                            'Unsupported value: must be empty or "Node"')])
            owner.store.bind(namespace, name, str(target["name"]))
            self._send(201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                             "code": 201})
        elif method == "PATCH" and name is not None and sub in ("", "status"):
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
            if content_type == "application/json-patch+json":
                raise ApiError(415, "UnsupportedMediaType", "json-patch is not supported by this stand-in")
            if content_type != "application/merge-patch+json" and not (
                    resource in BUILT_IN and content_type == "application/strategic-merge-patch+json"):
                raise ApiError(415, "UnsupportedMediaType",
                               f"the body of the request was in an unknown format - accepted media types "
                               f"include: application/json-patch+json, application/merge-patch+json, "
                               f"application/apply-patch+yaml (got {content_type!r})")
            if not isinstance(body, dict):
                raise bad_request("a merge patch must be a JSON object")
            self._send(200, owner.store.patch(namespace or "", name, body, resource, sub,
                                              strategic=content_type == "application/strategic-merge-patch+json"))
        elif method == "PUT" and name is not None and sub in ("", "status"):
            if not isinstance(body, dict):
                raise bad_request(f"the body must be a {kind}")
            meta = body.setdefault("metadata", {})
            if meta.get("name", name) != name:
                raise bad_request("the name of the object does not match the name on the URL")
            meta.update(namespace=namespace or "", name=name)
            self._send(200, owner.store.update(body, resource, sub))
        elif method == "DELETE" and name is not None and not sub:
            options = _json_body(raw) if raw else None
            grace: int | None = None
            if isinstance(options, dict) and options.get("gracePeriodSeconds") is not None:
                grace = int(options["gracePeriodSeconds"])
            if query.get("gracePeriodSeconds"):
                grace = _int_param(query, "gracePeriodSeconds")
            self._send(200, owner.store.delete(namespace or "", name, resource, grace))
        else:
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on the requested "
                                                    f"resource ({method} {self.path})")

    # ----------------------------------------------------------------- auth

    def _authenticate(self) -> str:
        """The user the request's bearer token names ("" when the server checks no tokens)."""
        tokens = self.server.owner.tokens
        if tokens is None:
            return ""
        header = self.headers.get("Authorization") or ""
        scheme, _, token = header.partition(" ")
        user = tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if user is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return user

    def _authorize(self, user: str, method: str, route: Route, watching: bool) -> None:
        rbac = self.server.owner.rbac
        if rbac is None:
            return
        if method == "GET":
            verb = "watch" if watching else "get" if route.name is not None else "list"
        else:
            verb = _VERBS.get(method, method.lower())
        resource = route.resource + (f"/{route.subresource}" if route.subresource else "")
        group = _group(route.resource)
        for rule in rbac.get(user, []):
            if (group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", [])) \
                    and (resource in rule.get("resources", []) or "*" in rule.get("resources", [])) \
                    and (verb in rule.get("verbs", []) or "*" in rule.get("verbs", [])) \
                    and (not rule.get("resourceNames") or route.name in rule["resourceNames"]):
                return
        scope = f'in the namespace "{route.namespace}"' if route.namespace else "at the cluster scope"
        named = f'{resource} "{route.name}"' if route.name else resource
        raise ApiError(403, "Forbidden", f'{named} is forbidden: User "{user}" cannot {verb} resource '
                                         f'"{resource}" in API group "{group}" {scope}',
                       _details(route.resource, route.name or ""))

    # ----------------------------------------------------------------- bodies

    def _read_body(self) -> bytes:
        if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, code: int, payload: Mapping[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self._closing_header()
        self.end_headers()
        self.wfile.write(data)

    # ----------------------------------------------------------------- watch

    def _watch(self, resource: str, namespace: str | None, query: Mapping[str, str], selector: LabelSelector,
               fields: FieldSelector) -> None:
        owner = self.server.owner
        rv = query.get("resourceVersion")
        bookmarks = query.get("allowWatchBookmarks") in ("1", "true", "True")
        try:
            if rv not in (None, "", "0"):
                _resource_version(rv)
                if owner._take_expiry():
                    raise gone(rv)
            watcher = owner.store.subscribe(namespace, selector, rv, resource, fields)
        except ApiError as error:
            if error.code != 410 or owner.expire_mode == "http":
                raise
            self._start_stream()
            self._chunk({"type": "ERROR", "object": error.status()})
            self._end_stream()
            return
        timeout = float(query.get("timeoutSeconds") or 0) or None
        deadline = None if timeout is None else time.monotonic() + timeout
        api_version, kind, _ = RESOURCES[resource]
        next_bookmark = time.monotonic() + owner.bookmark_interval
        # A watch that ends cleanly (its timeout, an ERROR event) leaves the connection open for
        # the next request, as the real apiserver's Go server does; a client's pooled connection
        # closed under it would fail its next GET (urllib3 does not retry a read).
        ended_cleanly = False
        try:
            self._start_stream()
            while not owner._closing.is_set():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                if bookmarks and now >= next_bookmark:
                    next_bookmark = now + owner.bookmark_interval
                    version = owner.store.bookmark(watcher)
                    if version is not None:
                        self._chunk({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api_version,
                                                                    "metadata": {"resourceVersion": version}}})
                try:
                    event = watcher.events.get(timeout=0.05)
                except queue.Empty:
                    continue
                if event is None:
                    break
                self._chunk(event)
                if event["type"] == "ERROR":
                    break
            if not owner._closing.is_set():
                self._end_stream()
                ended_cleanly = True
        except OSError:
            pass
        finally:
            owner.store.unsubscribe(watcher)
            self.close_connection = not ended_cleanly or owner._terminating.is_set()

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self._closing_header()
        self.end_headers()
        self.wfile.flush()

    def _chunk(self, event: Mapping[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _json_body(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError:
        raise bad_request("the body is not JSON") from None


def _int_param(query: Mapping[str, str], name: str) -> int:
    text = query.get(name) or "0"
    try:
        return int(text)
    except ValueError:
        raise bad_request(f"{name}: invalid value {text!r}: not an integer") from None


def _route(path: str) -> Route:
    """The resource, namespace, name and subresource a served path names."""
    for resource, (_, _, prefix) in RESOURCES.items():
        if path.rstrip("/") == f"{prefix}/{resource}":
            return Route(resource, None, None)
        if resource in CLUSTER_SCOPED and path.startswith(f"{prefix}/{resource}/"):
            parts = path[len(prefix) + 1:].rstrip("/").split("/")
            if len(parts) == 2:
                return Route(resource, None, unquote(parts[1]))
        elif path.startswith(prefix + "/namespaces/"):
            parts = path[len(prefix) + 1:].rstrip("/").split("/")
            if len(parts) >= 3 and parts[2] == resource:
                if len(parts) == 3:
                    return Route(resource, unquote(parts[1]), None)
                if len(parts) == 4:
                    return Route(resource, unquote(parts[1]), unquote(parts[3]))
                if len(parts) == 5 and resource == PODS and parts[4] in ("status", "binding"):
                    return Route(resource, unquote(parts[1]), unquote(parts[3]), parts[4])
    raise ApiError(404, "NotFound", "the server could not find the requested resource", {"causes": [
        {"reason": "UnexpectedServerResponse", "message": "404 page not found"}]})


def _cut(conn: socket.socket) -> None:
    """End a connection as a process exit does: both directions, no more bytes."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], owner: StandInApiServer) -> None:
        self.owner = owner
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, address = super().get_request()
        context = self.owner._tls
        if context is not None:  # the handshake runs on the connection's own thread (setup)
            conn = context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        return conn, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up mid-request (a watch closed, a timeout) is not news."""
        log.debug("connection from %s ended with an error", client_address, exc_info=True)


class StandInApiServer:
    """The HTTP(S) front of a :class:`PodGroupStore` on loopback; start/stop (a restart is both).

    ``certfile``/``keyfile``: serve HTTPS with that certificate. ``tokens``: bearer token ->
    user name, every request authenticated (401 otherwise). ``rbac``: user name -> RBAC
    rules, every request authorised (403 otherwise). ``shutdown_timeout``: how long
    :meth:`terminate` keeps open watches."""

    def __init__(self, store: PodGroupStore | None = None, host: str = "127.0.0.1", port: int = 0,
                 expire_mode: str = "event", *, certfile: str | None = None, keyfile: str | None = None,
                 tokens: Mapping[str, str] | None = None,
                 rbac: Mapping[str, list[Mapping[str, Any]]] | None = None,
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        self.store = store if store is not None else PodGroupStore()
        self.host = host
        self.port = port
        #: "event": an expired resourceVersion is an ERROR event; "http": an HTTP 410.
        self.expire_mode = expire_mode
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        #: Seconds every request is held before it is answered (a slow or overloaded server).
        self.delay = 0.0
        #: Seconds between BOOKMARKs on a watch that asked for them (the real server: about a minute).
        self.bookmark_interval = 1.0
        #: How often terminating pods whose grace period has passed are removed.
        self.sweep_interval = 0.1
        #: Called as ``hook(namespace, name, body)`` before an HTTP PATCH or PUT is applied
        #: (tests use it to make a concurrent change, so the write meets a really stale
        #: resourceVersion). The simulated ClusterD writes to the store directly, unhooked.
        self.before_write: Callable[[str, str, Any], None] | None = None
        #: How long a graceful stop keeps open watches before it cuts them.
        self.shutdown_timeout = shutdown_timeout
        self.tokens = dict(tokens) if tokens is not None else None
        self.rbac = {user: [dict(rule) for rule in rules] for user, rules in rbac.items()} \
            if rbac is not None else None
        self._tls: ssl.SSLContext | None = None
        if certfile:
            self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self._tls.load_cert_chain(certfile, keyfile)
        self._server: _HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._sweeper: threading.Thread | None = None
        #: Set by kill (and a graceful stop's end): watches end, delayed requests are dropped.
        self._closing = threading.Event()
        #: Set by terminate and kill: no keep-alive, answers carry ``Connection: close``.
        self._terminating = threading.Event()
        self._terminator: threading.Thread | None = None
        self._listening = False
        # The handler threads add and remove their connections; terminate/kill read them.
        self._connections: set[socket.socket] = set()
        self._busy: set[socket.socket] = set()  # connections with a request being answered
        self._conn_lock = threading.Lock()
        self._expire_next = False

    @property
    def url(self) -> str:
        return f"{'https' if self._tls else 'http'}://{self.host}:{self.port}"

    def start(self) -> StandInApiServer:
        """Listen (again: the same port, the same data). After :meth:`terminate`, waits
        until that stop has ended, as a restart waits for the old process to exit."""
        self.wait_stopped()
        self._closing.clear()
        self._terminating.clear()
        self._server = _HttpServer((self.host, self.port), self)
        self.port = self._server.server_address[1]
        self._listening = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"standin-apiserver:{self.port}", daemon=True)
        self._thread.start()
        self._sweeper = threading.Thread(target=self._sweep, name=f"standin-apiserver-gc:{self.port}", daemon=True)
        self._sweeper.start()
        return self

    def _sweep(self) -> None:
        while not self._closing.wait(self.sweep_interval):
            self.store.sweep()

    def terminate(self, shutdown_timeout: float | None = None) -> None:
        """A graceful stop (kube-apiserver's SIGTERM, default settings); returns at once.

        The listener closes now (new connections refused) and idle keep-alive connections
        are closed; a request in flight is answered with ``Connection: close``; open
        watches keep streaming until ``shutdown_timeout`` (default: the constructor's)
        has passed or :meth:`kill` is called, then every connection is cut. Called from
        the test's thread; the cut runs on a thread of its own."""
        if self._server is None or self._terminating.is_set():
            return
        grace = self.shutdown_timeout if shutdown_timeout is None else shutdown_timeout
        self._terminating.set()
        self._stop_listening()
        with self._conn_lock:
            idle = [conn for conn in self._connections if conn not in self._busy]
        for conn in idle:
            _cut(conn)
        self._terminator = threading.Thread(target=self._end_after, args=(grace,),
                                            name=f"standin-apiserver-term:{self.port}", daemon=True)
        self._terminator.start()

    def _end_after(self, grace: float) -> None:
        if not self._closing.wait(grace):
            self.kill()

    def kill(self) -> None:
        """Cut every connection now (watches included) and stop listening: the process
        killed, or a graceful stop's end. Safe to call at any time, more than once."""
        self._terminating.set()
        self._closing.set()
        self.store.close_watches()
        self._stop_listening()
        with self._conn_lock:
            connections = list(self._connections)
        for conn in connections:
            _cut(conn)
        server, self._server = self._server, None
        if server is not None:
            server.server_close()  # joins the handler threads, which the cut connections end
        for thread in (self._sweeper, self._thread):  # the reverse of start
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5)
        self._thread = self._sweeper = None

    def stop(self) -> None:
        """Stop listening and drop every connection (watches included): :meth:`kill`."""
        self.kill()
        self.wait_stopped()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait for a graceful stop to end (no stop under way: at once); True when it has."""
        terminator = self._terminator
        if terminator is not None and terminator is not threading.current_thread():
            terminator.join(timeout)
            if terminator.is_alive():
                return False
        self._terminator = None
        return True

    @property
    def listening(self) -> bool:
        return self._listening

    def _stop_listening(self) -> None:
        with self._conn_lock:
            server = self._server if self._listening else None
            self._listening = False
        if server is not None:
            server.shutdown()
            server.socket.close()

    def _mark_busy(self, conn: socket.socket, busy: bool) -> None:
        with self._conn_lock:
            if busy:
                self._busy.add(conn)
            else:
                self._busy.discard(conn)

    def expire_next_watch(self) -> None:
        """Answer the next watch from a resourceVersion with 410, as a server whose watch
        cache was just re-initialised does (an ERROR event or HTTP 410, per ``expire_mode``)."""
        with self._conn_lock:
            self._expire_next = True

    def _take_expiry(self) -> bool:
        with self._conn_lock:
            expire, self._expire_next = self._expire_next, False
            return expire

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._conn_lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)
                self._busy.discard(conn)

    def requests_matching(self, method: str, contains: str = "") -> list[tuple[str, str, dict[str, str]]]:
        return [r for r in list(self.requests) if r[0] == method and contains in r[1]]

    def __enter__(self) -> StandInApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
