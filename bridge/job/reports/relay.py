"""The report path's one owner: the controller's reports -> ClusterD's Report* RPCs.

One thread, ``tft-wire``, owns the outbox, the report channel (a synchronous gRPC
channel) and every rule of delivery. Reports enter through the ``ReportInbox`` (the
controller's callbacks put their name, arguments and time there, named by the wire as it
takes them: one thread crossing before the wire; the event loop and the seed API put
whole reports, ``ControllerReport``); what the wire needs of the loop's state it reads
from ``CycleState``'s snapshot. Each controller report goes back to
the loop's bookkeeping (the ``WireListener``) once the wire has nothing left to send, or
earlier when the loop asks (``catch_up``, before it reacts to anything from ClusterD), so
the loop never learns of ClusterD's answer to a report before the report.

Delivery rules (the peer facts behind each: docs/architecture.md, "the report path"):

* **In callback order, one call at a time**; the next leaves the moment the one before
  was answered 0, from this thread.
* **A report answers one cycle**: a stop-complete, strategy or result report is bound to
  the cycle the controller answered when it made the callback (``CycleState.answering_at``)
  and is dropped and counted, never sent into the next, once that cycle is gone.
* **A rebound cycle's strategies are narrowed here**: a strategies report bound to the
  cycle the resume rebound at GLOBAL_SENT, whose globalFault named ranks beyond the
  report's, is encoded with only the strategies that repair no rank
  (``resume.without_repair``); the loop counts and logs what was sent (``Taken``).
* **Fault reports wait for a subscription** (``Cycles.subscribed``), survive reconnects
  and merge with ClusterD's rule while queued; the loop hears of each answered 0.
* **Code 0 is never resent; an unknown outcome is final**: a cycle-bound report is
  retried only when it provably did not reach ClusterD.
* **Bounded**: past ``limit`` the oldest cycle-bound report waiting is dropped; fault
  reports merge, so no fault rank is ever dropped.
* **Settled before a Subscribe**: no cycle-bound report of a stream the loop saw end
  starts (``CycleState.begin_send``), and the session waits for those already out.

Connectivity is read on this thread at each call's start and every ``CONNECTIVITY_LOOK``
seconds while it waits; ClusterD closing the connection is logged and counted.
Scheduling (``realtime.py``, ``affinity.py``): ``SCHED_BATCH`` on the controller's CPU
while it waits for reports, ``SCHED_FIFO`` from a request's write until it waits again.
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
from bridge.core.backoff import Backoff
from bridge.job.cycle_state import NOT_ANSWERED, CycleState
from bridge.job.metrics import BridgeMetrics, code_label, drop_reason_for_code
from bridge.job.reports.kinds import KINDS, METHODS, ControllerReport, ReportSink, report_of, status_code
from bridge.job.sched import grpc_internals, realtime
from bridge.job.sched.affinity import ControllerPin
from bridge.job.session.clusterd import Delivery, RpcFailure, classify_failure, connection_lost
from bridge.job.session.codes import Code
from bridge.job.session.resume import without_repair

log = logging.getLogger(__name__)

#: The code a caller waiting for a dropped report receives (bridge.recover_manager).
DROP_CODES = {
    "no_live_cycle": Code.OrderMix,  # the cycle it answers is over: out of state-machine order
    "cycle_ended": Code.OrderMix,
    "outbox_full": Code.EventQueueBusy,
    "shutdown": Code.ServerInnerError,  # never sent
}


class Taken(NamedTuple):
    """A controller report as the wire took it, for the loop's bookkeeping."""

    report: ControllerReport
    cycle: str | None  # the cycle it was bound to (cycle-bound kinds)
    cleaned: codec.CleanFaults  # its fault map without the bad entries, and what was left out
    strategies: list[str]  # a strategies report's strategies as strings ([] otherwise)
    problem: str  # why it is malformed: not sent, answered 499 by the loop ("": well-formed)
    offered: list[str]  # the strategies encoded for ClusterD: ``strategies`` unless narrowed
    beyond: frozenset[int]  # the rebound cycle's named ranks beyond the report's: narrowed when any


NO_FAULTS = codec.CleanFaults({}, 0, "")
NONE_BEYOND: frozenset[int] = frozenset()


class WireListener(Protocol):
    """What the wire tells the event loop's bookkeeping (``ledger.ReportPath``); every
    call is made on the loop, after the reports taken before it were handed over."""

    def taken(self, reports: list[Taken]) -> None: ...

    def dropped(self, kind: str, cycle: str | None, reason: str) -> None: ...

    def outcome_unknown(self, kind: str) -> None: ...

    def faults_delivered(self, faults: dict[int, int], at: float) -> None: ...


