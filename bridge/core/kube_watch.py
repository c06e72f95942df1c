"""List-then-watch of one kind of Kubernetes object on a thread of its own, surviving
expiry and API server restarts: the platform agent's PodGroups, the node service's pods.

:class:`ListWatcher` is the classic reflector over any :class:`ListWatchApi`: list (the
full state and the resourceVersion to watch from) and deliver it whole as
:class:`Listed`; watch from there and deliver each event as :class:`Changed`, keeping the
newest resourceVersion (BOOKMARKs included); the server ends the watch: watch again;
410 Gone (an ERROR event or an HTTP status): list again at once; refused, broken, timed
out or 5xx: back off (jittered, capped) and list again.

Thread: ``deliver`` is called on the watch thread, in order; the owner makes it a
thread-safe hand-over. ``on_death`` is called on the watch thread if the loop itself
fails (a bug); a requested stop never calls it. :meth:`ListWatcher.stop` interrupts a
blocked read and any backoff wait at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from bridge.core.backoff import Backoff
from bridge.core.kube import Expired, KubeError, RequestFailed, Unavailable, WatchStream, error_for_status

log = logging.getLogger("tft_bridge.platform.watch")


#: How long 401/403 answers may last before they are said to be the credentials' or the
#: RBAC's fault: an API server that has just started answers 403 until its authorization
#: cache is filled.
AUTH_GRACE = 30.0


def failure_level(error: KubeError, failing_for: float) -> tuple[int, str]:
    """The log level of a failed list/watch and a hint for the operator. Every retry is
    one WARNING line; a refusal (401/403) that lasts past ``AUTH_GRACE`` is an ERROR that
    names the credentials and the RBAC; other refused requests (400, 422...) are ERRORs."""
    status = getattr(error, "status", 0)
    if status in (401, 403):
        if failing_for < AUTH_GRACE:
            return logging.WARNING, (f" (refused: normal for a moment after the API server starts; if it lasts "
                                     f"over {AUTH_GRACE:.0f} s, the credentials or the RBAC are wrong)")
        what = "the token is not accepted" if status == 401 else "the RBAC does not allow it"
        return logging.ERROR, f" ({what}: see contrib/kubernetes/rbac.yaml and the kubeconfig)"
    if isinstance(error, RequestFailed):
        return logging.ERROR, ""
    return logging.WARNING, ""


@dataclass(frozen=True)
class Listed:
    """The complete current state (after a start, an expiry or a reconnect)."""

    items: list[dict[str, Any]]


@dataclass(frozen=True)
class Changed:
    """One watch event of an object: ADDED, MODIFIED or DELETED."""
    kind: str  # ADDED, MODIFIED, DELETED
    obj: dict[str, Any]


Delivery = Listed | Changed


class ListWatchApi(Protocol):
    """What the loop needs of an API: :class:`bridge.platform.podgroup_api.PodGroupApi`, ``bridge.node.kube.PodApi``."""

    def list(self, namespace: str | None, selector: str | None) -> tuple[list[dict[str, Any]], str]: ...

    def watch(self, namespace: str | None, selector: str | None, resource_version: str,
              timeout_seconds: int) -> WatchStream: ...


class WatchMetrics(Protocol):
    """The series the loop keeps (PlatformMetrics, NodeMetrics have them)."""

    watch_up: Any
    watch_restarts: Any
    api_requests: Any
    loop_errors: Any


class ListWatcher:
    """The reflector loop for the objects ``api`` lists in ``namespace`` (None: all) that
    match ``selector``; ``what`` names them in log lines and the thread. start()/stop(),
    once each; the thread is started by :meth:`start` only."""

    def __init__(self, api: ListWatchApi, namespace: str | None, selector: str | None,
                 deliver: Callable[[Delivery], None], metrics: WatchMetrics, *,
                 on_death: Callable[[BaseException], None],
                 watch_timeout: int = 300, backoff: Backoff | None = None, what: str = "PodGroup") -> None:
        self._what = what
        self._on_death = on_death
        self._api = api
        self._namespace = namespace
        self._selector = selector
        self._deliver = deliver
        self._metrics = metrics
        self._watch_timeout = watch_timeout
        self._backoff = backoff or Backoff(0.2, 30.0)
        self._stop = threading.Event()
        self._stream: WatchStream | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_logged, name=f"{self._what.lower()}-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Interrupt the read or the wait and join the thread (at most ``timeout``)."""
        self._stop.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the watch thread did not stop within %.0f s", timeout)

    def _run_logged(self) -> None:
        try:
            self._run()
        except BaseException as error:
            log.exception("the %s watch thread failed", self._what)
            self._metrics.loop_errors.inc()
            self._metrics.watch_up.set(0)
            self._on_death(error)
        finally:
            self._metrics.watch_up.set(0)

    def _run(self) -> None:
        resource_version: str | None = None
        expired_in_a_row = 0
        failed_since: float | None = None  # monotonic time of the first failure in a row
        failures = 0
        while not self._stop.is_set():
            operation = "list"
            try:
                if resource_version is None:
                    items, resource_version = self._api.list(self._namespace, self._selector)
                    self._metrics.api_requests.labels("list", "ok").inc()
                    if failed_since is not None:
                        log.info("%s list/watch is back after %d failed attempt(s) over %.0f s", self._what,
                                 failures, time.monotonic() - failed_since)
                        failed_since, failures = None, 0
                    self._deliver(Listed(items))
                operation = "watch"
                resource_version = self._watch_once(resource_version)
                self._backoff.reset()
                expired_in_a_row = 0
                if not self._stop.is_set():
                    self._metrics.watch_restarts.labels("timeout").inc()
            except Expired as error:
                log.info("watch expired (%s); listing again", error)
                self._metrics.watch_restarts.labels("expired").inc()
                resource_version = None
                expired_in_a_row += 1
                if expired_in_a_row > 1:  # a fresh list's version expired at once: do not spin
                    self._stop.wait(self._backoff.next())
            except KubeError as error:
                if self._stop.is_set():
                    break
                delay = self._backoff.next()
                now = time.monotonic()
                failed_since = now if failed_since is None else failed_since
                failures += 1
                level, hint = failure_level(error, now - failed_since)
                log.log(level, "%s list/watch failed (%s); listing again in %.1f s%s", self._what, error, delay, hint)
                self._metrics.watch_restarts.labels("error").inc()
                self._metrics.api_requests.labels(operation, type(error).__name__.lower()).inc()
                resource_version = None
                self._stop.wait(delay)
            except Exception:  # a bug or a surprise from the client: never leave the agent blind
                if self._stop.is_set():
                    break
                delay = self._backoff.next()
                log.exception("%s list/watch failed unexpectedly; listing again in %.1f s", self._what, delay)
                self._metrics.loop_errors.inc()
                self._metrics.watch_restarts.labels("error").inc()
                resource_version = None
                self._stop.wait(delay)

    def _watch_once(self, resource_version: str) -> str:
        """Watch until the server ends the stream; the newest resourceVersion seen."""
        stream = self._api.watch(self._namespace, self._selector, resource_version, self._watch_timeout)
        with self._lock:
            self._stream = stream
        if self._stop.is_set():
            stream.close()
        self._metrics.watch_up.set(1)
        try:
            for event in stream:
                kind = event.get("type")
                obj = event.get("object")
                if not isinstance(obj, dict):
                    continue
                if kind == "ERROR":
                    code = int(obj.get("code") or 0)
                    raise error_for_status(code, f"watch ERROR event: {obj.get('message', '')}") if code else \
                        Unavailable(f"watch ERROR event without a code: {obj}")
                version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
                if version:
                    resource_version = version
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._deliver(Changed(kind, obj))
            return resource_version
        finally:
            self._metrics.watch_up.set(0)
            with self._lock:
                self._stream = None
