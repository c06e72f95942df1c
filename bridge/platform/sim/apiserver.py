"""An in-process stand-in for the Kubernetes API server: PodGroups, Pods and Events.

It speaks the real paths and semantics the agent depends on, over real HTTP/1.1 on
loopback, so the official ``kubernetes`` client talks to it unmodified:

* ``GET /apis/scheduling.volcano.sh/v1beta1[/namespaces/{ns}]/podgroups``: a list with
  ``metadata.resourceVersion``; ``labelSelector`` (equality terms: ``k=v``, ``k==v``,
  ``k!=v``, ``k``, ``!k``).
* the same with ``watch=1``: chunked JSON lines ``{"type", "object"}`` from
  ``resourceVersion`` on (history replayed), ``ADDED`` for every object when no
  resourceVersion is given, ``timeoutSeconds`` honoured; an object that stops matching
  the selector is sent as ``DELETED``, one that starts matching as ``ADDED``.
* ``GET|PATCH|PUT|DELETE .../namespaces/{ns}/podgroups/{name}``; PATCH accepts only
  ``application/merge-patch+json`` (RFC 7386: ``null`` deletes a key) and answers 415
  otherwise, as the real server does for custom resources; a ``metadata.resourceVersion``
  in the patch or the PUT body that is not the current one is a 409 Conflict.
* A write that changes nothing is not a write: no new resourceVersion, no event (the
  real server's behaviour, and the reason a status written twice is invisible).
* Watch expiry: :meth:`PodGroupStore.compact` makes older resourceVersions answer 410
  (as an ``ERROR`` event carrying a ``Status``, or as HTTP 410 with
  ``expire_mode="http"``); :meth:`PodGroupStore.expire_watches` ends every open watch
  with that ``ERROR`` event; :meth:`StandInApiServer.expire_next_watch` refuses the
  next watch request that way.
* A restart is :meth:`StandInApiServer.stop` (every connection dropped, new ones
  refused) then :meth:`StandInApiServer.start`, which listens again on the same port with
  the same data (etcd survives). The caller decides how long it stays down.

* Pods (``/api/v1[/namespaces/{ns}]/pods``, ``.../pods/{name}``) with the same list,
  watch, get, patch and delete, and ``fieldSelector`` equality terms on any dotted path
  (``spec.nodeName=node-1``, what every MindCluster node daemon watches with). A pod that
  starts matching the field selector (bound to the node) is sent as ``ADDED``.
* Events: ``POST /api/v1/namespaces/{ns}/events`` (``metadata.generateName`` honoured)
  and their list; :meth:`PodGroupStore.events_for` shows what was recorded on an object.
* A slow server: :attr:`StandInApiServer.delay` holds every request that long before
  it is answered (a watch's events are not delayed once it is open).

Not simulated: authentication, other resources, set-based selectors,
``limit``/``continue`` paging, server-side apply, bookmarks (accepted, never sent).
"""

from __future__ import annotations

import copy
import json
import logging
import queue
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

log = logging.getLogger("tft_bridge.platform.sim.apiserver")

GROUP_VERSION = "scheduling.volcano.sh/v1beta1"
PREFIX = "/apis/" + GROUP_VERSION
CORE_PREFIX = "/api/v1"
PODGROUPS = "podgroups"
PODS = "pods"
EVENTS = "events"
#: resource -> (apiVersion, kind, the path prefix it is served under)
RESOURCES: dict[str, tuple[str, str, str]] = {
    PODGROUPS: (GROUP_VERSION, "PodGroup", PREFIX),
    PODS: ("v1", "Pod", CORE_PREFIX),
    EVENTS: ("v1", "Event", CORE_PREFIX),
}


def _kind_name(resource: str) -> str:
    return f"{resource}.scheduling.volcano.sh" if resource == PODGROUPS else resource