class RpcObserver(Protocol):
    """Told of every Report* call's outcome, on the loop (``ClusterDClient.observe_rpc``)."""

    def observe_rpc(self, method: str, code: int | str, started: float, seconds: float) -> None: ...


@dataclass
class Pending:
    kind: str  # a key of METHODS
    cycle: str | None = None  # the uuid a cycle-bound report answers
    payload: bytes = b""  # encoded request (cycle-bound reports)
    faults: dict[int, int] = field(default_factory=dict)  # fault reports, merged until sent
    sending: bool = False  # on the wire now: nothing may merge into it any more
    waiters: list[Future[int]] = field(default_factory=list)

    def resolve(self, code: int) -> None:
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(code)


class _Submit(NamedTuple):  # from the loop
    pending: Pending


_STOP = object()
_WAKE = object()

#: Seconds between looks at the report channel's connectivity while the wire waits: how
#: late a connection ClusterD closed under an idle bridge is logged and counted. It stays
#: not READY until the next call reconnects (gRPC reconnects an idle channel only then),
#: so no loss is missed between looks.
CONNECTIVITY_LOOK = 1.0


class ReportInbox:
    """The wire's inbox: every report and instruction for the wire goes through it.
    ``put`` is the controller callbacks' sink (any thread, one C call, never blocks); the
    rest are the event loop's (``stop``: whoever stops the wire). Only the wire's thread
    takes from it (``Wire``). It holds the queue and a count of its wake-ups, nothing else."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()  # any thread -> the wire
        self.put: ReportSink = self._queue.put  # the callbacks' sink
        self.wakes = 0  # wake-ups put (``wake``, on the loop only): one per change of the stream

    def submit_faults(self, faults: dict[int, int], waiter: Future[int] | None = None) -> None:
        """A fault report of the loop's own (a re-report, the resume's)."""
        self._queue.put(_Submit(Pending("fault", faults=dict(faults), waiters=[waiter] if waiter else [])))

    def submit_cycle_report(self, kind: str, cycle: str | None, payload: bytes,
                            waiter: Future[int] | None = None) -> None:
        """A cycle-bound report of the loop's own, already encoded."""
        self._queue.put(_Submit(Pending(kind, cycle, payload, waiters=[waiter] if waiter else [])))

    def wake(self) -> None:
        """Have the wire look at the cycle state again (``CycleState``)."""
        self.wakes += 1
        self._queue.put(_WAKE)

    def stop(self) -> None:
        self._queue.put(_STOP)

    def empty(self) -> bool:
        return self._queue.empty()

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        return self._queue.get(block, timeout)

    def get_nowait(self) -> object:
        return self._queue.get_nowait()


