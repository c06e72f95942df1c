"""The bounded metrics endpoint: idle, slow-loris and non-reading
clients cannot pile up threads or keep a real scrape out; TLS with client certificates;
HTTP answers a scraper and a curious operator expect.

Every wait is for the thing asserted (``eventually_sync``); the deadlines configured
small here are the behaviour under test, never a sleep.
"""

from __future__ import annotations

import gzip
import http.client
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from bridge.job.metrics import BridgeMetrics
from bridge.core.metrics_http import MetricsServer

from .conftest import eventually_sync


@pytest.fixture
def metrics() -> BridgeMetrics:
    return BridgeMetrics()


@pytest.fixture
def server(metrics: BridgeMetrics) -> Iterator[MetricsServer]:
    srv = MetricsServer(metrics, "127.0.0.1", 0, max_connections=8, header_timeout=1.0, write_timeout=1.0)
    srv.start()
    yield srv
    srv.stop()


def scrape(port: int, path: str = "/metrics", timeout: float = 20, **headers: str) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def raw(port: int, request: bytes, timeout: float = 20) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def metrics_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tft-metrics-http"]


def test_serves_metrics_on_metrics_and_root(server: MetricsServer) -> None:
    for path in ("/metrics", "/", "/metrics?name[]=x"):
        status, headers, body = scrape(server.port, path)
        assert status == 200
        assert headers["content-type"].startswith("text/plain")
        assert b"tft_bridge_build_info" in body


def test_gzip_when_asked_and_only_then(server: MetricsServer) -> None:
    status, headers, body = scrape(server.port, **{"Accept-Encoding": "gzip"})
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert b"tft_bridge_build_info" in gzip.decompress(body)
    _, headers, _ = scrape(server.port, **{"Accept-Encoding": "gzip;q=0, identity"})
    assert "content-encoding" not in headers


def test_openmetrics_when_asked(server: MetricsServer) -> None:
    _, headers, body = scrape(server.port, Accept="application/openmetrics-text; version=1.0.0")
    assert headers["content-type"].startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_404_and_405(server: MetricsServer) -> None:
    assert scrape(server.port, "/nope")[0] == 404
    answer = raw(server.port, b"POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 405 ") and b"\r\nAllow: GET, HEAD\r\n" in answer


def test_head_has_headers_and_no_body(server: MetricsServer) -> None:
    answer = raw(server.port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"Content-Length: " in head and body == b""


def test_keep_alive_serves_several_requests_on_one_connection(server: MetricsServer) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    try:
        for _ in range(3):
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            assert response.status == 200 and response.read()
    finally:
        connection.close()
    # the server thread counts a response after writing it: the client may read it first
    eventually_sync(lambda: server.stats.served == 3, what="three responses counted")
    assert server.stats.accepted == 1


@pytest.mark.parametrize("request_bytes, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /metrics HTTP/2.0\r\n\r\n", 505),
    (b"GET /metrics HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 400),
    (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n", 431),
])
def test_malformed_requests_are_refused_and_counted(server: MetricsServer, metrics: BridgeMetrics,
                                                    request_bytes: bytes, status: int) -> None:
    answer = raw(server.port, request_bytes)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:80]
    assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "metrics_http_request"}) == 1
    assert scrape(server.port)[0] == 200  # and the server still serves


def test_idle_connections_beyond_the_cap_add_no_thread_and_do_not_block_a_scrape(
        server: MetricsServer, metrics: BridgeMetrics) -> None:
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=20) for _ in range(80)]
    try:
        # Half of them send a partial request line, the slow-loris way; the others send
        # nothing (on Linux the kernel holds those until they send: TCP_DEFER_ACCEPT).
        for sock in idle[::2]:
            sock.sendall(b"GET /metrics HTT")
        eventually_sync(lambda: server.stats.accepted >= 40, 30, what="the slow-loris connections accepted")
        assert threading.active_count() == threads_before
        assert len(metrics_threads()) == 1
        assert server.stats.peak_connections <= server.max_connections
        status, _, body = scrape(server.port)
        assert status == 200 and b"tft_bridge_build_info" in body
        # Each one beyond the cap was evicted, unless its 1 s header deadline came first
        # (a loaded machine may take that long to accept 40).
        cut = server.stats.evicted + server.stats.header_timeouts
        assert cut >= 40 - server.max_connections
        assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "metrics_http_slow_client"}) >= cut
    finally:
        for sock in idle:
            sock.close()


def test_a_slow_loris_is_cut_at_the_header_deadline(server: MetricsServer, metrics: BridgeMetrics) -> None:
    """A client trickling its header one byte at a time is cut once the (total) header
    deadline passes, however steadily it trickles."""
    request = b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nUser-Agent: " + b"x" * 10_000
    cut = threading.Event()
    started = time.monotonic()

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
            try:
                for byte in request:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.02)  # the trickle itself is the behaviour under test
                    if cut.is_set():
                        return
            except OSError:
                cut.set()

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    eventually_sync(lambda: server.stats.header_timeouts == 1, 30, what="the trickling client cut at the deadline")
    cut.set()
    assert time.monotonic() - started >= server.header_timeout
    assert server.stats.served == 0
    assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "metrics_http_slow_client"}) == 1
    thread.join(timeout=20)
    assert scrape(server.port)[0] == 200


