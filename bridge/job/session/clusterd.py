"""ClusterD's channels and calls: options, credentials, deadline-bound unary calls, and
how a failed call is classified.

Requests go out as bytes already encoded by the fast codec (``bridge.faults``), so the
generated message classes are used only for the small ``ClientInfo`` and ``Status``.
Every unary call has a deadline; a call that failed is classified by whether it
provably did not reach ClusterD (``qps exceeded``, no connection) or its outcome is
unknown, because ClusterD's one-slot report buffers make a blind resend dangerous. The
signal session is ``signal_session.py``; the streams run on ``stream_loop.py``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from bridge._proto import recover_pb2 as pb
from bridge.core.config import ClusterDConfig
from bridge.job.metrics import BridgeMetrics, code_label

log = logging.getLogger(__name__)

SUBSCRIBE = "/Recover/SubscribeProcessManageSignal"


class Delivery(enum.Enum):
    NOT_DELIVERED = "not_delivered"  # provably never reached ClusterD: safe to resend
    UNKNOWN = "unknown"  # may have reached ClusterD: never resend a cycle-bound report


class RpcFailure(Exception):
    def __init__(self, method: str, status: str, detail: str, delivery: Delivery) -> None:
        super().__init__(f"{method}: {status}: {detail}")
        self.method, self.status, self.detail, self.delivery = method, status, detail, delivery


#: gRPC's largest timeout (INT_MAX ms, about 25 days): a channel that never goes idle.
NEVER_IDLE_MS = 2**31 - 1
#: Pings on a stream ClusterD does not write to regularly (the rank table's): gRPC's
#: default policy counts no strike for a ping at least 5 minutes after the previous one.
QUIET_STREAM_PING = 330.0


def channel_options(config: ClusterDConfig, *, pings: float | None = None) -> list[tuple[str, Any]]:
    """The options of a channel to ClusterD. ``pings``: seconds between keep-alive pings
    while a call is open (default ``grpc_keepalive``); 0 for none (the report channel).

    Keep-alive pings must pass every ClusterD release's enforcement (docs/releases.md).
    Master allows pings 3 s apart with or without a call; v7.3.2 and v7.0.RC1 set no
    policy, so gRPC's default applies there: a ping without an open call, or less than
    5 minutes after the last one while the server wrote nothing, is a strike, and the
    third strike closes the connection with GOAWAY ENHANCE_YOUR_CALM "too_many_pings".
    So no channel pings without an open call (``permit_without_calls`` 0). The signal
    channel pings only while its stream is open, and ClusterD writes a keep-alive on it
    every 5 s, which clears the strikes before the next ping (``grpc_keepalive`` >= 10 s).
    The report channel does not ping at all: its calls are short and a call that waits
    in ClusterD (a full one-slot buffer) would collect strikes, since nothing is written
    on it meanwhile; a dead ClusterD is found by the signal stream's keep-alive watchdog,
    and a report call by its deadline. The rank table's stream gets no keep-alive from
    ClusterD, so its pings come ``QUIET_STREAM_PING`` apart, beyond the default policy's
    5 minutes: a dead connection is still found, and no release counts a strike."""
    interval = config.grpc_keepalive if pings is None else pings
    keepalive: list[tuple[str, Any]] = [("grpc.keepalive_time_ms", int(interval * 1000)),
                                        ("grpc.keepalive_timeout_ms", 10_000)] if interval > 0 else []
    return [
        *keepalive,
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", 8 * 1024 * 1024),
        ("grpc.max_send_message_length", 4 * 1024 * 1024),
        ("grpc.enable_retries", 0),  # retries are decided here, per report kind
        # gRPC drops a connection unused for 30 minutes (its client idle timeout): the
        # next report would pay the reconnect (more than twice a report's time against
        # ClusterD), and the drop would look like ClusterD closing the connection.
        ("grpc.client_idle_timeout_ms", NEVER_IDLE_MS),
        # Reconnecting follows the session's own backoff, not gRPC's default (1 s growing
        # to 120 s), which could keep the bridge away longer than the controller waits.
        ("grpc.initial_reconnect_backoff_ms", max(1, int(config.reconnect_initial * 1000))),
        ("grpc.min_reconnect_backoff_ms", max(1, int(config.reconnect_initial * 1000))),
        ("grpc.max_reconnect_backoff_ms", max(1, int(config.reconnect_max * 1000))),
    ]


def classify_failure(error: grpc.RpcError, was_ready: bool) -> tuple[str, Delivery]:
    """A failed call's status label and whether it provably never reached ClusterD:
    refused by its rate limiter (UNKNOWN ``qps exceeded``, before any handler runs), or
    UNAVAILABLE on a channel that was not connected when the call started. Anything else
    may have reached it, and ClusterD's one-slot buffers make a blind resend dangerous."""
    detail = error.details() or ""
    code = error.code()
    if code is grpc.StatusCode.UNKNOWN and "qps exceeded" in detail:
        return "QPS_EXCEEDED", Delivery.NOT_DELIVERED
    delivery = Delivery.NOT_DELIVERED if code is grpc.StatusCode.UNAVAILABLE and not was_ready else Delivery.UNKNOWN
    return code.name, delivery


