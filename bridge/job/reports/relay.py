"""The report path's one owner: the controller's callbacks -> ClusterD's Report* RPCs.

One thread, ``tft-wire``, owns the outbox, the report channel (a synchronous gRPC
channel: ``grpc.aio`` hands each call between the event loop and gRPC's poller thread,
one more wake-up per hop) and every rule of delivery. The controller's callbacks put
their arguments straight into its inbox (one thread crossing before the wire, as the
synchronous MindCluster client has none); the event loop puts in what it reports itself
(a re-report on a new stream, the resume's answers, the seed API) and publishes what the
wire needs of its state as one immutable ``Cycles`` snapshot. The wire hands each
controller report back to the loop for its bookkeeping (the flow, the recovery clock,
the resume, metrics, the recorder) once it has nothing left to send; the loop takes
them earlier, at once, before it reacts to anything from ClusterD (``catch_up``), so it
never learns of ClusterD's answer to a report before the report.

Delivery rules, each from a way the real ClusterD punishes a careless client:

* **In callback order, one call at a time.** A report leaves only after the one before
  it was answered; the next one goes out the moment that answer is code 0, from this
  thread (the strategies report right behind the cycle's second fault report: the
  recovery's critical path). ClusterD must get a fault report of the cycle before the
  strategy that repairs it, and two HTTP/2 streams give no order between its handlers.
* **A report answers one cycle.** A stop-complete, strategy or result report is bound
  to ``Cycles.answering`` as it was when the controller made the callback (its stamp),
  not when this thread takes it: the cycle whose notify the controller last accepted,
  published by the loop before it makes that notify, so it is already the right one
  when the controller's callback runs. ClusterD keeps reports in one-slot buffers
  whatever its state, so a report whose cycle is gone is dropped and counted, never
  sent into the next.
* **Fault reports wait for a subscription**: they leave once the Subscribe request has
  had its head start (``Cycles.subscribed``; ClusterD loses faults reported while nobody is
  subscribed, and resets the job inside the Subscribe handler before anything else),
  survive reconnects and merge with ClusterD's rule while queued. The loop hears of each
  one ClusterD answered 0 (``faults_delivered``: refault.py).
* **Code 0 is never resent; an unknown outcome is final.** A cycle-bound report is
  retried only when it provably did not reach ClusterD (``qps exceeded``, no connection
  when the call started): a second copy would sit in ClusterD's one-slot buffer.
* **Bounded.** Past ``limit`` the oldest cycle-bound report waiting is dropped; fault
  reports merge, so no fault rank is ever dropped.
* **Settled before a Subscribe.** A Subscribe resets ClusterD's job and empties its
  buffers; a report of the ended stream still on the wire would land in the new cycle's.
  ``publish`` and the check before each cycle-bound call take one lock, so once the loop
  has published a stream's end no cycle-bound report of it starts, and ``settle`` waits
  for those already out.

Connectivity: whether the channel is connected decides a failed call's fate (above), and
ClusterD closing it (a GOAWAY, a lost connection) is logged and counted. The wire reads
the state itself, at each call's start and every ``CONNECTIVITY_LOOK`` seconds while it
waits (``lowlevel.connectivity_check``), instead of gRPC's ``Channel.subscribe``, whose
polling thread re-arms a 0.2 s watch without end: with it the idle bridge woke the node
more than MindCluster's synchronous client did.

Scheduling (``realtime.py``, ``affinity.py``): the thread waits for callbacks under
``SCHED_BATCH`` on the controller's CPU (a realtime wake-up preempted the controller's
thread inside its callback, and the controller blocks on every callback) and runs
``SCHED_FIFO`` from the moment a request is written (``lowlevel.after_send``) until it
waits for callbacks again, so ClusterD's answer wakes it at once on busy cores; not
before the write, because a realtime writer keeps ClusterD's receiving thread, which
Linux puts on the writer's CPU on loopback, off it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import grpc

from bridge import faults as codec
from bridge.job.sched import grpc_internals as lowlevel, realtime
from bridge.job.sched.affinity import ControllerPin
from bridge.core.backoff import Backoff
from bridge.job.session.clusterd import Delivery, RpcFailure, classify_failure, connection_lost
from bridge.job.session.codes import Code
from bridge.job.metrics import BridgeMetrics, code_label, drop_reason_for_code
from bridge.job.reports.kinds import KINDS, METHODS, ReportFields, status_code

log = logging.getLogger(__name__)

#: The code a caller waiting for a dropped report receives (bridge.recover_manager).
DROP_CODES = {
    "no_live_cycle": Code.OrderMix,  # the cycle it answers is over: out of state-machine order
    "cycle_ended": Code.OrderMix,
    "outbox_full": Code.EventQueueBusy,
    "shutdown": Code.ServerInnerError,  # never sent
}


@dataclass(frozen=True)
class Cycles:
    """What the wire needs of the event loop's state, published whole by the loop
    (``Wire.publish``) and only read here: never a field of a loop object read from this
    thread."""

    live: bool = False  # a subscription is live (Session.live)
    # A Subscribe request is on its way and its stream has not ended (Session.subscribe_sent):
    # ClusterD resets the job inside the Subscribe handler before anything else, so a
    # fault report from then on reaches the new subscription's job (docs/architecture.md).
    subscribed: bool = False
    running: str | None = None  # the running cycle's uuid as the stream shows it
    stream: str | None = None  # the live stream's token (the cycle of uuid-less signals)
    answering: str | None = None  # the cycle the controller answers now (ControllerFlow.answering)
    # A cycle whose strategies report the loop must narrow before it leaves (resume.py:
    # a cycle rebound at GLOBAL_SENT whose globalFault names more ranks).
    narrowed: str | None = None

    def alive(self, token: str | None) -> bool:
        """Whether a report answering ``token`` may still be delivered."""
        return bool(token) and self.live and token in (self.running, self.stream)


class Taken(NamedTuple):
    """A controller report as the wire took it, for the loop's bookkeeping."""

    callback: str
    args: tuple[Any, ...]
    at: float  # time.monotonic() on the controller's thread
    waiter: Future[int] | None
    cycle: str | None  # the cycle it was bound to (cycle-bound kinds)
    faults: dict[int, int]  # its cleaned fault map
    bad: int  # fault entries left out
    error: str  # the codec's message for the first bad entry, or why the report is malformed
    malformed: bool  # not sent: answered 499 by the loop
    held: Pending | None  # a strategies report the loop must narrow and ``fill``