class HugeHelp(Collector):
    """One gauge with a help text of 16 MB: a response larger than any socket buffer."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("huge_help", "x" * 16_000_000, value=1)


def test_a_client_that_stops_reading_is_cut_at_the_write_deadline(server: MetricsServer, metrics: BridgeMetrics) -> None:
    metrics.registry.register(HugeHelp())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(20)
    try:
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read the answer
        eventually_sync(lambda: server.stats.write_timeouts == 1, 60, what="the non-reading client cut")
        assert metrics.sample("tft_bridge_bad_inputs_total", {"kind": "metrics_http_slow_client"}) == 1
    finally:
        sock.close()
    eventually_sync(lambda: server.stats.open_connections == 0, 30, what="the connection released")


def test_stop_stops_the_thread_and_the_port(metrics: BridgeMetrics) -> None:
    died: list[str] = []
    srv = MetricsServer(metrics, "127.0.0.1", 0, on_died=lambda: died.append(threading.current_thread().name))
    srv.start()
    idle = socket.create_connection(("127.0.0.1", srv.port), timeout=20)
    idle.sendall(b"GET /met")
    eventually_sync(lambda: srv.stats.open_connections == 1, 30, what="the idle connection open")
    srv.stop()
    assert not srv.alive and died == []  # a stop is not a death
    # The open connection was cut: a FIN, or a reset when the server closed it with the
    # partial request still unread (whether it had read it yet is a race); an open one
    # would time out instead.
    try:
        assert idle.recv(1) == b""
    except ConnectionResetError:
        pass
    idle.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=5).close()


def test_a_dying_server_thread_tells_its_owner(metrics: BridgeMetrics, monkeypatch: pytest.MonkeyPatch) -> None:
    died = threading.Event()
    srv = MetricsServer(metrics, "127.0.0.1", 0, on_died=died.set)

    def broken(client: socket.socket) -> bool:
        raise RuntimeError("a bug in the accept path")

    monkeypatch.setattr(srv, "_has_request", broken)
    srv.start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
            assert died.wait(20), "the owner was not told"
        assert not srv.alive
    finally:
        srv.stop()


def test_a_taken_port_raises_oserror_in_the_caller(server: MetricsServer, metrics: BridgeMetrics) -> None:
    with pytest.raises(OSError):
        MetricsServer(metrics, "127.0.0.1", server.port).start()


def test_ipv6_loopback(metrics: BridgeMetrics) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        srv = MetricsServer(metrics, "::1", 0)
        srv.start()
    except OSError as error:
        pytest.skip(f"no IPv6 loopback here: {error}")
    try:
        connection = http.client.HTTPConnection("::1", srv.port, timeout=20)
        connection.request("GET", "/metrics")
        assert connection.getresponse().status == 200
        connection.close()
    finally:
        srv.stop()


# ------------------------------------------------------------------------- TLS

trustme = pytest.importorskip("trustme")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    directory = tmp_path_factory.mktemp("metrics-pki")
    ca, other_ca = trustme.CA(), trustme.CA()
    server_cert = ca.issue_cert("localhost", "127.0.0.1")
    files: dict[str, object] = {"ca": ca, "other_ca": other_ca}
    for name, blob in {"server.pem": b"".join(p.bytes() for p in server_cert.cert_chain_pems),
                       "server.key": server_cert.private_key_pem.bytes(),
                       "ca.pem": ca.cert_pem.bytes()}.items():
        (directory / name).write_bytes(blob)
        files[name] = str(directory / name)
    return files


def client_context(pki: dict[str, object], cert_from: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca.pem"]))
    if cert_from:
        pki[cert_from].issue_cert("scraper").configure_cert(context)  # type: ignore[attr-defined]
    return context


def https_get(port: int, context: ssl.SSLContext) -> int:
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=context, timeout=20) as response:
        return response.status


def test_https_with_a_required_client_certificate(metrics: BridgeMetrics, pki: dict[str, object]) -> None:
    srv = MetricsServer(metrics, "127.0.0.1", 0, certfile=str(pki["server.pem"]), keyfile=str(pki["server.key"]),
                        client_cafile=str(pki["ca.pem"]))
    srv.start()
    try:
        assert https_get(srv.port, client_context(pki, "ca")) == 200
        for wrong in (None, "other_ca"):
            with pytest.raises((OSError, urllib.error.URLError, http.client.HTTPException)):
                https_get(srv.port, client_context(pki, wrong))
        with pytest.raises((OSError, http.client.HTTPException)):  # plain HTTP to the TLS port
            scrape(srv.port)
        assert srv.stats.served == 1
    finally:
        srv.stop()


def test_https_without_client_certificates(metrics: BridgeMetrics, pki: dict[str, object]) -> None:
    srv = MetricsServer(metrics, "127.0.0.1", 0, certfile=str(pki["server.pem"]), keyfile=str(pki["server.key"]))
    srv.start()
    try:
        assert https_get(srv.port, client_context(pki, None)) == 200
    finally:
        srv.stop()


def test_a_bad_key_file_raises_in_the_caller(metrics: BridgeMetrics, pki: dict[str, object], tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("not a key")
    with pytest.raises(OSError):  # ssl.SSLError is an OSError: the daemon's start-up error path
        MetricsServer(metrics, "127.0.0.1", 0, certfile=str(pki["server.pem"]), keyfile=str(bad)).start()
