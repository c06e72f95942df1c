"""The ClusterD side: one channel, deadline-bound unary calls, and the signal session.

Requests go out as bytes already encoded by the fast codec (``bridge.faults``), so the
generated message classes are used only for the small ``ClientInfo`` and ``Status``.
Every unary call has a deadline; a call that failed is classified by whether it
provably did not reach ClusterD (``qps exceeded``, no connection) or its outcome is
unknown, because ClusterD's one-slot report buffers make a blind resend dangerous.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc

from bridge._proto import recover_pb2 as pb
from bridge.core.backoff import Backoff
from bridge.job.session.codes import Code
from bridge.core.config import ClusterDConfig
from bridge.job.cycle_state import CycleState
from bridge.job.metrics import BridgeMetrics, code_label, signal_type_label
from bridge.job.session.signals import Screened, screen_signal

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

    def subscribe(self, job_id: str, role: str) -> Any:
        """The signal stream; each message arrives as (ProcessManageSignal, raw bytes)."""
        assert self.channel is not None
        stream = self.channel.unary_stream(
            SUBSCRIBE, request_serializer=None, response_deserializer=lambda raw: (pb.ProcessManageSignal.FromString(raw), raw)
        )
        return stream(client_info(job_id, role), timeout=None)


class SessionState(enum.Enum):
    CONNECTING = "connecting"
    RECOVERY_OFF = "process recovery off (403)"
    SUBSCRIBED = "subscribed"
    BACKOFF = "reconnecting"
    STOPPED = "stopped"


class SignalSink(Protocol):
    """Where the session hands each signal it read, screened (``signals.SignalDispatcher``)."""

    def submit(self, screened: Screened) -> None: ...


class ReportHandover(Protocol):
    """The report wire's side of the order between reports and signals (``relay.Wire``):
    the controller's reports it has taken, to the loop's bookkeeping, before the loop
    reacts to anything from ClusterD."""

    def catch_up(self) -> None: ...


#: Signal types whose uuid is never a cycle: ClusterD's fault centre sends preExitProcess
#: with a fresh uuid it does not keep, and changes no state (docs/clusterd.md section 5).
UNTRACKED_TYPES = frozenset({"preExitProcess"})


#: Seconds a Subscribe request gets before fault reports may follow it on the report
#: channel (docs/architecture.md, "A fault right after a recovery"): far above a LAN's
#: delivery and ClusterD's handler start, far below what a fault may wait (50 ms).
SUBSCRIBE_HEAD_START = 0.02


class Session:
    """Init -> Register -> Subscribe, forever: the job's only ClusterD subscriber, on the
    event loop from ``run()`` to ``stop()``.

    Each message of the stream is screened once, the cycle it shows is written to the
    cycle state (one publication), and it goes to the dispatcher. ClusterD ends the
    stream with OK after every recovery cycle and on any reset, so a stream end is
    routine: subscribe again at once after a stream that delivered, else after a short
    jittered pause. Silence longer than ``watchdog_intervals`` keep-alive intervals
    means a dead stream; Init 403 means process recovery is off for the job, re-checked
    every ``recheck_disabled`` (docs/clusterd.md section 4).
    """

    def __init__(self, job_id: str, client: ClusterDClient, metrics: BridgeMetrics, cycles: CycleState,
                 dispatcher: SignalSink, reports: ReportHandover,
                 on_state: Sequence[Callable[[SessionState], None]] = ()) -> None:
        """``cycles``: where the stream's state is written (live, subscribed, the running
        cycle), a resubscribe request is read, and the report wire is settled before each
        Subscribe. ``dispatcher``: takes each screened signal. ``reports``: caught up before
        the loop reacts to anything from ClusterD (a message, a stream's end, a Subscribe),
        so the bookkeeping never learns of ClusterD's answer to a report before the report.
        ``on_state``: told of every state change, in order."""
        self.job_id = job_id
        self.client = client
        self.config = client.config
        self.metrics = metrics
        self._cycles = cycles
        self._dispatcher = dispatcher
        self._reports = reports
        self._on_state = tuple(on_state)
        self.state = SessionState.CONNECTING
        self.live = cycles.live  # set while a subscription is live
        self._heard = False  # the stream that ended delivered a message
        self.init_answered = asyncio.Event()
        self.process_recover: bool | None = None  # None until Init answered
        self.last_message_at: float | None = None
        self._stopping = asyncio.Event()
        self._call: Any = None
        self._ended: dict[str, None] = {}  # uuids of cycles that are over, oldest first (bounded)

    def _set_state(self, state: SessionState) -> None:
        if state is not self.state:
            log.info("ClusterD session: %s -> %s", self.state.value, state.value)
        self.state = state
        for told in self._on_state:
            told(state)

    @property
    def current_uuid(self) -> str | None:
        """The running cycle as the stream shows it."""
        return self._cycles.snapshot.running

    @property
    def subscribe_sent(self) -> bool:
        """The Subscribe had its head start and its stream has not ended."""
        return self._cycles.snapshot.subscribed

    @property
    def end_reason(self) -> str:
        """Why the previous stream ended (``CycleState.end_reason``)."""
        return self._cycles.end_reason

    @property
    def stream_count(self) -> int:
        return self._cycles.stream_count

    def stream_token(self) -> str:
        return self._cycles.stream_token()

    def last_heard(self) -> float | None:
        """When the stream last delivered a message (monotonic; None before any)."""
        return self.last_message_at

    def request_resubscribe(self, reason: str) -> None:
        """Re-run Init/Register/Subscribe (``CycleState.request_resubscribe``)."""
        self._cycles.request_resubscribe(reason)

    def stop(self) -> None:
        self._stopping.set()
        if self._call is not None:
            self._call.cancel()

    async def _sleep(self, seconds: float) -> bool:
        """Sleep unless stopped first; True when stopping."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
            return True
        except asyncio.TimeoutError:
            return False

    async def _unary_with_retry(self, method: str, payload: bytes, backoff: Backoff) -> int | None:
        """Init/Register: retried on any transport failure; None when stopping."""
        while not self._stopping.is_set():
            try:
                return await self.client.call(method, payload)
            except RpcFailure as failure:
                log.warning("ClusterD %s failed: %s %s", failure.method, failure.status, failure.detail)
                if await self._sleep(backoff.next()):
                    return None
        return None

    async def run(self) -> None:
        backoff = Backoff(self.config.reconnect_initial, self.config.reconnect_max)
        info = client_info(self.job_id, self.config.role)
        while not self._stopping.is_set():
            self._set_state(SessionState.CONNECTING)
            code = await self._unary_with_retry("/Recover/Init", info, backoff)
            if code is None:
                break
            self.process_recover = code != Code.ProcessRescheduleOff
            self.metrics.process_recover_enabled.set(1 if self.process_recover else 0)
            self.init_answered.set()
            if code == Code.ProcessRescheduleOff:
                self._set_state(SessionState.RECOVERY_OFF)
                log.warning("ClusterD: process-level recovery is off for job %s (Init 403); re-checking every %.0f s",
                            self.job_id, self.config.recheck_disabled)
                if await self._sleep(self.config.recheck_disabled):
                    break
                continue
            if code != Code.OK:
                log.warning("ClusterD Init answered %s", Code.describe(code))
                if await self._sleep(backoff.next()):
                    break
                continue
            code = await self._unary_with_retry("/Recover/Register", info, backoff)
            if code is None:
                break
            if code != Code.OK:
                log.warning("ClusterD Register answered %s", Code.describe(code))
                if await self._sleep(backoff.next()):
                    break
                continue
            self._reports.catch_up()
            await self._cycles.settle(self.config.rpc_timeout + 1.0)
            reason = await self._subscribe_once()
            if self._stopping.is_set():
                break
            if reason == "cycle_end":
                backoff.reset()  # routine: ClusterD closes the stream after every cycle
                if self._heard:
                    # At once, as MindCluster's client does: a fault in the moment after a
                    # recovery must find the next subscription without a back-off's delay.
                    continue
            self._set_state(SessionState.BACKOFF)
            if await self._sleep(backoff.next()):
                break
        self._set_state(SessionState.STOPPED)

    async def _subscribe_once(self) -> str:
        """One stream, until it ends; the reason it ended."""
        self.metrics.reconnects.labels(self._cycles.end_reason).inc()
        call = self.client.subscribe(self.job_id, self.config.role)
        self._call = call
        token = self._cycles.stream_opening(call.cancel)
        self._heard = False
        silence = self.config.keepalive_interval * self.config.watchdog_intervals
        reason = "cycle_end"
        try:
            # A head start for the Subscribe: its request leaves on the signal channel
            # (connected: Init and Register just answered on it), and ClusterD's handler
            # resets the job as its first act; nothing ClusterD sends says when (no header,
            # no message before the first keep-alive). A report sent on the report
            # channel after this lands after that reset unless the handler is later than
            # the head start; then the fault is reported again (refault.py, ledger.py).
            if await self._sleep(SUBSCRIBE_HEAD_START):
                reason = "stopped"
                return reason
            self._cycles.subscribe_sent()
            while True:
                try:
                    item = await asyncio.wait_for(call.read(), silence)
                except asyncio.TimeoutError:
                    log.warning("ClusterD signal stream silent for %.0f s (no keep-alive): treating it as dead", silence)
                    reason = "keepalive_timeout"
                    break
                self._reports.catch_up()
                if item is grpc.aio.EOF:
                    reason = "cycle_end"
                    break
                self._heard = True
                self.last_message_at = time.monotonic()
                self._on_message(*item, token)
        except asyncio.CancelledError:
            if self._stopping.is_set() or self._cycles.resubscribe_requested:
                reason = "stopped" if self._stopping.is_set() else self._cycles.end_reason
            else:
                raise
        except grpc.aio.AioRpcError as error:
            reason = f"stream_{error.code().name.lower()}"
            log.warning("ClusterD signal stream ended: %s %s", error.code().name, error.details())
            if goaway(error.details() or ""):
                connection_lost(self.metrics, "signal", error.details() or "")
        finally:
            call.cancel()
            self._call = None
            self._reports.catch_up()
            self._cycle_over(self.current_uuid)
            self._cycles.stream_ended(reason)
            self.metrics.subscription_up.set(0)
        if reason == "cycle_end":
            log.info("ClusterD ended the signal stream (end of a recovery cycle or a server-side reset)")
        return reason

    def _on_message(self, signal: pb.ProcessManageSignal, raw: bytes, token: str) -> None:
        """One message of the stream: screened once, the cycle it shows published once
        (``CycleState.heard``), then handed to the dispatcher."""
        first = not self.live.is_set()
        stale = self._is_stale(signal)
        screened = None if stale else screen_signal(signal, raw, signal.uuid or token)
        self._cycles.heard(self.current_uuid if screened is None else self._track_cycle(screened))
        if first:
            self.metrics.subscription_up.set(1)
            self._set_state(SessionState.SUBSCRIBED)
        if screened is not None:
            self._dispatcher.submit(screened)

    def _is_stale(self, signal: pb.ProcessManageSignal) -> bool:
        """A signal of a cycle that is already over (reordered, or repeated by a ClusterD
        that lost track) must neither reach the controller nor be adopted as the running
        cycle: ClusterD never resumes a cycle once it ended."""
        if not signal.uuid or signal.uuid not in self._ended:
            return False
        if signal.signalType != "keep-alive":
            self.metrics.signals_received.labels(signal_type_label(signal.signalType)).inc()
            self.metrics.signals_refused.labels("stale_cycle").inc()
            log.warning("not forwarding %s %s: its cycle %s is already over", signal.signalType,
                        list(signal.actions), signal.uuid)
        return True

    def _track_cycle(self, screened: Screened) -> str | None:
        """The running cycle once ``screened`` is seen (the one before it is over when
        they differ). A signal refused whole (``Screened.refusal``) changes nothing."""
        signal, current = screened.signal, self.current_uuid
        uuid = signal.uuid
        if signal.jobId and signal.jobId != self.job_id:
            return current
        if signal.signalType in UNTRACKED_TYPES:
            return current
        if signal.signalType == "keep-alive":
            if current and uuid != current:
                log.warning("keep-alive shows cycle %r, not %r: ClusterD abandoned the cycle", uuid, current)
                self._cycle_over(current)
                current = None
            return uuid if uuid and not current else current
        if uuid and uuid != current:
            refusal = screened.refusal
            if refusal is not None:  # counted and logged (within a budget) by the dispatcher, which refuses it too
                log.debug("%s with uuid %s is %s: the running cycle %s stays current", signal.signalType or "(no type)",
                          uuid, refusal[0], current)
                return current
            self._cycle_over(current)
            return uuid
        return current

    def _cycle_over(self, uuid: str | None) -> None:
        """``uuid``'s cycle is over: a later signal of it is stale (bounded memory)."""
        if uuid:
            self._ended[uuid] = None
            while len(self._ended) > 256:
                del self._ended[next(iter(self._ended))]


async def run_logged(name: str, coroutine: Awaitable[Any]) -> Any:
    """Await a background task's body and make any failure visible in the log."""
    try:
        return await coroutine
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background task %s failed", name)
        raise