class WireListener(Protocol):
    """What the wire tells the event loop; every call is made on the loop."""

    def taken(self, reports: list[Taken]) -> None: ...

    def dropped(self, kind: str, cycle: str | None, reason: str) -> None: ...

    def outcome_unknown(self, kind: str) -> None: ...

    def faults_delivered(self, faults: dict[int, int], at: float) -> None: ...

    def resubscribe(self, reason: str) -> None: ...

    def rpc(self, method: str, code: int | str, started: float, seconds: float) -> None: ...


@dataclass
class Pending:
    kind: str  # a key of METHODS
    cycle: str | None = None  # the uuid a cycle-bound report answers
    payload: bytes = b""  # encoded request (cycle-bound reports)
    faults: dict[int, int] = field(default_factory=dict)  # fault reports, merged until sent
    sending: bool = False  # on the wire now: nothing may merge into it any more
    held: bool = False  # waits for the loop's ``fill`` (a narrowed strategies report)
    waiters: list[Future[int]] = field(default_factory=list)

    def resolve(self, code: int) -> None:
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(code)


class _Submit(NamedTuple):  # from the loop
    pending: Pending


class _Fill(NamedTuple):  # from the loop: a held report's payload (None: drop it)
    pending: Pending
    payload: bytes | None


_STOP = object()
_WAKE = object()

#: Seconds between looks at the report channel's connectivity while the wire waits: how
#: late a connection ClusterD closed under an idle bridge is logged and counted. It stays
#: not READY until the next call reconnects (gRPC reconnects an idle channel only then),
#: so no loss is missed between looks.
CONNECTIVITY_LOOK = 1.0


