"""Kubernetes API access through the official ``kubernetes`` client, with every error sorted.

The client is synchronous and optional: it is imported here, lazily, and nowhere else
(the bridge daemon never needs it). Every call carries a timeout; errors become one of
the small exception classes below, which is all the node service and the platform agent
reason about:

* :class:`Conflict` (409): the resourceVersion the write was conditioned on is stale;
* :class:`Expired` (410): the watch's resourceVersion is too old; list again;
* :class:`NotFound` (404): the object is gone;
* :class:`Unavailable`: connection refused or reset, timeouts, 429 and 5xx; back off;
* :class:`RequestFailed`: any other answer, a bug or a permission problem (401/403).

Watches use the client's own call (``watch=True``, ``_preload_content=False``) and its
line splitter rather than ``kubernetes.watch.Watch``: that class retries a 410 from the
same, already expired resourceVersion and hides ERROR events the agent wants to count.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger("tft_bridge.kube")

INSTALL_HINT = "the Kubernetes client is not installed: pip install 'tft-bridge[node]' (or [platform])"


class KubeError(Exception):
    """Base class; ``status`` is the HTTP status (0 when there was no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Conflict(KubeError):
    """409: the resourceVersion a write was conditioned on is stale; re-read and decide again."""


class Expired(KubeError):
    """410 Gone: the watch's resourceVersion was compacted away; list again."""


class NotFound(KubeError):
    """404: the object does not exist (any more)."""


class Unavailable(KubeError):
    """No usable answer: refused, broken, timed out, 5xx, 429; back off and try again."""


class RequestFailed(KubeError):
    """Any other refusal (400, 401, 403, 422...): the request or the credentials are wrong."""


class MissingClient(RuntimeError):
    """The ``kubernetes`` package is not installed (the ``node``/``platform`` extras)."""


def kubernetes_module() -> Any:
    try:
        import kubernetes
    except ImportError as error:  # pragma: no cover - the test extra installs it
        raise MissingClient(INSTALL_HINT) from error
    return kubernetes


def api_client(kubeconfig: str | None = None, context: str | None = None, server: str | None = None) -> Any:
    """An ``ApiClient``: ``server`` (a URL used without credentials, e.g. ``kubectl proxy``),
    else ``kubeconfig`` (path, optional context), else the in-cluster service account."""
    kubernetes = kubernetes_module()
    configuration = kubernetes.client.Configuration()
    if server:
        configuration.host = server.rstrip("/")
    elif kubeconfig:
        kubernetes.config.load_kube_config(config_file=kubeconfig, context=context,
                                           client_configuration=configuration)
    else:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    # A few quick connect retries inside urllib3; everything longer is the agent's backoff.
    import urllib3

    configuration.retries = urllib3.Retry(total=2, connect=2, read=0, status=0, redirect=0,
                                          backoff_factor=0.05)
    return kubernetes.client.ApiClient(configuration)


def classify(error: BaseException) -> KubeError:
    """Map a client, urllib3 or socket error to one of the error classes above."""
    if isinstance(error, KubeError):
        return error
    status = getattr(error, "status", None)
    if isinstance(status, int) and status and hasattr(error, "reason"):
        message = f"HTTP {status} {getattr(error, 'reason', '')}: {_status_message(getattr(error, 'body', None))}"
        return error_for_status(status, message)
    return Unavailable(f"{type(error).__name__}: {error}")


def error_for_status(status: int, message: str) -> KubeError:
    if status == 409:
        return Conflict(message, status)
    if status == 410:
        return Expired(message, status)
    if status == 404:
        return NotFound(message, status)
    if status == 429 or status >= 500:
        return Unavailable(message, status)
    return RequestFailed(message, status)


def _status_message(body: object) -> str:
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if isinstance(body, str):
        try:
            parsed = json.loads(body)
        except ValueError:
            return body[:200]
        if isinstance(parsed, dict):
            return str(parsed.get("message") or parsed.get("reason") or "")[:200]
    return ""


class BoundedApi:
    """An ``ApiClient`` and the timeouts every call of a subclass carries."""

    def __init__(self, client: Any, request_timeout: float = 10.0, connect_timeout: float = 5.0) -> None:
        self._client = client
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout

    def close(self) -> None:
        close = getattr(self._client, "close", None)
        if close is not None:
            close()

    def _timeouts(self) -> tuple[float, float]:
        return self.connect_timeout, self.request_timeout


def watch_arguments(resource_version: str, timeout_seconds: int, connect_timeout: float,
                    request_timeout: float) -> dict[str, Any]:
    """The client's keyword arguments of a watch call: bounded on both sides."""
    return {
        "watch": True,
        "resource_version": resource_version,
        "timeout_seconds": int(timeout_seconds),
        "allow_watch_bookmarks": True,
        "_preload_content": False,
        "_request_timeout": (connect_timeout, timeout_seconds + max(5.0, request_timeout)),
    }


def open_watch(call: Any, *args: Any, **kwargs: Any) -> WatchStream:
    """``call(*args, **kwargs)`` (a list call with ``watch=True``) as a :class:`WatchStream`,
    every failure sorted into the error classes."""
    try:
        response = call(*args, **kwargs)
    except Exception as error:
        raise classify(error) from error
    status = getattr(response, "status", 200)
    if not 200 <= status <= 299:
        try:
            body = response.data
        finally:
            _release(response)
        raise error_for_status(status, f"HTTP {status}: {_status_message(body)}")
    return WatchStream(response)


class WatchStream:
    """One watch response as an iterator of event dicts; :meth:`close` may be called from
    any thread and unblocks a read in progress."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self._closed = threading.Event()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from kubernetes.watch.watch import iter_resp_lines

        try:
            for line in iter_resp_lines(self._response):  # type: ignore[no-untyped-call]
                if self._closed.is_set():
                    return
                if not line.strip():
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    log.warning("watch: skipped a line that is not JSON: %.120r", line)
                    continue
                if isinstance(event, dict):
                    yield event
        except Exception as error:
            if self._closed.is_set():
                return
            raise classify(error) from error
        finally:
            _release(self._response)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        shutdown = getattr(self._response, "shutdown", None)  # urllib3 >= 2.3
        try:
            if shutdown is not None:
                shutdown()
            else:  # pragma: no cover - older urllib3
                sock = getattr(getattr(self._response, "connection", None), "sock", None)
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
        except Exception:  # the stream may already be gone; closing must never fail
            log.debug("watch: shutdown of the response failed", exc_info=True)


def _release(response: Any) -> None:
    for method in ("close", "release_conn"):
        try:
            getattr(response, method)()
        except Exception:
            log.debug("watch: %s failed", method, exc_info=True)