def goaway(detail: str) -> bool:
    """Whether a call's error says ClusterD closed the connection with GOAWAY (gRPC core
    words a too_many_pings GOAWAY under an open stream as "Too many pings")."""
    text = detail.lower()
    return "goaway" in text or "too many pings" in text or "too_many_pings" in text


def connection_lost(metrics: BridgeMetrics, channel: str, detail: str) -> None:
    """ClusterD closed a channel's connection under the bridge: logged and counted.

    A GOAWAY (``too_many_pings`` from a release enforcing gRPC's default ping policy, or
    a ClusterD shutting down) and a broken connection look alike to the client: the
    channel leaves READY. gRPC reconnects at the next call; a report in flight at that
    moment fails with an unknown outcome (``Delivery.UNKNOWN``, counted by the wire).
    Logged before it is counted: whoever sees the count (an alert, a test) finds the line."""
    log.warning("ClusterD closed the %s channel's connection (%s): a GOAWAY (e.g. too_many_pings: gRPC's own log "
                "line says which) or a lost connection; gRPC reconnects at the next call", channel, detail)
    metrics.clusterd_connection_lost.labels(channel).inc()


def channel_credentials(config: ClusterDConfig) -> grpc.ChannelCredentials:
    """TLS for deployments with a TLS-terminating proxy in front of ClusterD. A named file
    that cannot be read is an error, never a silent fall back to plaintext."""

    def read(path: str) -> bytes | None:
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as error:
            raise ValueError(f"cannot read TLS file {path!r}: {error.strerror or error}") from error

    return grpc.ssl_channel_credentials(
        root_certificates=read(config.ca_file),
        private_key=read(config.key_file),
        certificate_chain=read(config.cert_file),
    )


def report_channel(config: ClusterDConfig) -> grpc.Channel:
    """The Report* calls' synchronous channel (the report wire's, reports/relay.py): ``grpc.aio`` hands
    each call between the event loop and gRPC's poller thread, one more wake-up per hop.
    It does not ping (``channel_options``)."""
    options = channel_options(config, pings=0)
    if config.tls:
        return grpc.secure_channel(config.address, channel_credentials(config), options)
    return grpc.insecure_channel(config.address, options)


def client_info(job_id: str, role: str) -> bytes:
    return pb.ClientInfo(jobId=job_id, role=role).SerializeToString()


