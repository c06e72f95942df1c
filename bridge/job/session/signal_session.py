"""The job's signal session: Init -> Register -> Subscribe, forever, on the stream loop.

The session is ClusterD's only subscriber for the job (docs/clusterd.md section 4). Each
message of its stream is screened once (``signals.screen_signal``), the cycle it shows is
written to the cycle state (``bridge/job/cycle_state.py``: one publication), and it goes
to the dispatcher. The resubscribing itself is the stream loop's
(``stream_loop.StreamLoop``); everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from bridge._proto import recover_pb2 as pb
from bridge.job.cycle_state import CycleState
from bridge.job.metrics import BridgeMetrics, signal_type_label
from bridge.job.session.clusterd import (SUBSCRIBE, ClusterDClient, RpcFailure, SessionState, client_info,
                                         connection_lost, goaway)
from bridge.job.session.codes import Code
from bridge.job.session.signals import Screened, screen_signal
from bridge.job.session.stream_loop import Outcome, StreamEnd, StreamLoop, Subscription

log = logging.getLogger(__name__)

#: One message of the signal stream: the signal and its bytes (decoded once more, for
#: its fault ranks, by ``screen_signal``).
SignalMessage = tuple[pb.ProcessManageSignal, bytes]

#: Signal types whose uuid is never a cycle: ClusterD's fault centre sends preExitProcess
#: with a fresh uuid it does not keep, and changes no state (docs/clusterd.md section 5).
UNTRACKED_TYPES = frozenset({"preExitProcess"})

#: Seconds a Subscribe request gets before fault reports may follow it on the report
#: channel (docs/architecture.md, "A fault right after a recovery"): far above a LAN's
#: delivery and ClusterD's handler start, far below what a fault may wait (50 ms).
SUBSCRIBE_HEAD_START = 0.02


class SignalSink(Protocol):
    """Where the session hands each signal it read, screened (``signals.SignalDispatcher``)."""

    def submit(self, screened: Screened) -> None: ...


class ReportHandover(Protocol):
    """The report wire's side of the order between reports and signals (``relay.Wire``):
    the controller's reports it has taken, to the loop's bookkeeping, before the loop
    reacts to anything from ClusterD."""

    def catch_up(self) -> None: ...


def decode_signal(raw: bytes) -> SignalMessage:
    return pb.ProcessManageSignal.FromString(raw), raw


class Session(Subscription[SignalMessage]):
    """The signal session, from ``run()`` to ``stop()``, on the event loop.

    ClusterD ends the stream with OK after every recovery cycle and on any reset, so a
    stream end is routine: subscribe again at once after a stream that delivered, else
    after the loop's back-off. Silence longer than ``watchdog_intervals`` keep-alive
    intervals means a dead stream; Init 403 means process recovery is off for the job,
    re-checked every ``recheck_disabled``.
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
        self._info = client_info(job_id, self.config.role)
        self.loop: StreamLoop[SignalMessage] = StreamLoop(
            "signal", client, SUBSCRIBE, self._info, decode_signal,
            silence=self.config.keepalive_interval * self.config.watchdog_intervals)
        self.state = SessionState.CONNECTING
        self.live = cycles.live  # set while a subscription is live
        self.init_answered = asyncio.Event()
        self.process_recover: bool | None = None  # None until Init answered
        self.last_message_at: float | None = None
        self._token = ""  # the open stream's token (the cycle of its uuid-less signals)
        self._ended: dict[str, None] = {}  # uuids of cycles that are over, oldest first (bounded)

    # ------------------------------------------------------------------ control
    async def run(self) -> None:
        await self.loop.run(self)
        self._set_state(SessionState.STOPPED)

    def stop(self) -> None:
        self.loop.stop()

    def request_resubscribe(self, reason: str) -> None:
        """Re-run Init/Register/Subscribe (``CycleState.request_resubscribe``)."""
        self._cycles.request_resubscribe(reason)

    # ------------------------------------------------------------------ what others read
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

    # ------------------------------------------------------------------ the stream loop's steps
    async def prepare(self) -> Outcome | None:
        """Init and Register (each retried until answered), then the reports caught up and
        the wire settled before the Subscribe."""
        self._set_state(SessionState.CONNECTING)
        code = await self._unary_with_retry("/Recover/Init")
        if code is None:
            return Outcome.FAILED  # stopping: the loop ends the round
        self.process_recover = code != Code.ProcessRescheduleOff
        self.metrics.process_recover_enabled.set(1 if self.process_recover else 0)
        self.init_answered.set()
        if code == Code.ProcessRescheduleOff:
            self._set_state(SessionState.RECOVERY_OFF)
            log.warning("ClusterD: process-level recovery is off for job %s (Init 403); re-checking every %g s",
                        self.job_id, self.config.recheck_disabled)
            return Outcome.UNIMPLEMENTED
        if code != Code.OK:
            log.warning("ClusterD Init answered %s", Code.describe(code))
            return Outcome.FAILED
        code = await self._unary_with_retry("/Recover/Register")
        if code is None:
            return Outcome.FAILED
        if code != Code.OK:
            log.warning("ClusterD Register answered %s", Code.describe(code))
            return Outcome.FAILED
        self._reports.catch_up()
        await self._cycles.settle(self.config.rpc_timeout + 1.0)
        self.metrics.reconnects.labels(self._cycles.end_reason).inc()
        return None

    async def opened(self) -> None:
        """The stream is open: counted, and given a head start before fault reports may
        follow it. Its request leaves on the signal channel (connected: Init and Register
        just answered on it), and ClusterD's handler resets the job as its first act;
        nothing ClusterD sends says when. A report sent on the report channel after the
        head start lands after that reset unless the handler is later; then the fault is
        reported again (refault.py, ledger.py)."""
        self._token = self._cycles.stream_opening(self.loop.restart)
        if await self.loop.sleep(SUBSCRIBE_HEAD_START):
            return
        self._cycles.subscribe_sent()

    async def handle(self, message: SignalMessage) -> None:
        """One message: screened once, the cycle it shows published once, then to the
        dispatcher."""
        self._reports.catch_up()
        self.last_message_at = time.monotonic()
        signal, raw = message
        first = not self.live.is_set()
        stale = self._is_stale(signal)
        screened = None if stale else screen_signal(signal, raw, signal.uuid or self._token)
        self._cycles.heard(self.current_uuid if screened is None else self._track_cycle(screened))
        if first:
            self.metrics.subscription_up.set(1)
            self._set_state(SessionState.SUBSCRIBED)
        if screened is not None:
            self._dispatcher.submit(screened)

    def ended(self, end: StreamEnd) -> float | None:
        """A round's end: the stream's end published once; at once again after a stream
        that delivered and ended cleanly (ClusterD closes it after every cycle), else the
        loop's back-off."""
        if not end.opened:
            return None  # Init or Register refused: nothing was subscribed
        self._reports.catch_up()
        self._cycle_over(self.current_uuid)
        reason = self._reason(end)
        self._cycles.stream_ended(reason)
        self.metrics.subscription_up.set(0)
        if end.outcome is Outcome.STOPPED:
            return None
        if end.outcome is Outcome.ENDED:
            log.info("ClusterD ended the signal stream (end of a recovery cycle or a server-side reset)")
            self.loop.backoff.reset()  # routine: ClusterD closes the stream after every cycle
            if end.messages:
                # At once, as MindCluster's client does: a fault in the moment after a
                # recovery must find the next subscription without a back-off's delay.
                return 0.0
        self._set_state(SessionState.BACKOFF)
        return None

    # ------------------------------------------------------------------ inside
    def _set_state(self, state: SessionState) -> None:
        if state is not self.state:
            log.info("ClusterD session: %s -> %s", self.state.value, state.value)
        self.state = state
        for told in self._on_state:
            told(state)

    def _reason(self, end: StreamEnd) -> str:
        """Why a stream ended, as ``tft_bridge_clusterd_reconnects_total`` names it."""
        if end.outcome is Outcome.ENDED:
            return "cycle_end"
        if end.outcome is Outcome.SILENT:
            return "keepalive_timeout"
        if end.outcome is Outcome.STOPPED:
            return "stopped"
        if end.outcome is Outcome.RESTARTED:
            return self._cycles.end_reason  # the request's own reason
        if goaway(end.detail):
            connection_lost(self.metrics, "signal", end.detail)
        return f"stream_{end.status.lower()}"

    async def _unary_with_retry(self, method: str) -> int | None:
        """Init/Register: retried on any transport failure after the loop's back-off;
        None once stopping."""
        while not self.loop.stopping:
            try:
                return await self.client.call(method, self._info)
            except RpcFailure as failure:
                log.warning("ClusterD %s failed: %s %s", failure.method, failure.status, failure.detail)
                await self.loop.sleep(self.loop.backoff.next())
        return None

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