class Wire:
    """The outbox and the report channel, on the thread ``tft-wire``. ``put`` is the
    controller callbacks' sink (any thread, never blocks); ``submit_faults``,
    ``submit_cycle_report``, ``fill``, ``publish``, ``catch_up``, ``settle``, ``drain`` and
    ``stop`` are the event loop's."""

    def __init__(self, job_id: str, channel: grpc.Channel, loop: asyncio.AbstractEventLoop,
                 listener: WireListener, metrics: BridgeMetrics, *, rpc_timeout: float,
                 backoff: Backoff, limit: int = 10_000, realtime_priority: int = 0,
                 pin: ControllerPin | None = None) -> None:
        self.job_id = job_id
        self._channel = channel
        self._loop = loop
        self._listener = listener
        self._metrics = metrics
        self._rpc_timeout = rpc_timeout
        self._backoff = backoff  # reset on every answer
        self._limit = limit
        self._priority = realtime_priority
        self.pin = pin if pin is not None else ControllerPin(False)
        # -- shared, each says how
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()  # any thread -> wire
        self.put: Callable[[ReportFields], None] = self._inbox.put  # the callbacks' sink: one C call
        self._handed: deque[list[Taken]] = deque()  # wire -> loop (append / popleft: atomic)
        self._lock = threading.Lock()  # ``_cycles`` replaced, and read with ``_unsettled`` changed
        self._cycles = Cycles()  # replaced whole by the loop under ``_lock``, read here
        # When ``answering`` changed (monotonic, the loop's stamp before it published),
        # newest last: appended by the loop and read here, both under ``_lock``.
        self._answering_since: deque[tuple[float, str | None]] = deque([(float("-inf"), None)], maxlen=64)
        self._unsettled = 0  # cycle-bound calls on the wire (under ``_lock``)
        self._settled = asyncio.Event()  # the loop's: set (posted by the wire) when ``_unsettled`` fell to 0
        # -- the wire's own
        self._outbox: deque[Pending] = deque()
        self.after_send = True  # promoted after each write (False: gRPC has no channel object to wrap)
        # Made here, not inside a job's first report of each kind, which it held back on
        # the real peers; read by the wire's thread only.
        self._callables: dict[str, Any] = {method: self._make_callable(method) for method in METHODS.values()}
        self._ready = False  # the channel was connected at the last look (``_on_state``)
        self._boosted = False
        self._refused = False
        self._retry_at = 0.0  # the head's next try after a failure (monotonic)
        self._waiting = False  # blocked on the inbox (the loop reads it: ``handed_all``)
        self._stopping = False
        self._closing = False  # ``stop`` closes the channel: its leaving READY is ours
        self.realtime = False  # this thread may run SCHED_FIFO (tft_bridge_realtime_thread{thread="report"})
        self.batch_policy = False
        self._held_tells: list[tuple[Callable[..., Any], tuple[Any, ...]]] | None = None  # during ``_take``
        metrics.outbox_depth.set_function(lambda: len(self._outbox))
        self._connectivity = lowlevel.connectivity_check(channel)
        if self._connectivity is None:
            log.warning("this grpcio's channel cannot be asked its connectivity: gRPC's polling thread watches it")
            channel.subscribe(self._on_state, try_to_connect=True)  # connected before the first report
        self._thread = threading.Thread(target=self._run, name="tft-wire", daemon=True)
        self._thread.start()

    # ================================================================ the loop's side
    def publish(self, cycles: Cycles) -> None:
        """The loop's state changed (a stream's start or end, a new cycle, a notify about
        to be made). Under ``_lock``: from now on no cycle-bound report of a cycle this
        says is gone starts."""
        stamp = time.monotonic()  # before the store: a callback answering this cycle comes after it
        with self._lock:
            self._cycles = cycles
            if cycles.answering != self._answering_since[-1][1]:
                self._answering_since.append((stamp, cycles.answering))
        self._inbox.put(_WAKE)

    def submit_faults(self, faults: dict[int, int], waiter: Future[int] | None = None) -> None:
        self._inbox.put(_Submit(Pending("fault", faults=dict(faults), waiters=[waiter] if waiter else [])))

    def submit_cycle_report(self, kind: str, cycle: str | None, payload: bytes,
                            waiter: Future[int] | None = None) -> None:
        self._inbox.put(_Submit(Pending(kind, cycle, payload, waiters=[waiter] if waiter else [])))

    def fill(self, pending: Pending, payload: bytes | None) -> None:
        """A held strategies report's request, made on the loop (None: not to be sent)."""
        self._inbox.put(_Fill(pending, payload))

    def catch_up(self) -> None:
        """On the loop, before it reacts to anything from ClusterD and before it stops:
        every controller report the wire has taken, in callback order, to the listener."""
        while self._handed:
            self._listener.taken(self._handed.popleft())

    async def settle(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until no cycle-bound report is on the wire; False
        on timeout. The session awaits it before every Subscribe."""
        with self._lock:
            if not self._unsettled:
                return True
            self._settled.clear()  # set by the wire (posted) when the last such call ends
        try:
            await asyncio.wait_for(self._settled.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._outbox)

    def handed_all(self) -> bool:
        """Whether every report put so far has reached the loop's bookkeeping: the wire
        waits for its inbox, which is empty, and has nothing left to hand over (tests
        wait for it before they read the bookkeeping's metrics)."""
        return self._waiting and self._inbox.empty() and not self._handed

    async def drain(self, timeout: float) -> bool:
        """Wait until the outbox is empty (shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while (self._outbox or not self._inbox.empty()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # polled, bounded: a stop's last moment
        return not self._outbox

    def stop(self, timeout: float) -> None:
        """End the thread (any thread but this one): what is still queued is dropped
        (``shutdown``); closing the channel cancels a call in flight."""
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        self._closing = True
        if self._connectivity is None:
            try:
                self._channel.unsubscribe(self._on_state)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        self._channel.close()
        self._thread.join(timeout)
        self.pin.release()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ================================================================ the wire's thread
    def _look(self, try_to_connect: bool = False) -> None:
        """The channel's connectivity now, on this thread (``_on_state``)."""
        if self._connectivity is None:
            return  # gRPC's polling thread tells ``_on_state``
        try:
            state = self._connectivity(try_to_connect)
        except ValueError:  # closed: ``stop`` closes it once this thread has ended
            return
        self._on_state(state)

    def _on_state(self, state: grpc.ChannelConnectivity) -> None:
        """The connectivity seen by a look (or, without ``connectivity_check``, told on
        gRPC's connectivity thread); never raises. Leaving READY while nobody closed the
        channel is ClusterD closing the connection (a GOAWAY, e.g. ``too_many_pings``, or
        a lost connection): logged and counted, since gRPC itself only reconnects
        silently at the next call."""
        was_ready, self._ready = self._ready, state is grpc.ChannelConnectivity.READY
        if was_ready and not self._ready and not self._closing:
            try:
                connection_lost(self._metrics, "report", "it left READY")
            except Exception:  # noqa: BLE001 - a logging/metrics failure must not break gRPC's thread
                log.exception("reporting the report channel's lost connection failed")

    def _run(self) -> None:
        try:
            # Whether this thread may run realtime at all, known before the first report
            # (the ``report`` thread's gauge), then back to SCHED_BATCH to wait.
            self.realtime = realtime.promote(self._priority, realtime.REPORT)
            self._refused = not self.realtime
            self.batch_policy = realtime.batch_policy()
            self._look(try_to_connect=True)  # connected before the first report
            self._serve()
        except BaseException:  # noqa: BLE001 - the supervisor sees the thread end; this says why
            log.exception("the report wire failed")
        finally:
            self._shutdown()

    def _serve(self) -> None:
        while not self._stopping:
            head = self._sendable()
            if head is None:
                self._idle()
                wait = max(0.0, self._retry_at - time.monotonic()) if self._outbox and self._retry_at else None
                if self._connectivity is not None:
                    wait = CONNECTIVITY_LOOK if wait is None else min(wait, CONNECTIVITY_LOOK)
                if not self._take(block=True, timeout=wait):
                    self._look()
                continue
            self._take(block=False)  # what came meanwhile, before the head leaves (merging, order)
            head = self._sendable()
            if head is not None:
                self._send(head)

    def _take(self, block: bool, timeout: float | None = None) -> bool:
        """Everything in the inbox now (after waiting for one item when ``block``); False
        when there was nothing."""
        if not block and self._inbox.empty():
            return False  # the common case before a send: no exception raised and caught
        items: list[object] = []
        self._waiting = block
        try:
            items.append(self._inbox.get(block, timeout))
        except queue.Empty:
            return False
        finally:
            self._waiting = False
        while not self._inbox.empty():
            items.append(self._inbox.get_nowait())
        self._held_tells = []  # told once this take's reports are handed (``_tell``)
        taken: list[Taken] = []
        try:
            for item in items:
                if isinstance(item, tuple) and not isinstance(item, (_Submit, _Fill)):
                    taken.append(self._intake(item))
                elif item is _STOP:
                    self._stopping = True
                elif isinstance(item, _Submit):
                    self._queue(item.pending)
                elif isinstance(item, _Fill):
                    self._filled(item.pending, item.payload)
            self._drop_dead_cycles()
        finally:
            if taken:
                self._handed.append(taken)
            held, self._held_tells = self._held_tells, None
            for function, args in held:
                self._post(self._told, function, args)
        return True

    def _intake(self, item: tuple[Any, ...]) -> Taken:
        """One callback's arguments: bound, cleaned, encoded and queued (never raises)."""
        callback, args, at, waiter = item
        kind = KINDS.get(callback)
        cycles = self._cycles
        cycle = None
        try:
            if kind != "fault":
                cycle = self._answering_at(at)
            if kind is None:
                raise ValueError(f"unknown callback {callback!r}")
            raw = args[0] if kind in ("fault", "strategy") and args else (args[2] if len(args) > 2 else {})
            cleaned = codec.clean_faults(raw)
            held = None
            if kind == "fault":
                if cleaned.faults:
                    self._queue(Pending("fault", faults=dict(cleaned.faults), waiters=[waiter] if waiter else []))
                elif waiter is not None:
                    waiter.set_result(Code.OK)
            else:
                payload, hold = self._encode(kind, args, cleaned.faults, cycle, cycles)
                pending = Pending(kind, cycle, payload, held=hold, waiters=[waiter] if waiter else [])
                if hold:
                    held = pending
                    self._outbox.append(pending)  # in its place; the loop fills it
                elif cycles.alive(cycle):
                    self._queue(pending)
                else:
                    self._drop(pending, "no_live_cycle")
            return Taken(callback, args, at, waiter, cycle, cleaned.faults, cleaned.bad, cleaned.error, False, held)
        except (TypeError, ValueError, IndexError) as error:
            return Taken(callback, args, at, waiter, cycle, {}, 0, str(error)[:200], True, None)

    def _answering_at(self, at: float) -> str | None:
        """The cycle the controller answered when it made the callback stamped ``at``:
        the last one published before then. Not the one current now: ClusterD may have
        replaced the cycle since, and a stop-complete of the old one bound to the new one
        would sit in its one-slot buffer before the controller stopped for it. Older than
        every change kept (64): None, a cycle long gone."""
        with self._lock:
            for since, answering in reversed(self._answering_since):
                if since <= at:
                    return answering
        return None

    def _encode(self, kind: str, args: tuple[Any, ...], faults: dict[int, int], cycle: str | None,
                cycles: Cycles) -> tuple[bytes, bool]:
        if kind == "strategy":
            strategies = [str(s) for s in args[1]]
            if cycles.narrowed is not None and cycles.narrowed == cycle:
                return b"", True
            return codec.encode_recover_strategy_request(self.job_id, faults, strategies), False
        code, msg = status_code(args[0]), str(args[1])
        if kind == "stop_complete":
            return codec.encode_stop_complete_request(self.job_id, code, msg, faults), False
        strategy = str(args[3]) if len(args) > 3 else ""
        isolate = [str(rank) for rank in sorted(faults)] if code == 201 else []
        return codec.encode_recover_status_request(self.job_id, code, msg, strategy, isolate), False

    def _queue(self, pending: Pending) -> None:
        """Into the outbox: a fault report merges into a queued one not yet sending."""
        tail = self._outbox[-1] if self._outbox else None
        if pending.kind == "fault" and tail is not None and tail.kind == "fault" and not tail.sending:
            codec.merge_into(tail.faults, pending.faults)
            tail.waiters += pending.waiters
            self._metrics.reports_merged.inc()
            return
        if pending.kind != "fault" and not self._cycles.alive(pending.cycle):
            self._drop(pending, "no_live_cycle")
            return
        self._outbox.append(pending)
        self._enforce_limit()

    def _filled(self, pending: Pending, payload: bytes | None) -> None:
        if pending not in self._outbox:
            return
        if payload is None:
            self._outbox.remove(pending)
            pending.resolve(Code.ClientError)
            return
        pending.payload, pending.held = payload, False

    def _enforce_limit(self) -> None:
        while len(self._outbox) > self._limit:
            victim = next((p for p in self._outbox if p.kind != "fault" and not p.sending and not p.held), None)
            if victim is None:
                faults = [p for p in self._outbox if p.kind == "fault" and not p.sending]
                if len(faults) < 2:
                    return
                codec.merge_into(faults[1].faults, faults[0].faults)  # faults[0] is older: merged, never lost
                faults[1].waiters += faults[0].waiters
                self._outbox.remove(faults[0])
                continue
            self._outbox.remove(victim)
            self._drop(victim, "outbox_full")

    def _drop_dead_cycles(self) -> None:
        """Cycle-bound reports waiting for a cycle that is gone never reach the next."""
        cycles = self._cycles
        for pending in [p for p in self._outbox if p.kind != "fault" and not p.sending and not p.held
                        and not cycles.alive(p.cycle)]:
            self._outbox.remove(pending)
            self._drop(pending, "cycle_ended")

    def _sendable(self) -> Pending | None:
        if not self._outbox or self._stopping or time.monotonic() < self._retry_at:
            return None
        head = self._outbox[0]
        if head.held or (head.kind == "fault" and not (self._cycles.live or self._cycles.subscribed)):
            return None
        return head

    def _send(self, head: Pending) -> None:
        if head.kind == "fault":
            payload = codec.encode_process_fault_request(self.job_id, head.faults)
            head.sending = True
            code, failure = self._call(head.kind, payload)
            head.sending = False
            self._fault_outcome(head, code, failure)
            return
        with self._lock:  # with ``publish``: no report of a stream the loop saw end starts
            alive = self._cycles.alive(head.cycle)
            if alive:
                self._unsettled += 1
        if not alive:
            self._outbox.popleft()
            self._drop(head, "cycle_ended")
            return
        head.sending = True
        try:
            code, failure = self._call(head.kind, head.payload)
        finally:
            with self._lock:
                self._unsettled -= 1
                settled = self._unsettled == 0
            if settled:
                self._post(self._settled.set)
        self._cycle_outcome(head, code, failure)

    def _fault_outcome(self, head: Pending, code: int | None, failure: RpcFailure | None) -> None:
        if failure is not None:
            log.warning("fault report not delivered (%s), will retry: %s", failure.status, failure.detail)
            self._retry_at = time.monotonic() + self._backoff.next()
            return
        if code == Code.UnRegistry:  # ClusterD lost the job (restarted?): subscribe again, then resend
            self._tell(self._listener.resubscribe, "clusterd_lost_job")
            self._retry_at = time.monotonic() + self._backoff.next()
            return
        self._backoff.reset()
        self._retry_at = 0.0
        self._outbox.popleft()
        if code != Code.OK:
            log.error("ClusterD refused a fault report: %s", Code.describe(code))
            self._metrics.reports_dropped.labels("fault", drop_reason_for_code(code)).inc()
            head.resolve(code)  # type: ignore[arg-type]
            return
        self._metrics.reports_sent.labels("fault").inc()
        head.resolve(Code.OK)
        self._tell(self._listener.faults_delivered, dict(head.faults), time.monotonic())

    def _cycle_outcome(self, head: Pending, code: int | None, failure: RpcFailure | None) -> None:
        if failure is not None and failure.delivery is Delivery.NOT_DELIVERED:
            log.warning("%s report did not reach ClusterD (%s); retrying", head.kind, failure.status)
            head.sending = False
            self._retry_at = time.monotonic() + self._backoff.next()
            return
        self._retry_at = 0.0
        self._outbox.popleft()
        if failure is not None:  # deadline or broken connection mid-call: ClusterD may hold it
            self._drop(head, f"outcome_unknown_{failure.status.lower()}")
            if self._cycles.alive(head.cycle):
                self._tell(self._listener.outcome_unknown, head.kind)
            return
        self._backoff.reset()
        if code == Code.OK:
            self._metrics.reports_sent.labels(head.kind).inc()
            head.resolve(Code.OK)
            return
        head.resolve(code)  # type: ignore[arg-type]  # a waiting caller learns ClusterD's own answer
        self._drop(head, drop_reason_for_code(code))  # type: ignore[arg-type]
        if code == Code.UnRegistry:
            self._tell(self._listener.resubscribe, "clusterd_lost_job")

    def _call(self, kind: str, payload: bytes) -> tuple[int | None, RpcFailure | None]:
        """One Report* call on this thread: ClusterD's code, or how it failed."""
        method = METHODS[kind]
        name = method.rsplit("/", 1)[-1]
        callable_ = self._callables[method]
        self._look()  # connected as the call starts: a failure's fate depends on it
        if not self.after_send:
            self._written()
        was_ready, started = self._ready, time.monotonic()
        try:
            code = callable_(payload, timeout=self._rpc_timeout)
        except grpc.RpcError as error:
            status, delivery = classify_failure(error, was_ready)
            seconds = time.monotonic() - started
            self._metrics.rpc_seconds.labels(name).observe(seconds)
            self._metrics.rpcs.labels(name, status).inc()
            self._tell(self._listener.rpc, name, status, started, seconds)
            return None, RpcFailure(name, status, error.details() or "", delivery)
        except ValueError as error:  # the channel is closed (stopping): the call was never made
            self._metrics.rpcs.labels(name, "CLOSED").inc()
            return None, RpcFailure(name, "CLOSED", str(error), Delivery.NOT_DELIVERED)
        seconds = time.monotonic() - started
        self._metrics.rpc_seconds.labels(name).observe(seconds)
        self._metrics.rpcs.labels(name, code_label(code)).inc()
        self._tell(self._listener.rpc, name, code, started, seconds)
        return code, None

    def _make_callable(self, method: str) -> Any:
        """The channel's callable for ``method``, telling ``_written`` after each write
        (``lowlevel.after_send``)."""
        callable_ = self._channel.unary_unary(method, request_serializer=None, response_deserializer=_status_code)
        if not lowlevel.after_send(callable_, self._written):
            self.after_send = False
            log.warning("this grpcio has no channel object to wrap: the wire is promoted before each write")
        return callable_

    def _written(self) -> None:
        """The request is written (gRPC's call started): from now on SCHED_FIFO, so the
        answer wakes this thread at once, until it waits for callbacks again (``_idle``)."""
        if not (self._boosted or self._refused):
            self._boosted = realtime.promote(self._priority, realtime.REPORT)
            self._refused = not self._boosted

    def _idle(self) -> None:
        """Nothing to send: the loop learns of what was taken, and the thread goes back to
        SCHED_BATCH before it waits for the next callback, whose wake-up must never
        preempt the controller's thread. It follows the controller's thread to its CPU
        here, not as it takes a callback: moving migrates this thread, and the first
        fault report, measured on the real peers, waited 0.12-0.17 ms for it."""
        if self._handed:
            self._post(self.catch_up)
        if self._boosted:
            self._boosted = False
            realtime.batch_policy()
        self.pin.follow()

    def _drop(self, pending: Pending, reason: str) -> None:
        pending.resolve(DROP_CODES.get(reason, Code.ServerInnerError))
        self._metrics.reports_dropped.labels(pending.kind, reason).inc()
        self._tell(self._listener.dropped, pending.kind, pending.cycle, reason)
        log.warning("dropped %s report for cycle %s: %s", pending.kind, pending.cycle, reason)

    def _tell(self, function: Callable[..., Any], *args: Any) -> None:
        """A listener call about a report's fate (an RPC's answer, a drop, an unknown
        outcome, a resubscribe ClusterD asked for), made on the loop after it has taken
        the reports handed so far: the loop learns of a report before of what became of
        it (the flight recorder closes a cycle on the result report's RPC only once it has
        the result report itself). Inside a take, held until its reports are handed: a
        report dropped as it is taken is told after the report itself."""
        if self._held_tells is not None:
            self._held_tells.append((function, args))
            return
        self._post(self._told, function, args)

    def _told(self, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.catch_up()
        function(*args)

    def _post(self, function: Callable[..., Any], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass

    def _shutdown(self) -> None:
        for pending in list(self._outbox):
            if not pending.sending:
                self._drop(pending, "shutdown")
        self._outbox.clear()
        while not self._inbox.empty():  # callbacks after the stop: their waiters learn it
            item = self._inbox.get_nowait()
            if isinstance(item, tuple) and not isinstance(item, (_Submit, _Fill)) and item[3] is not None \
                    and not item[3].done():
                item[3].set_result(Code.ServerInnerError)
        self._post(self.catch_up)


def _status_code(raw: bytes) -> int:
    """A Status message's ``code`` (field 1, varint), without building the message."""
    from bridge._proto import recover_pb2 as pb

    return int(pb.Status.FromString(raw).code)
