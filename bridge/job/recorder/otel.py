"""Each recorded recovery cycle as one OpenTelemetry trace, exported over OTLP.

Optional (``pip install 'tft-bridge[otel]'``, ``[otel] enabled = true``; nothing imports
this module otherwise): a root span per cycle, a span per phase, child spans for ClusterD
RPCs and controller notifies, span events for signals, callbacks, refusals and drops.
Built from ``opentelemetry-proto``'s messages and sent with grpcio or the stdlib's HTTP
client, not the SDK (docs/operations.md, "Traces"). ``OtlpExporter.submit`` is called by
the recorder's writer thread and only queues (bounded; full: counted); the exporter's own
thread ``tft-otel`` sends under ``otel.timeout``. A failed export is counted and not
retried: the local store is the record of truth. The trace id derives from the job and
the cycle's key, so a cycle exported twice lands in one trace.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as collector
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as collector_grpc
from opentelemetry.proto.common.v1 import common_pb2 as common
from opentelemetry.proto.resource.v1 import resource_pb2 as resource
from opentelemetry.proto.trace.v1 import trace_pb2 as trace

from bridge._version import __version__
from bridge.core.recorder_config import OtelConfig, header_pairs
from bridge.job.recorder.model import clusterd_faults_text, describe, phases

log = logging.getLogger(__name__)

SCOPE = "tft_bridge.recorder"
_FAILED = frozenset({"failed", "unfinished", "interrupted"})
_OK = frozenset({"success", "isolated"})


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _value(value: Any) -> common.AnyValue:
    if isinstance(value, bool):
        return common.AnyValue(bool_value=value)
    if isinstance(value, int):
        return common.AnyValue(int_value=value)
    if isinstance(value, float):
        return common.AnyValue(double_value=value)
    if isinstance(value, (list, tuple)):
        return common.AnyValue(array_value=common.ArrayValue(values=[_value(v) for v in value]))
    return common.AnyValue(string_value=str(value))


def _attributes(pairs: dict[str, Any]) -> list[common.KeyValue]:
    return [common.KeyValue(key=k, value=_value(v)) for k, v in pairs.items() if v is not None and v != ""]


def _id(seed: str, size: int) -> bytes:
    return hashlib.sha256(seed.encode()).digest()[:size]


def build_request(record: dict[str, Any], service_name: str = "tft-bridge") -> collector.ExportTraceServiceRequest:
    """One cycle (as the recorder's writer closes it) as one trace."""
    job, key = record["job"], record["key"]
    trace_id = _id(f"{job}/{key}", 16)
    counter = iter(range(1, 1_000_000))

    def span_id() -> bytes:
        return _id(f"{job}/{key}/{next(counter)}", 8)

    started, ended = float(record["started"]), float(record["ended"])
    outcome, strategy = record.get("outcome") or "", record.get("strategy") or ""
    summary = record.get("summary") or {}
    common_attrs = {"tft_bridge.job": job, "tft_bridge.cycle.uuid": record.get("uuid"),
                    "tft_bridge.cycle.key": key}
    root_id = span_id()
    root = trace.Span(
        trace_id=trace_id, span_id=root_id, name=f"recovery {outcome or 'open'}",
        kind=trace.Span.SPAN_KIND_INTERNAL, start_time_unix_nano=_ns(started), end_time_unix_nano=_ns(ended),
        attributes=_attributes({
            **common_attrs, "tft_bridge.strategy": strategy, "tft_bridge.outcome": outcome,
            "tft_bridge.opened_by": record.get("opened_by"),
            "tft_bridge.cycle.uuids": list(record.get("uuids") or []) or None,
            "tft_bridge.fault_ranks": sum((summary.get("faults") or {}).get("by_type", {}).values()),
            **{f"tft_bridge.waited.{party}_seconds": float(seconds)
               for party, seconds in (summary.get("waits") or {}).items()},
            "tft_bridge.clusterd_faults": (clusterd_faults_text(summary["clusterd_faults"])
                                           if summary.get("clusterd_faults") else None),
            "tft_bridge.events_dropped": record.get("events_dropped") or None,
        }),
        status=_status(outcome in _FAILED, outcome in _OK, f"recovery {outcome}"))
    spans = [root]
    events = record.get("events") or []
    phase_spans: list[tuple[float, float, trace.Span]] = []
    for phase in phases(events, started, ended, record.get("opened_by") or "fault"):
        span = trace.Span(trace_id=trace_id, span_id=span_id(), parent_span_id=root_id, name=phase.name,
                          kind=trace.Span.SPAN_KIND_INTERNAL, start_time_unix_nano=_ns(phase.start),
                          end_time_unix_nano=_ns(max(phase.end, phase.start)),
                          attributes=_attributes({**common_attrs, "tft_bridge.phase": phase.name}))
        phase_spans.append((phase.start, phase.end, span))
        spans.append(span)

    def parent(at: float) -> trace.Span:
        """The phase the moment belongs to: the last one begun by then (a report sent at
        a boundary belongs to the phase it opens)."""
        found = root
        for start, _, span in phase_spans:
            if start <= at:
                found = span
        return found

    for event in events:
        t, kind = float(event["t"]), event["kind"]
        if kind == "rpc":
            code = event.get("code")
            latency = float(event.get("latency") or 0.0)
            spans.append(trace.Span(
                trace_id=trace_id, span_id=span_id(), parent_span_id=parent(t).span_id,
                name=f"ClusterD {event.get('method')}", kind=trace.Span.SPAN_KIND_CLIENT,
                start_time_unix_nano=_ns(t), end_time_unix_nano=_ns(t + latency),
                attributes=_attributes({**common_attrs, "rpc.system": "grpc", "rpc.service": "Recover",
                                        "rpc.method": event.get("method"), "tft_bridge.code": str(code)}),
                status=_status(str(code) != "0", str(code) == "0", f"code {code}")))
        elif kind == "notify":
            rc = event.get("rc")
            spans.append(trace.Span(
                trace_id=trace_id, span_id=span_id(), parent_span_id=parent(t).span_id,
                name=f"notify {event.get('action')}", kind=trace.Span.SPAN_KIND_INTERNAL,
                start_time_unix_nano=_ns(t), end_time_unix_nano=_ns(t + float(event.get("duration") or 0.0)),
                attributes=_attributes({**common_attrs, "tft_bridge.action": event.get("action"),
                                        "tft_bridge.strategy": event.get("strategy"), "tft_bridge.rc": rc}),
                status=_status(rc != 0, rc == 0, f"the controller returned {rc}")))
        elif kind != "outcome":
            target = parent(t)
            target.events.append(trace.Span.Event(
                time_unix_nano=_ns(t), name=kind if kind != "callback" else str(event.get("name")),
                attributes=_attributes({"tft_bridge.detail": describe(event),
                                        "tft_bridge.reason": event.get("reason")})))
    return collector.ExportTraceServiceRequest(resource_spans=[trace.ResourceSpans(
        resource=resource.Resource(attributes=_attributes({"service.name": service_name,
                                                           "service.version": __version__,
                                                           "tft_bridge.job": job})),
        scope_spans=[trace.ScopeSpans(scope=common.InstrumentationScope(name=SCOPE, version=__version__),
                                      spans=spans)])])


def _status(error: bool, ok: bool, message: str) -> trace.Status:
    if error:
        return trace.Status(code=trace.Status.STATUS_CODE_ERROR, message=message)
    if ok:
        return trace.Status(code=trace.Status.STATUS_CODE_OK)
    return trace.Status()


class OtlpExporter:
    """Queues closed cycles (``submit``, from the recorder's writer thread; never blocks:
    a full queue is counted) and exports each, under a deadline, on a thread of its own
    (``tft-otel``) that ``start()`` starts and ``stop()`` ends."""

    def __init__(self, config: OtelConfig, errors: Callable[..., None], queue_limit: int = 32) -> None:
        self.config = config
        self.errors = errors
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=queue_limit)
        self._headers = header_pairs(config)
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self.exported = 0  # traces a collector accepted (tests)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tft-otel", daemon=True)
        self._thread.start()

    def submit(self, record: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.errors("otel_queue_full", f"more than {self._queue.maxsize} cycles waiting for export")

    def stop(self, timeout: float = 5.0) -> None:
        """Export what is queued (each under its own deadline) for at most ``timeout``
        seconds, then stop; what is left is not sent (the thread is a daemon)."""
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._channel is not None and not self._thread.is_alive():
            self._channel.close()

    def _run(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                return
            try:
                self.export(build_request(record, self.config.service_name))
                self.exported += 1
            except Exception as error:  # noqa: BLE001 - a collector problem must never end the thread
                self.errors("otel_export", f"{self.config.protocol} {self.config.endpoint}: {error}")

    def export(self, request: collector.ExportTraceServiceRequest) -> None:
        if self.config.protocol == "http/protobuf":
            self._export_http(request)
        else:
            self._export_grpc(request)

    def _export_grpc(self, request: collector.ExportTraceServiceRequest) -> None:
        if self._stub is None:
            if self.config.insecure:
                self._channel = grpc.insecure_channel(self.config.endpoint)
            else:
                roots = Path(self.config.ca_file).read_bytes() if self.config.ca_file else None
                self._channel = grpc.secure_channel(self.config.endpoint,
                                                    grpc.ssl_channel_credentials(root_certificates=roots))
            self._stub = collector_grpc.TraceServiceStub(self._channel)
        try:
            response = self._stub.Export(request, timeout=self.config.timeout, metadata=self._headers or None)
        except grpc.RpcError as error:
            code = error.code() if hasattr(error, "code") else None
            raise RuntimeError(f"{getattr(code, 'name', code)}: {error.details() if hasattr(error, 'details') else error}") from None
        _check_partial(response)

    def _export_http(self, request: collector.ExportTraceServiceRequest) -> None:
        http = urllib.request.Request(self.config.endpoint, data=request.SerializeToString(), method="POST")
        http.add_header("Content-Type", "application/x-protobuf")
        http.add_header("User-Agent", f"tft-bridge/{__version__}")
        for name, value in self._headers:
            http.add_header(name, value)
        context = ssl.create_default_context(cafile=self.config.ca_file or None) \
            if self.config.endpoint.startswith("https:") else None
        try:
            with urllib.request.urlopen(http, timeout=self.config.timeout, context=context) as answer:  # noqa: S310
                body = answer.read(1 << 20)
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"HTTP {error.code} {error.reason}") from None
        except (urllib.error.URLError, OSError) as error:
            raise RuntimeError(str(getattr(error, "reason", error))) from None
        if body:
            _check_partial(collector.ExportTraceServiceResponse.FromString(body))


def _check_partial(response: collector.ExportTraceServiceResponse) -> None:
    partial = response.partial_success
    if partial.rejected_spans:
        raise RuntimeError(f"collector rejected {partial.rejected_spans} span(s): {partial.error_message}")
