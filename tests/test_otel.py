"""OTLP trace export against in-process receivers speaking the real protocol: a gRPC
TraceService server and an OTLP/HTTP endpoint, both built from opentelemetry-proto's
messages. Plus: nothing imports OpenTelemetry when the export is off."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")

import grpc  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as collector  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as collector_grpc  # noqa: E402
from opentelemetry.proto.trace.v1 import trace_pb2 as trace  # noqa: E402

from bridge.job.metrics import BridgeMetrics  # noqa: E402
from bridge.job.recorder.otel import OtlpExporter  # noqa: E402
from bridge.job.recorder import ErrorLog  # noqa: E402
from bridge.core.recorder_config import OtelConfig  # noqa: E402
from bridge.sim.scenario import free_port  # noqa: E402

from .conftest import eventually_sync  # noqa: E402
from .simjobs import annotation  # noqa: E402
from .test_recorder import make, run_retry_cycle  # noqa: E402


class Receiver(collector_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[collector.ExportTraceServiceRequest] = []
        self.metadata: list[dict[str, str]] = []

    def Export(self, request: collector.ExportTraceServiceRequest, context: Any) -> collector.ExportTraceServiceResponse:
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        return collector.ExportTraceServiceResponse()


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[Receiver, int]]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    collector_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, port
    server.stop(grace=None)


def spans_of(request: collector.ExportTraceServiceRequest) -> list[trace.Span]:
    return [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]


def attrs(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def export_one_cycle(tmp_path: Path, config: OtelConfig) -> tuple[OtlpExporter, BridgeMetrics]:
    recorder, writer, flow, clock, metrics = make(tmp_path)
    exporter = OtlpExporter(config, ErrorLog(metrics))
    exporter.start()
    writer.on_closed = exporter.submit
    writer.start()
    run_retry_cycle(recorder, flow, clock, uuid="trace-me")
    eventually_sync(lambda: writer.closed == 1, 10, what="the cycle closed by the writer")
    writer.stop()
    return exporter, metrics


def test_a_cycle_is_one_trace_with_phase_rpc_and_notify_spans(tmp_path: Path,
                                                              grpc_receiver: tuple[Receiver, int]) -> None:
    receiver, port = grpc_receiver
    exporter, metrics = export_one_cycle(tmp_path, OtelConfig(enabled=True, endpoint=f"127.0.0.1:{port}",
                                                              headers=("x-tenant=ml",)))
    eventually_sync(lambda: receiver.requests, 10, what="an OTLP export received")
    exporter.stop()
    (request,) = receiver.requests
    assert receiver.metadata[0]["x-tenant"] == "ml"
    resource = attrs(request.resource_spans[0].resource)
    assert resource["service.name"] == "tft-bridge" and resource["tft_bridge.job"] == "job-1"
    spans = spans_of(request)
    assert len({s.trace_id for s in spans}) == 1, "one cycle, one trace"
    (root,) = [s for s in spans if not s.parent_span_id]
    root_attrs = attrs(root)
    assert root_attrs["tft_bridge.outcome"] == "success" and root_attrs["tft_bridge.strategy"] == "retry"
    assert root_attrs["tft_bridge.cycle.uuid"] == "trace-me" and root_attrs["tft_bridge.job"] == "job-1"
    assert root.status.code == trace.Status.STATUS_CODE_OK
    assert (root.end_time_unix_nano - root.start_time_unix_nano) / 1e9 == pytest.approx(10.75, abs=1e-3)
    phases = {s.name: s for s in spans if s.parent_span_id == root.span_id and s.name.count("_to_")}
    assert set(phases) == {"fault_to_stop", "stop_to_strategy", "strategy_to_result"}
    by_parent = {name: sorted(s.name for s in spans if s.parent_span_id == p.span_id) for name, p in phases.items()}
    assert by_parent == {
        "fault_to_stop": ["ClusterD ReportProcessFault", "notify stop_train"],
        "stop_to_strategy": ["ClusterD ReportStopComplete", "notify on_global_rank"],
        "strategy_to_result": ["ClusterD ReportRecoverStatus", "notify change_strategy"],
    }
    rpc = next(s for s in spans if s.name == "ClusterD ReportProcessFault")
    assert rpc.kind == trace.Span.SPAN_KIND_CLIENT and attrs(rpc)["rpc.method"] == "ReportProcessFault"
    assert (rpc.end_time_unix_nano - rpc.start_time_unix_nano) == pytest.approx(2_000_000, abs=1000)
    signals = [e.name for e in phases["fault_to_stop"].events]
    assert signals[:2] == ["report_fault_ranks", "signal"]
    assert metrics.sample("tft_bridge_recorder_errors_total", {"reason": "otel_export"}) == 0


def test_otlp_http_protobuf(tmp_path: Path) -> None:
    received: list[tuple[str, str, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server API
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], body))
            answer = collector.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        exporter, _ = export_one_cycle(tmp_path, OtelConfig(enabled=True, protocol="http/protobuf", endpoint=url))
        eventually_sync(lambda: received, 10, what="an OTLP/HTTP export received")
        exporter.stop()
    finally:
        server.shutdown()
        server.server_close()
    path, content_type, body = received[0]
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    root = next(s for s in spans_of(collector.ExportTraceServiceRequest.FromString(body)) if not s.parent_span_id)
    assert attrs(root)["tft_bridge.cycle.uuid"] == "trace-me"


def test_an_unreachable_collector_is_counted_within_the_deadline(tmp_path: Path) -> None:
    with socket_port() as port:  # a port nobody listens on
        exporter, metrics = export_one_cycle(tmp_path, OtelConfig(enabled=True, endpoint=f"127.0.0.1:{port}",
                                                                  timeout=0.5))
        eventually_sync(lambda: metrics.sample("tft_bridge_recorder_errors_total", {"reason": "otel_export"}) == 1,
                        10, what="the failed export counted")
        exporter.stop()
    assert exporter.exported == 0


class socket_port:
    """A free TCP port, held closed (nothing listens) for the block."""

    def __enter__(self) -> int:
        self.port = free_port()  # never one an outgoing connection or another listener takes
        return self.port

    def __exit__(self, *exc: Any) -> None:
        pass


def test_the_daemon_does_not_import_opentelemetry() -> None:
    code = ("import sys, bridge.job.daemon, bridge.cli, bridge.job.recorder, bridge.job.recorder.history; "
            "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry')); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_a_real_recovery_reaches_the_collector_as_one_trace(grpc_receiver: tuple[Receiver, int],
                                                                  tmp_path: Path) -> None:
    from bridge.sim.clusterd import SimJob
    from bridge.sim.mindio_ttp import FAST_TIMINGS
    from bridge.sim.scenario import SimulatedJob

    from .conftest import eventually

    receiver, port = grpc_receiver
    job = SimulatedJob(SimJob("job-otel", world_size=16, devices_per_pod=4), controller_timings=FAST_TIMINGS,
                       config_overrides={"recorder": {"enabled": True, "directory": str(tmp_path)},
                                         "otel": {"enabled": True, "endpoint": f"127.0.0.1:{port}"}})
    await job.start()
    try:
        await job.subscribed()
        job.training.inject_fault({5: 1})
        await annotation(job)
        await eventually(lambda: receiver.requests, 15, what="the cycle's trace exported")
    finally:
        await job.stop()
    uuid = job.sim.journal.signals("changeStrategy", job_id="job-otel")[0].detail["uuid"]
    (request,) = receiver.requests
    spans = spans_of(request)
    (root,) = [s for s in spans if not s.parent_span_id]
    assert attrs(root)["tft_bridge.cycle.uuid"] == uuid and attrs(root)["tft_bridge.outcome"] == "success"
    assert attrs(root)["tft_bridge.strategy"] == "recover" and attrs(root)["tft_bridge.job"] == "job-otel"
    names = {s.name for s in spans}
    assert {"fault_to_stop", "stop_to_strategy", "strategy_to_result", "ClusterD ReportRecoverStatus",
            "notify change_strategy"} <= names


def test_otlp_grpc_over_tls_with_a_private_ca(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    authority = trustme.CA()
    certificate = authority.issue_cert("localhost")
    ca_file = tmp_path / "ca.pem"
    authority.cert_pem.write_to_path(str(ca_file))
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    collector_grpc.add_TraceServiceServicer_to_server(receiver, server)
    credentials = grpc.ssl_server_credentials([(certificate.private_key_pem.bytes(),
                                                certificate.cert_chain_pems[0].bytes())])
    port = server.add_secure_port("localhost:0", credentials)
    server.start()
    try:
        exporter, metrics = export_one_cycle(tmp_path / "store", OtelConfig(
            enabled=True, endpoint=f"localhost:{port}", insecure=False, ca_file=str(ca_file)))
        eventually_sync(lambda: receiver.requests, 10, what="an OTLP export over TLS received")
        exporter.stop()
    finally:
        server.stop(grace=None)
    root = next(s for s in spans_of(receiver.requests[0]) if not s.parent_span_id)
    assert attrs(root)["tft_bridge.cycle.uuid"] == "trace-me"
    assert metrics.sample("tft_bridge_recorder_errors_total", {"reason": "otel_export"}) == 0