class Wire:
    """The outbox and the report channel, on the thread ``tft-wire``, from ``start()`` to
    ``stop()``. Takes from ``inbox``, reads ``cycles``, tells ``listener`` (on ``loop``)
    what became of each controller report, ``rpcs`` of each call and ``on_ended`` that
    the thread ended. ``catch_up``, ``drain``, ``handed_all`` and ``start`` are the event
    loop's; ``stop`` any thread's but the wire's."""

    def __init__(self, job_id: str, channel: grpc.Channel, loop: asyncio.AbstractEventLoop, inbox: ReportInbox,
                 cycles: CycleState, listener: WireListener, rpcs: RpcObserver, metrics: BridgeMetrics, *,
                 rpc_timeout: float, backoff: Backoff, limit: int = 10_000, realtime_priority: int = 0,
                 pin: ControllerPin | None = None, on_ended: Callable[[], None] = lambda: None) -> None:
        self.job_id = job_id
        self._channel = channel
        self._loop = loop
        self._inbox = inbox
        self._cycles = cycles
        self._listener = listener
        self._rpcs = rpcs
        self._on_ended = on_ended  # told on the loop when the thread has ended, for whatever reason
        self._metrics = metrics
        self._rpc_timeout = rpc_timeout
        self._backoff = backoff  # reset on every answer
        self._limit = limit
        self._priority = realtime_priority
        self.pin = pin if pin is not None else ControllerPin(False)
        self._handed: deque[list[Taken]] = deque()  # wire -> loop (append / popleft: atomic)
        # -- the wire's own
        self._outbox: deque[Pending] = deque()
        self.after_send = True  # promoted after each write (False: gRPC has no channel object to wrap)
        self._callables: dict[str, Any] = {}  # made by ``start``, read by the wire's thread only
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
        self._connectivity: Callable[[bool], grpc.ChannelConnectivity] | None = None
        self._thread = threading.Thread(target=self._run, name="tft-wire", daemon=True)
        metrics.outbox_depth.set_function(lambda: len(self._outbox))

    def start(self) -> None:
        """Make the channel's callables (before a job's first report: made inside it,
        they held that report back on the real peers) and start the thread."""
        self._callables = {method: self._make_callable(method) for method in METHODS.values()}
        self._connectivity = grpc_internals.connectivity_check(self._channel)
        if self._connectivity is None:
            log.warning("this grpcio's channel cannot be asked its connectivity: gRPC's polling thread watches it")
            self._channel.subscribe(self._on_state, try_to_connect=True)  # connected before the first report
        self._thread.start()

    # ================================================================ the loop's side
    def catch_up(self) -> None:
        """On the loop, before it reacts to anything from ClusterD and before it stops:
        every controller report the wire has taken, in callback order, to the listener."""
        while self._handed:
            self._listener.taken(self._handed.popleft())

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
        """End the thread (any thread but this one), at most ``timeout`` per join: what is
        still queued is dropped (``shutdown``); closing the channel cancels a call in
        flight. Before ``start``: only the channel is closed."""
        started = self._thread.ident is not None
        if started:
            self._inbox.stop()
            self._thread.join(timeout)
        self._closing = True
        if started and self._connectivity is None:
            try:
                self._channel.unsubscribe(self._on_state)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        self._channel.close()
        if started:
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
        except BaseException:  # noqa: BLE001 - the owner is told of the end; this says why
            log.exception("the report wire failed")
        finally:
            self._shutdown()
            self._post(self._on_ended)

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
                if type(item) is tuple:  # a controller callback's (kinds.Callback)
                    taken.append(self._intake(report_of(*item)))
                elif type(item) is ControllerReport:
                    taken.append(self._intake(item))
                elif item is _WAKE:
                    pass  # the cycle state changed: looked at below
                elif item is _STOP:
                    self._stopping = True
                elif isinstance(item, _Submit):
                    self._queue(item.pending)
                else:
                    log.error("the report wire's inbox got a %s, not a report: left out", type(item).__name__)
            self._drop_dead_cycles()
        finally:
            if taken:
                self._handed.append(taken)
            held, self._held_tells = self._held_tells, None
            for function, args in held:
                self._post(self._told, function, args)
        return True

    def _intake(self, report: ControllerReport) -> Taken:
        """One controller report: bound, cleaned, encoded and queued (never raises).

        A strategies report is narrowed from the publication its cycle is bound with
        (``CycleState.answering_at``), never from the loop's state: the resume publishes
        the rebound cycle with the answering one, in one publication, so a report made
        after the rebind is bound to the rebound cycle and narrowed when its globalFault
        named ranks beyond the report's, and one made before is bound to the earlier
        cycle and never narrowed (its own cycle is compared with the rebound one). What
        the loop does with the rebound cycle before it catches up (a new stream clears
        it, and ends that cycle) cannot split binding and narrowing, and the loop counts
        and logs what ``Taken`` says was sent, so the two always agree."""
        kind = KINDS.get(report.callback)
        cycles = self._cycles.snapshot
        cycle = None
        waiters = [report.waiter] if report.waiter is not None else []
        try:
            answered = self._cycles.answering_at(report.at) if kind != "fault" else NOT_ANSWERED
            cycle = answered.cycle
            if kind is None:
                raise ValueError(f"unknown callback {report.callback!r}")
            if report.problem:
                raise ValueError(report.problem)
            cleaned = codec.clean_faults(report.faults)
            strategies: list[str] = []
            if kind == "fault":
                if cleaned.faults:
                    self._queue(Pending("fault", faults=dict(cleaned.faults), waiters=waiters))
                elif report.waiter is not None:
                    report.waiter.set_result(Code.OK)
                return Taken(report, cycle, cleaned, strategies, "", strategies, NONE_BEYOND)
            offered, beyond = strategies, NONE_BEYOND
            if kind == "strategy":
                strategies = offered = [str(s) for s in report.strategies]
                rebound = answered.rebound
                if rebound is not None and rebound.cycle == cycle:
                    offered, beyond = without_repair(rebound.named, cleaned.faults, strategies)
                payload = codec.encode_recover_strategy_request(self.job_id, cleaned.faults, offered)
            else:
                payload = self._encode(kind, report, cleaned.faults)
            pending = Pending(kind, cycle, payload, waiters=waiters)
            if cycles.alive(cycle):
                self._queue(pending)
            else:
                self._drop(pending, "no_live_cycle")
            return Taken(report, cycle, cleaned, strategies, "", offered, beyond)
        except (TypeError, ValueError, IndexError) as error:
            return Taken(report, cycle, NO_FAULTS, [], str(error)[:200] or type(error).__name__, [], NONE_BEYOND)

    def _encode(self, kind: str, report: ControllerReport, faults: dict[int, int]) -> bytes:
        """A stop-complete or result report's request (TypeError for a code that is not an int)."""
        code, message = status_code(report.code), str(report.message)
        if kind == "stop_complete":
            return codec.encode_stop_complete_request(self.job_id, code, message, faults)
        isolate = [str(rank) for rank in sorted(faults)] if code == 201 else []
        return codec.encode_recover_status_request(self.job_id, code, message, str(report.strategy), isolate)

    def _queue(self, pending: Pending) -> None:
        """Into the outbox: a fault report merges into a queued one not yet sending."""
        tail = self._outbox[-1] if self._outbox else None
        if pending.kind == "fault" and tail is not None and tail.kind == "fault" and not tail.sending:
            codec.merge_into(tail.faults, pending.faults)
            tail.waiters += pending.waiters
            self._metrics.reports_merged.inc()
            return
        if pending.kind != "fault" and not self._cycles.snapshot.alive(pending.cycle):
            self._drop(pending, "no_live_cycle")
            return
        self._outbox.append(pending)
        self._enforce_limit()

    def _enforce_limit(self) -> None:
        while len(self._outbox) > self._limit:
            victim = next((p for p in self._outbox if p.kind != "fault" and not p.sending), None)
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
        cycles = self._cycles.snapshot
        for pending in [p for p in self._outbox if p.kind != "fault" and not p.sending
                        and not cycles.alive(p.cycle)]:
            self._outbox.remove(pending)
            self._drop(pending, "cycle_ended")

    def _sendable(self) -> Pending | None:
        if not self._outbox or self._stopping or time.monotonic() < self._retry_at:
            return None
        head = self._outbox[0]
        cycles = self._cycles.snapshot
        if head.kind == "fault" and not (cycles.live or cycles.subscribed):
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
        if not self._cycles.begin_send(head.cycle):  # no report of a stream the loop saw end starts
            self._outbox.popleft()
            self._drop(head, "cycle_ended")
            return
        head.sending = True
        try:
            code, failure = self._call(head.kind, head.payload)
        finally:
            if self._cycles.end_send():
                self._post(self._cycles.mark_settled)
        self._cycle_outcome(head, code, failure)

    def _fault_outcome(self, head: Pending, code: int | None, failure: RpcFailure | None) -> None:
        if failure is not None:
            log.warning("fault report not delivered (%s), will retry: %s", failure.status, failure.detail)
            self._retry_at = time.monotonic() + self._backoff.next()
            return
        if code == Code.UnRegistry:  # ClusterD lost the job (restarted?): subscribe again, then resend
            self._tell(self._cycles.request_resubscribe, "clusterd_lost_job")
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
            if self._cycles.snapshot.alive(head.cycle):
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
            self._tell(self._cycles.request_resubscribe, "clusterd_lost_job")

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
            self._tell(self._rpcs.observe_rpc, name, status, started, seconds)
            return None, RpcFailure(name, status, error.details() or "", delivery)
        except ValueError as error:  # the channel is closed (stopping): the call was never made
            self._metrics.rpcs.labels(name, "CLOSED").inc()
            return None, RpcFailure(name, "CLOSED", str(error), Delivery.NOT_DELIVERED)
        seconds = time.monotonic() - started
        self._metrics.rpc_seconds.labels(name).observe(seconds)
        self._metrics.rpcs.labels(name, code_label(code)).inc()
        self._tell(self._rpcs.observe_rpc, name, code, started, seconds)
        return code, None

    def _make_callable(self, method: str) -> Any:
        """The channel's callable for ``method``, telling ``_written`` after each write
        (``grpc_internals.after_send``)."""
        callable_ = self._channel.unary_unary(method, request_serializer=None, response_deserializer=_status_code)
        if not grpc_internals.after_send(callable_, self._written):
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
        SCHED_BATCH before it waits for the next report, whose wake-up must never
        preempt the controller's thread. It follows the controller's thread to its CPU
        here, not as it takes a report: moving migrates this thread, which the first
        report would wait for (docs/performance.md)."""
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
            if type(item) is ControllerReport and item.waiter is not None and not item.waiter.done():
                item.waiter.set_result(Code.ServerInnerError)
        self._post(self.catch_up)


def _status_code(raw: bytes) -> int:
    """A Status message's ``code`` (field 1, varint), without building the message."""
    from bridge._proto import recover_pb2 as pb

    return int(pb.Status.FromString(raw).code)
