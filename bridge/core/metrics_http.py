"""The /metrics endpoint: a small bounded HTTP/1.1 server on one thread of its own.

prometheus_client keeps the registry, the encoders, OpenMetrics negotiation and gzip;
this module is only the transport, bounded so that no client (a port scanner, a stuck
sidecar, an eager dashboard) can delay a fault report or take the endpoint down
(the figures: docs/performance.md, "The metrics endpoint"):

* **One thread, its own asyncio loop**, never the bridge's; no client makes more threads.
* **A listen backlog** (``backlog``): a burst of scrapers waits in the kernel.
* **At most ``max_connections`` open connections.** At the cap, the connection that has
  waited longest for a complete request header is closed to make room; one accepted with
  its request already buffered (``MSG_PEEK``; for TLS, any data) is protected for
  ``protect_for`` seconds; ``TCP_DEFER_ACCEPT`` (Linux) keeps a connection that has sent
  nothing in the kernel. When every slot is protected or busy, the next one waits in the
  backlog.
* **Shared renders**: requests whose headers were read before a render started share it
  (one per content type); no answer is older than its request.
* **Deadlines**: ``header_timeout`` for each request header and the TLS handshake,
  ``write_timeout`` for clients that stop reading.
* HTTP/1.1 with keep-alive, ``GET``/``HEAD`` on ``/metrics`` and ``/``; 404 elsewhere,
  405 for other methods, 400/431/505 for malformed, oversized or unknown-version
  requests, counted in ``tft_bridge_bad_inputs_total{kind="metrics_http_request"}`` when
  the registry has that counter (clients cut at a deadline or evicted:
  ``kind="metrics_http_slow_client"``).
* TLS with ``certfile``/``keyfile``; ``client_cafile`` makes a client certificate signed
  by that CA mandatory.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import math
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 16 * 1024
METRIC_PATHS = ("/metrics", "/")
BAD_REQUEST_KIND = "metrics_http_request"
SLOW_CLIENT_KIND = "metrics_http_slow_client"
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 505: "HTTP Version Not Supported"}


@dataclass
class ServerStats:
    """What the server did, for tests and the benchmark (read from any thread)."""

    accepted: int = 0
    served: int = 0
    evicted: int = 0
    header_timeouts: int = 0
    write_timeouts: int = 0
    bad_requests: int = 0
    open_connections: int = 0
    peak_connections: int = 0


@dataclass
class _Connection:
    reading_since: float | None = None  # monotonic time the wait for a request header began, None while busy
    ready: bool = False  # accepted with its request (or ClientHello) already buffered
    accepted_at: float = 0.0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _gzip_accepted(header: str) -> bool:
    for item in header.split(","):
        name, _, params = item.strip().partition(";")
        if name.strip().lower() in ("gzip", "*"):
            q = params.strip().lower()
            return not (q.startswith("q=") and q[2:].strip() in ("0", "0.0", "0.00", "0.000"))
    return False


def _server_socket(address: str, port: int, backlog: int, defer_seconds: int) -> socket.socket:
    """A bound, listening, non-blocking socket; raises OSError in the caller's thread, as
    ``start_http_server`` did, so start-up can name the address that failed."""
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.create_server((sockaddr[0], port), family=family, backlog=backlog)
    if hasattr(socket, "TCP_DEFER_ACCEPT"):  # Linux: hand over a connection once it has sent something
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, max(1, defer_seconds))
        except OSError:  # pragma: no cover - then silent clients are merely evicted first
            pass
    sock.setblocking(False)
    return sock


def _tls_context(certfile: str, keyfile: str, client_cafile: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=certfile, keyfile=keyfile)
    if client_cafile:
        context.load_verify_locations(cafile=client_cafile)
        context.verify_mode = ssl.CERT_REQUIRED
    context.set_alpn_protocols(["http/1.1"])
    return context


class MetricsServer:
    """The HTTP(S) endpoint of one registry (``metrics.registry``) on a thread of its own
    (``tft-metrics-http``). Used by the bridge, the node service and the platform agent.

    ``start()`` loads the TLS files, binds and listens, then starts the thread; a file or
    an address that fails raises OSError (or ValueError) there, in the caller's thread.
    ``port`` is the bound port from then on. ``stop()`` cuts every connection and joins
    the thread (bounded). ``on_died``, when given, is called on the server's thread if
    that thread ends without ``stop()``; the owner hands it over to its own thread."""

    def __init__(self, metrics: Any, address: str, port: int, *, certfile: str = "", keyfile: str = "",
                 client_cafile: str = "", max_connections: int = 64, backlog: int = 1024,
                 header_timeout: float = 5.0, write_timeout: float = 10.0, protect_for: float = 1.0,
                 on_died: Callable[[], None] | None = None) -> None:
        self.registry = metrics.registry
        self._bad_inputs = getattr(metrics, "bad_inputs", None)
        self.address = address
        self.port = port
        self.max_connections = max(1, max_connections)
        self.backlog = backlog
        self.header_timeout = header_timeout
        self.write_timeout = write_timeout
        self.protect_for = protect_for
        self._certfile, self._keyfile, self._client_cafile = certfile, keyfile, client_cafile
        self._on_died = on_died
        self.stats = ServerStats()
        # Owned by the server's thread once started:
        self._renders: dict[str, asyncio.Future[tuple[bytes, str]]] = {}  # accept header -> a render not yet run
        self._connections: dict[asyncio.Task[None], _Connection] = {}
        self._tls: ssl.SSLContext | None = None
        self._socket: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stop = asyncio.Event()
        self._slot_freed = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Listen and serve; OSError/ValueError for a bad TLS file or address."""
        if self._certfile and self._keyfile:
            self._tls = _tls_context(self._certfile, self._keyfile, self._client_cafile)
        self._socket = _server_socket(self.address, self.port, self.backlog, math.ceil(self.header_timeout))
        self.port = self._socket.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="tft-metrics-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting, cut every connection, join the thread (bounded)."""
        self._stopping = True
        if self._thread is not None and self._thread.is_alive():
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop already closed
                pass
            self._thread.join(timeout=5)
        if self._socket is not None:
            self._socket.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except Exception:  # pragma: no cover - the loop itself failing is a bug worth a log line
            log.exception("metrics endpoint stopped")
        finally:
            self._loop.close()
            if not self._stopping and self._on_died is not None:
                self._on_died()

    async def _serve(self) -> None:
        """Accept until ``stop()``, or until accepting fails (then the thread ends and
        ``on_died`` is told)."""
        accepting = asyncio.ensure_future(self._accept_loop())
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({accepting, stop}, return_when=asyncio.FIRST_COMPLETED)
        for task in (accepting, stop, *self._connections):
            task.cancel()
        results = await asyncio.gather(accepting, stop, *self._connections, return_exceptions=True)
        if isinstance(results[0], Exception):
            log.error("metrics endpoint: accepting connections failed: %r", results[0])

    # ------------------------------------------------------------------ accepting
    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._socket is not None
        while True:
            try:
                client, _ = await loop.sock_accept(self._socket)
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            except OSError as error:  # EMFILE and friends: back off instead of spinning
                log.warning("metrics endpoint cannot accept: %s", error)
                await asyncio.sleep(0.1)  # a pause before retrying accept(), not a wait for a condition
                continue
            self.stats.accepted += 1
            ready = self._has_request(client)
            await self._make_room()
            self._start(client, ready)

    async def _make_room(self) -> None:
        """Return once a connection slot is free: evict the connection that has waited
        longest for a request header, or wait for a busy one to end or turn idle."""
        while len(self._connections) >= self.max_connections:
            now = time.monotonic()
            waiting = [c for c in self._connections.values() if c.reading_since is not None]
            idle = [(c.reading_since, c.task) for c in waiting
                    if not c.ready or now - c.accepted_at >= self.protect_for]
            if idle:
                _, victim = min(idle, key=lambda pair: pair[0])
                assert victim is not None
                self._forget(victim)
                victim.cancel()
                self.stats.evicted += 1
                self._count(SLOW_CLIENT_KIND)
                continue
            self._slot_freed.clear()
            protected = [c.accepted_at + self.protect_for - now for c in waiting]
            wake = max(0.01, min(protected)) if protected else self.header_timeout  # bounded either way
            try:
                await asyncio.wait_for(self._slot_freed.wait(), wake)
            except asyncio.TimeoutError:
                pass

    def _has_request(self, client: socket.socket) -> bool:
        """Whether the client's request (for TLS: its ClientHello) is already buffered."""
        try:
            data = client.recv(MAX_HEADER_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # BlockingIOError: nothing yet; anything else: the read will tell
            return False
        return bool(data) if self._tls else b"\r\n\r\n" in data

    def _start(self, client: socket.socket, ready: bool) -> None:
        now = time.monotonic()
        state = _Connection(reading_since=now, ready=ready, accepted_at=now)
        task = asyncio.ensure_future(self._connection(client, state))
        state.task = task
        self._connections[task] = state
        self.stats.open_connections = len(self._connections)
        self.stats.peak_connections = max(self.stats.peak_connections, len(self._connections))
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        if self._connections.pop(task, None) is not None:
            self.stats.open_connections = len(self._connections)
            self._slot_freed.set()

    def _count(self, kind: str) -> None:
        if self._bad_inputs is not None:
            self._bad_inputs.labels(kind).inc()

    # ------------------------------------------------------------------ one connection
    async def _connection(self, client: socket.socket, state: _Connection) -> None:
        loop = asyncio.get_running_loop()
        writer: asyncio.StreamWriter | None = None
        try:
            reader = asyncio.StreamReader(limit=MAX_HEADER_BYTES)
            protocol = asyncio.StreamReaderProtocol(reader)
            try:
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol, client, ssl=self._tls,
                    ssl_handshake_timeout=self.header_timeout if self._tls else None)
            except (OSError, ssl.SSLError, asyncio.TimeoutError) as error:
                log.debug("metrics endpoint: connection dropped before a request: %s", error)
                client.close()
                return
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            while True:
                state.reading_since = time.monotonic()
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.header_timeout)
                except asyncio.TimeoutError:
                    self.stats.header_timeouts += 1
                    self._count(SLOW_CLIENT_KIND)
                    return
                except asyncio.IncompleteReadError:
                    return  # the client went away between requests
                except asyncio.LimitOverrunError:
                    await self._refuse(writer, _BadRequest(431, "request header larger than 16 KiB"))
                    return
                state.reading_since, state.ready = None, False
                try:
                    keep_alive = await self._answer(head, writer)
                except _BadRequest as bad:
                    await self._refuse(writer, bad)
                    return
                if not keep_alive:
                    return
        except asyncio.TimeoutError:
            self.stats.write_timeouts += 1
            self._count(SLOW_CLIENT_KIND)
        except (ConnectionError, OSError):
            pass
        finally:
            if writer is not None:
                writer.transport.abort()  # no lingering close handshake with a client that may not read
            else:
                client.close()

    async def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; whether the connection stays open."""
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, version = lines[0].split(" ")
        except ValueError:
            raise _BadRequest(400, "malformed request line") from None
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise _BadRequest(505, f"HTTP version {version[:20]!r} not supported")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise _BadRequest(400, "malformed header line")
            headers[name.lower()] = value.strip()
        if "transfer-encoding" in headers or headers.get("content-length", "0") not in ("0", ""):
            raise _BadRequest(400, "a request body is not accepted")
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            await self._respond(writer, 405, b"only GET and HEAD\n", "text/plain; charset=utf-8", keep_alive,
                                method == "HEAD", extra=[("Allow", "GET, HEAD")])
            return keep_alive
        if path not in METRIC_PATHS:
            await self._respond(writer, 404, b"not found: metrics are at /metrics\n", "text/plain; charset=utf-8",
                                keep_alive, method == "HEAD")
            return keep_alive
        try:
            # shielded: an evicted or cut waiter must not cancel the render others share
            body, content_type = await asyncio.shield(self._render(headers.get("accept", "")))
        except Exception:  # a collector callback failed: say so, keep serving
            log.exception("metrics endpoint: rendering the registry failed")
            await self._respond(writer, 500, b"rendering the metrics failed\n", "text/plain; charset=utf-8",
                                keep_alive, method == "HEAD")
            return keep_alive
        extra: list[tuple[str, str]] = []
        if _gzip_accepted(headers.get("accept-encoding", "")):
            body = gzip.compress(body, compresslevel=6)
            extra.append(("Content-Encoding", "gzip"))
        await self._respond(writer, 200, body, content_type, keep_alive, method == "HEAD", extra=extra)
        self.stats.served += 1
        return keep_alive

    def _render(self, accept: str) -> asyncio.Future[tuple[bytes, str]]:
        """The registry rendered for ``accept``, shared with every request that asks
        before the render runs (it runs on the next loop iteration, after this one's
        requests were read)."""
        pending = self._renders.get(accept)
        if pending is None:
            loop = asyncio.get_running_loop()
            pending = self._renders[accept] = loop.create_future()
            loop.call_soon(self._render_now, accept, pending)
        return pending

    def _render_now(self, accept: str, result: asyncio.Future[tuple[bytes, str]]) -> None:
        del self._renders[accept]
        if result.done():  # pragma: no cover - only if the loop is being torn down
            return
        try:
            encoder, content_type = choose_encoder(accept)
            result.set_result((encoder(self.registry), content_type))
        except Exception as error:
            result.set_exception(error)

    async def _refuse(self, writer: asyncio.StreamWriter, bad: _BadRequest) -> None:
        self.stats.bad_requests += 1
        self._count(BAD_REQUEST_KIND)
        log.debug("metrics endpoint: %s", bad)
        await self._respond(writer, bad.status, f"{bad}\n".encode(), "text/plain; charset=utf-8", False, False)

    async def _respond(self, writer: asyncio.StreamWriter, status: int, body: bytes, content_type: str,
                       keep_alive: bool, head_only: bool, extra: list[tuple[str, str]] | None = None) -> None:
        header_lines = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Type: {content_type}",
                        f"Content-Length: {len(body)}", f"Connection: {'keep-alive' if keep_alive else 'close'}"]
        header_lines += [f"{name}: {value}" for name, value in extra or ()]
        writer.write(("\r\n".join(header_lines) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(body)
        await asyncio.wait_for(writer.drain(), self.write_timeout)  # TimeoutError: the caller cuts the client


def sample(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample's value, 0.0 when absent; for tests, the demo and status lines."""
    value = registry.get_sample_value(name, labels or {})
    return 0.0 if value is None else value