class ApiError(Exception):
    """An API error answered as a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    def status(self) -> dict[str, Any]:
        return status_object(self.code, self.reason, self.message)


def status_object(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def gone(rv: str) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {rv}")


# --------------------------------------------------------------------------- selectors


@dataclass(frozen=True)
class Selector:
    """An equality-based label selector."""

    terms: tuple[tuple[str, str, str], ...] = ()  # (op, key, value), op in = != exists !exists

    @classmethod
    def parse(cls, text: str | None) -> Selector:
        terms: list[tuple[str, str, str]] = []
        for raw in (text or "").split(","):
            term = raw.strip()
            if not term:
                continue
            if "(" in term or " in " in term or " notin " in term:
                raise ApiError(400, "BadRequest", f"unsupported selector term {term!r}")
            if "!=" in term:
                key, value = term.split("!=", 1)
                terms.append(("!=", key.strip(), value.strip()))
            elif "==" in term:
                key, value = term.split("==", 1)
                terms.append(("=", key.strip(), value.strip()))
            elif "=" in term:
                key, value = term.split("=", 1)
                terms.append(("=", key.strip(), value.strip()))
            elif term.startswith("!"):
                terms.append(("!exists", term[1:].strip(), ""))
            else:
                terms.append(("exists", term, ""))
        return cls(tuple(terms))

    def matches(self, labels: Mapping[str, str]) -> bool:
        for op, key, value in self.terms:
            if op == "=" and labels.get(key) != value:
                return False
            if op == "!=" and labels.get(key) == value:
                return False
            if op == "exists" and key not in labels:
                return False
            if op == "!exists" and key in labels:
                return False
        return True


@dataclass(frozen=True)
class FieldSelector:
    """Equality terms on dotted paths (``spec.nodeName=node-1``, ``status.phase!=Failed``)."""

    terms: tuple[tuple[str, str, str], ...] = ()  # (op, path, value), op in = !=

    @classmethod
    def parse(cls, text: str | None) -> FieldSelector:
        terms: list[tuple[str, str, str]] = []
        for raw in (text or "").split(","):
            term = raw.strip()
            if not term:
                continue
            op = "!=" if "!=" in term else "==" if "==" in term else "=" if "=" in term else ""
            if not op:
                raise ApiError(400, "BadRequest", f"invalid field selector term {term!r}")
            path, value = term.split(op, 1)
            terms.append(("!=" if op == "!=" else "=", path.strip(), value.strip()))
        return cls(tuple(terms))

    def matches(self, obj: Mapping[str, Any] | None) -> bool:
        for op, path, value in self.terms:
            current: Any = obj or {}
            for part in path.split("."):
                current = current.get(part) if isinstance(current, Mapping) else None
            text = "" if current is None else str(current)
            if (op == "=") != (text == value):
                return False
        return True


def _labels(obj: Mapping[str, Any] | None) -> Mapping[str, str]:
    if not obj:
        return {}
    return obj.get("metadata", {}).get("labels") or {}


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


@dataclass
class Watcher:
    namespace: str | None
    selector: Selector
    resource: str = PODGROUPS
    fields: FieldSelector = FieldSelector()
    events: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)

    def sees(self, obj: Mapping[str, Any] | None) -> bool:
        return obj is not None and self.selector.matches(_labels(obj)) and self.fields.matches(obj)

    def offer(self, resource: str, kind: str, old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> None:
        """Queue ``kind`` for ``new`` as this watcher sees it (resource, namespace, selectors)."""
        if resource != self.resource:
            return
        if self.namespace is not None and new["metadata"]["namespace"] != self.namespace:
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


class PodGroupStore:
    """The stand-in's objects (PodGroups, and Pods and Events beside them) with one
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

    # ----------------------------------------------------------------- reads

    @property
    def resource_version(self) -> str:
        with self._lock:
            return str(self._rv)

    def get(self, namespace: str, name: str, resource: str = PODGROUPS) -> dict[str, Any]:
        with self._lock:
            obj = self._objects.get((resource, namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{_kind_name(resource)} "{name}" not found')
            return copy.deepcopy(obj)

    def annotations(self, namespace: str, name: str) -> dict[str, str]:
        return dict(self.get(namespace, name)["metadata"].get("annotations") or {})

    def list(self, namespace: str | None, selector: Selector = Selector(), resource: str = PODGROUPS,
             fields: FieldSelector = FieldSelector()) -> tuple[list[dict[str, Any]], str]:
        with self._lock:
            items = [copy.deepcopy(obj) for (kind, ns, _), obj in sorted(self._objects.items())
                     if kind == resource and (namespace is None or ns == namespace)
                     and selector.matches(_labels(obj)) and fields.matches(obj)]
            return items, str(self._rv)

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
        """Create ``obj`` (a Pod, an Event, a PodGroup): the server sets uid,
        creationTimestamp and resourceVersion, and a name from ``generateName``."""
        new = copy.deepcopy(dict(obj))
        meta = new.setdefault("metadata", {})
        api_version, kind, _ = RESOURCES[resource]
        new.setdefault("apiVersion", api_version)
        new.setdefault("kind", kind)
        with self._lock:
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
            namespace, name = meta.get("namespace") or "", meta.get("name") or ""
            if not name:
                raise ApiError(422, "Invalid", "metadata.name: Required value")
            if (resource, namespace, name) in self._objects:
                raise ApiError(409, "AlreadyExists", f'{_kind_name(resource)} "{name}" already exists')
            meta["uid"] = meta.get("uid") or str(uuid.uuid4())
            meta["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            return self._commit(resource, "ADDED", None, new)

    def patch(self, namespace: str, name: str, patch: Mapping[str, Any],
              resource: str = PODGROUPS) -> dict[str, Any]:
        """A merge patch; ``metadata.resourceVersion`` in it is a precondition."""
        with self._lock:
            current = self._current(resource, namespace, name)
            body = copy.deepcopy(dict(patch))
            meta = body.get("metadata")
            if isinstance(meta, dict) and "resourceVersion" in meta:
                wanted = meta.pop("resourceVersion")
                self._check_rv(resource, current, wanted, name)
            for immutable in ("name", "namespace", "uid"):
                if isinstance(meta, dict) and meta.get(immutable, current["metadata"][immutable]) \
                        != current["metadata"][immutable]:
                    raise ApiError(422, "Invalid", f"metadata.{immutable} is immutable")
            return self._commit(resource, "MODIFIED", current, merge_patch(current, body))

    def patch_annotations(self, namespace: str, name: str, changes: Mapping[str, str | None]) -> dict[str, Any]:
        """An unconditional annotation patch (how ClusterD writes ProcessConfirmFault)."""
        return self.patch(namespace, name, {"metadata": {"annotations": dict(changes)}})

    def patch_labels(self, namespace: str, name: str, changes: Mapping[str, str | None]) -> dict[str, Any]:
        return self.patch(namespace, name, {"metadata": {"labels": dict(changes)}})

    def update(self, obj: Mapping[str, Any], resource: str = PODGROUPS) -> dict[str, Any]:
        """PUT: the whole object; a non-empty ``metadata.resourceVersion`` must be current."""
        meta = obj.get("metadata") or {}
        namespace, name = meta.get("namespace", ""), meta.get("name", "")
        with self._lock:
            current = self._current(resource, namespace, name)
            if meta.get("resourceVersion"):
                self._check_rv(resource, current, meta["resourceVersion"], name)
            new = copy.deepcopy(dict(obj))
            for immutable in ("uid", "creationTimestamp"):
                new["metadata"][immutable] = current["metadata"][immutable]
            return self._commit(resource, "MODIFIED", current, new)

    def delete(self, namespace: str, name: str, resource: str = PODGROUPS) -> dict[str, Any]:
        with self._lock:
            current = self._current(resource, namespace, name)
            del self._objects[(resource, namespace, name)]
            self._rv += 1
            gone_obj = copy.deepcopy(current)
            gone_obj["metadata"]["resourceVersion"] = str(self._rv)
            self._publish(resource, "DELETED", current, gone_obj)
            return copy.deepcopy(gone_obj)

    # ----------------------------------------------------------------- watch control

    def subscribe(self, namespace: str | None, selector: Selector, from_rv: str | None,
                  resource: str = PODGROUPS, fields: FieldSelector = FieldSelector()) -> Watcher:
        """A watcher fed from ``from_rv`` on (or ADDED for everything when it is None/"0")."""
        watcher = Watcher(namespace, selector, resource, fields)
        with self._lock:
            if from_rv in (None, "", "0"):
                for obj in self.list(namespace, selector, resource, fields)[0]:
                    watcher.events.put({"type": "ADDED", "object": obj})
            else:
                try:
                    start = int(from_rv)
                except ValueError:
                    raise ApiError(400, "BadRequest", f"invalid resourceVersion {from_rv!r}") from None
                if start < self._oldest:
                    raise gone(from_rv)
                for rv, kind_of, kind, old, new in self._history:
                    if rv > start:
                        watcher.offer(kind_of, kind, old, new)
            self._watchers.append(watcher)
        return watcher

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
            raise ApiError(404, "NotFound", f'{_kind_name(resource)} "{name}" not found')
        return obj

    @staticmethod
    def _check_rv(resource: str, current: Mapping[str, Any], wanted: object, name: str) -> None:
        if str(wanted) != current["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict",
                           f'Operation cannot be fulfilled on {_kind_name(resource)} "{name}": '
                           "the object has been modified; please apply your changes to the latest "
                           "version and try again")

    def _commit(self, resource: str, kind: str, old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
        if old is not None and _same(old, new):
            return copy.deepcopy(old)  # a no-op write: no new resourceVersion, no event
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        meta = new["metadata"]
        self._objects[(resource, meta["namespace"], meta["name"])] = new
        self._publish(resource, kind, old, new)
        return copy.deepcopy(new)

    def _publish(self, resource: str, kind: str, old: dict[str, Any] | None, new: dict[str, Any]) -> None:
        snapshot = copy.deepcopy(new)
        self._history.append((self._rv, resource, kind, copy.deepcopy(old) if old else None, snapshot))
        for watcher in self._watchers:
            watcher.offer(resource, kind, old, snapshot)


def _same(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    def strip(obj: Mapping[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(dict(obj))
        out.get("metadata", {}).pop("resourceVersion", None)
        for key in ("annotations", "labels"):
            if not out.get("metadata", {}).get(key):
                out.get("metadata", {}).pop(key, None)
        return out

    return strip(old) == strip(new)


# --------------------------------------------------------------------------- HTTP


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HttpServer
    timeout = 30  # idle keep-alive connections are dropped after this long

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("%s %s", self.address_string(), format % args)

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._track(self.connection, add=False)

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
        if owner.delay > 0 and owner._closing.wait(owner.delay):
            self.close_connection = True
            return
        try:
            resource, namespace, name = _route(url.path)
            api_version, kind, _ = RESOURCES[resource]
            body = self._body() if method in ("PATCH", "PUT", "POST") else None
            hook = owner.before_write
            if hook is not None and method in ("PATCH", "PUT") and namespace and name:
                hook(namespace, name, body)
            if method == "GET" and name is None:
                fields = FieldSelector.parse(query.get("fieldSelector"))
                if query.get("watch") in ("1", "true", "True"):
                    self._watch(resource, namespace, query, fields)
                    return
                items, rv = owner.store.list(namespace, Selector.parse(query.get("labelSelector")), resource, fields)
                self._send(200, {"apiVersion": api_version, "kind": f"{kind}List",
                                 "metadata": {"resourceVersion": rv}, "items": items})
            elif method == "GET" and name is not None and namespace is not None:
                self._send(200, owner.store.get(namespace, name, resource))
            elif method == "POST" and name is None and namespace is not None:
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", f"the body must be a {kind}")
                meta = body.setdefault("metadata", {})
                if meta.get("namespace", namespace) != namespace:
                    raise ApiError(400, "BadRequest", "the namespace of the object does not match the request")
                meta["namespace"] = namespace
                self._send(201, owner.store.create_object(resource, body))
            elif method == "PATCH" and name is not None and namespace is not None:
                content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
                if content_type != "application/merge-patch+json" and not (
                        resource != PODGROUPS and content_type == "application/strategic-merge-patch+json"):
                    raise ApiError(415, "UnsupportedMediaType",
                                   f"the body of the request was in an unknown format - accepted media types "
                                   f"include: application/json-patch+json, application/merge-patch+json, "
                                   f"application/apply-patch+yaml (got {content_type!r})")
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "a merge patch must be a JSON object")
                self._send(200, owner.store.patch(namespace, name, body, resource))
            elif method == "PUT" and name is not None and namespace is not None:
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", f"the body must be a {kind}")
                body.setdefault("metadata", {}).update(namespace=namespace, name=name)
                self._send(200, owner.store.update(body, resource))
            elif method == "DELETE" and name is not None and namespace is not None:
                self._send(200, owner.store.delete(namespace, name, resource))
            else:
                raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {url.path}")
        except ApiError as error:
            self._send(error.code, error.status())
        except (ConnectionError, OSError):
            self.close_connection = True

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw or b"null")
        except ValueError:
            raise ApiError(400, "BadRequest", "the body is not JSON") from None

    def _send(self, code: int, payload: Mapping[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # ----------------------------------------------------------------- watch

    def _watch(self, resource: str, namespace: str | None, query: Mapping[str, str], fields: FieldSelector) -> None:
        owner = self.server.owner
        selector = Selector.parse(query.get("labelSelector"))
        rv = query.get("resourceVersion")
        try:
            if rv not in (None, "", "0") and owner._take_expiry():
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
        # A watch that ends cleanly (its timeout, an ERROR event) leaves the connection open for
        # the next request, as the real apiserver's Go server does; a client's pooled connection
        # closed under it would fail its next GET (urllib3 does not retry a read).
        ended_cleanly = False
        try:
            self._start_stream()
            while not owner._closing.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    break
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
            self.close_connection = not ended_cleanly

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def _chunk(self, event: Mapping[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _route(path: str) -> tuple[str, str | None, str | None]:
    """(resource, namespace or None for cluster-wide, name or None) for a served path."""
    for resource, (_, _, prefix) in RESOURCES.items():
        if path.rstrip("/") == f"{prefix}/{resource}":
            return resource, None, None
        if path.startswith(prefix + "/namespaces/"):
            parts = path[len(prefix) + 1:].rstrip("/").split("/")
            if len(parts) == 3 and parts[2] == resource:
                return resource, unquote(parts[1]), None
            if len(parts) == 4 and parts[2] == resource:
                return resource, unquote(parts[1]), unquote(parts[3])
    raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], owner: StandInApiServer) -> None:
        self.owner = owner
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up mid-request (a watch closed, a timeout) is not news."""
        log.debug("connection from %s ended with an error", client_address, exc_info=True)


class StandInApiServer:
    """The HTTP front of a :class:`PodGroupStore` on loopback; start/stop (a restart is both)."""

    def __init__(self, store: PodGroupStore | None = None, host: str = "127.0.0.1", port: int = 0,
                 expire_mode: str = "event") -> None:
        self.store = store if store is not None else PodGroupStore()
        self.host = host
        self.port = port
        #: "event": an expired resourceVersion is an ERROR event; "http": an HTTP 410.
        self.expire_mode = expire_mode
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        #: Seconds every request is held before it is answered (a slow or overloaded server).
        self.delay = 0.0
        #: Called as ``hook(namespace, name, body)`` before an HTTP PATCH or PUT is applied
        #: (tests use it to make a concurrent change, so the write meets a really stale
        #: resourceVersion). The simulated ClusterD writes to the store directly, unhooked.
        self.before_write: Callable[[str, str, Any], None] | None = None
        self._server: _HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        self._expire_next = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> StandInApiServer:
        self._closing.clear()
        self._server = _HttpServer((self.host, self.port), self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"standin-apiserver:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and drop every connection (watches included)."""
        self._closing.set()
        self.store.close_watches()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._conn_lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

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

    def requests_matching(self, method: str, contains: str = "") -> list[tuple[str, str, dict[str, str]]]:
        return [r for r in list(self.requests) if r[0] == method and contains in r[1]]

    def __enter__(self) -> StandInApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