class ClusterDClient:
    """The channel and the calls. Create and use it inside the running event loop."""

    def __init__(self, config: ClusterDConfig, metrics: BridgeMetrics, realtime_priority: int = 0,
                 *, quiet_stream: bool = False,
                 on_rpc: Callable[[str, int | str, float, float], None] | None = None) -> None:
        """``quiet_stream``: the client's stream gets no regular writes from ClusterD (the
        rank table's), so its channel pings only every ``QUIET_STREAM_PING``. ``on_rpc``:
        told (method, code or gRPC status, started, seconds) of every unary call, on the
        loop (the flight recorder's RPC timeline; O(1))."""
        self.config = config
        self._pings = max(config.grpc_keepalive, QUIET_STREAM_PING) if quiet_stream else None
        self.metrics = metrics
        self.realtime_priority = realtime_priority  # of the report wire (bridge/job/sched/realtime.py)
        self.channel: grpc.aio.Channel | None = None
        self._callables: dict[str, Any] = {}
        self.on_rpc = on_rpc

    async def open(self) -> None:
        options = channel_options(self.config, pings=self._pings)
        if self.config.tls:
            self.channel = grpc.aio.secure_channel(self.config.address, channel_credentials(self.config), options)
        else:
            self.channel = grpc.aio.insecure_channel(self.config.address, options)
        self._callables = {}

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close(grace=None)
            self.channel = None

    def _unary(self, method: str) -> Any:
        if method not in self._callables:
            assert self.channel is not None
            self._callables[method] = self.channel.unary_unary(
                method, request_serializer=None, response_deserializer=pb.Status.FromString
            )
        return self._callables[method]

    def connected(self) -> bool:
        return self.channel is not None and self.channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY

    async def call(self, method: str, payload: bytes, timeout: float | None = None) -> int:
        """Send one pre-encoded request; the Status code, or RpcFailure."""
        return (await self.call_status(method, payload, timeout)).code

    async def call_status(self, method: str, payload: bytes, timeout: float | None = None) -> pb.Status:
        """Send one pre-encoded request; ClusterD's whole Status, or RpcFailure. (The
        Report* calls are the report wire's, on a channel of its own: reports/relay.py.)"""
        name = method.rsplit("/", 1)[-1]
        # whether the channel the call goes over was connected: never-resend depends on it
        was_ready = self.connected()
        started = time.monotonic()
        try:
            status = await self._unary(method)(payload, timeout=timeout or self.config.rpc_timeout)
        except grpc.RpcError as error:
            raise self._failure(name, error, started, was_ready) from None
        return self._answered(name, status, started)

    def observe_rpc(self, method: str, code: int | str, started: float, seconds: float) -> None:
        """A call's outcome, to ``on_rpc`` when set (on the loop): this client's own calls
        and the report wire's (``relay.RpcObserver``), so whoever watches sees them all."""
        if self.on_rpc is not None:
            self.on_rpc(method, code, started, seconds)

    def _failure(self, name: str, error: grpc.RpcError, started: float, was_ready: bool) -> RpcFailure:
        """A grpc.aio.AioRpcError, counted and classified."""
        self.metrics.rpc_seconds.labels(name).observe(time.monotonic() - started)
        status, delivery = classify_failure(error, was_ready)
        self.metrics.rpcs.labels(name, status).inc()
        self.observe_rpc(name, status, started, time.monotonic() - started)
        return RpcFailure(name, status, error.details() or "", delivery)

    def _answered(self, name: str, status: pb.Status, started: float) -> pb.Status:
        self.metrics.rpc_seconds.labels(name).observe(time.monotonic() - started)
        self.metrics.rpcs.labels(name, code_label(status.code)).inc()
        self.observe_rpc(name, status.code, started, time.monotonic() - started)
        return status


class SessionState(enum.Enum):
    CONNECTING = "connecting"
    RECOVERY_OFF = "process recovery off (403)"
    SUBSCRIBED = "subscribed"
    BACKOFF = "reconnecting"
    STOPPED = "stopped"


async def run_logged(name: str, coroutine: Awaitable[Any]) -> Any:
    """Await a background task's body and make any failure visible in the log."""
    try:
        return await coroutine
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background task %s failed", name)
        raise
