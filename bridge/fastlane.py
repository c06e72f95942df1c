"""A report from the hand-off thread to the report thread, ahead of the event loop.

Every report crossed controller thread -> hand-off thread -> event loop -> report
thread, and the loop did all of its bookkeeping (validate, flow, metrics, recorder,
outbox) before the report thread could put it on the wire. Measured against a server
that answers like the real ClusterD (``bench/bench_loaded.py``), the loop's share was
~0.15 ms of a report's hop at the median, about as much as the whole hop took the
synchronous client whose callback makes the call itself.

A report's request needs nothing of the loop's state but, for a stop-complete, strategy
or result report, the cycle it answers. That is ``ControllerFlow.answering``, which the
loop sets *before* it makes the notify the controller answers (``flow.notified``), so it
is already the right one when the controller's callback runs. So when the outbox is
idle, the hand-off thread binds the report (under the outbox's lock) and gives it to
the report thread with the batch it came in: the report thread encodes it, makes the
call and only *after the call* posts the batch to the loop, ahead of the call's
outcome. The loop then does its bookkeeping and adopts the call as the outbox's head
(``Relay.submit_faults`` / ``submit_cycle_report`` with ``presend``), learning its
outcome as for a chained call: a failure is retried (a fault report) or, when it
provably never left, sent the ordinary way; code 0 is never resent; a cycle-bound one
counts as on the wire for ``Relay.settle``, and is withdrawn if its cycle ended before
the report thread took it.

**Why after the call.** Posted before it, the batch woke the loop while the request was
on its way, and on a node's few cores the loop's bookkeeping then ran exactly when the
server (ClusterD on loopback, or the kernel's network work) needed a core: measured,
callback -> server received took ~0.1-0.3 ms longer than the wire stamp alone explains.
Posted after it, nothing of the bridge runs while the request travels, as for the
synchronous client. The price is that the loop learns of the report late, and it must
never react to ClusterD's answer to a report it does not know yet (the globalFault that
follows a stop-complete, say). So the loop *catches up* before it reacts to anything
from ClusterD: before it handles a message of the stream, when a stream ends and
before a Subscribe (``Session.catch_up``), and before it stops; ``flush`` hands it the
held batches there and then, in order, and the report thread's post then finds nothing
left to post.

**Chained on the lane.** A report that comes while the lane's call is out (the
strategy report right behind the cycle's second fault report, the recovery's critical
path) is held behind it; the loop, not knowing either yet, could not chain it as the
outbox chains one (relay.py). So the lane does: a cycle-bound report of the live
cycle, every held report before it the lane's own and nothing queued by the loop, is
queued on the report thread *chained* to the lane's latest call (``rpcthread.py``,
"Chained calls": sent only right after that call answered code 0). The last of the
chain posts the held batches; the outbox adopts the chain in order (``Relay._adopt``).
A fault report is never chained (the outbox merges those instead).

Where the work runs is measured, not chosen for symmetry: done on the hand-off thread,
it made the controller wait (that thread runs under ``SCHED_BATCH``; busy processes
preempt it while it holds the GIL, and a callback then waits for the GIL: block p99
0.05-1.8 ms at two busy processes against 0.03-0.05 ms). The report thread runs
realtime (``realtime.py``).

The outbox's rules hold because the lane opens only when taking it cannot reorder
anything (decided under ``lock``, which the outbox also holds when it queues a report):
the outbox is empty, no pre-sent report waits for adoption, it is not stopping, no
earlier batch is still on its way to the loop (callback order), the subscription is
live (ClusterD loses a fault reported while no stream is open), a cycle-bound report's
cycle is the live one, and the report thread exists. While the lane's batch has not
reached the loop, every later batch waits behind it and is posted after it
(``_release``) or handed over with it (``flush``): the loop sees the callbacks in their
order. A report with a bad fault entry or a malformed argument is not sent this way
(``prepare`` returns None): the loop logs and counts it, answers a malformed one 499
and sends what it would have sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import faults as codec
from .relay import METHODS
from .reports import status_code

if TYPE_CHECKING:
    from .clusterd import ClusterDClient, Session
    from .rpcthread import Call
    from .flow import ControllerFlow
    from .relay import Relay
    from .reports import ControllerReport

log = logging.getLogger(__name__)

#: callback -> the outbox's kind of report (relay.METHODS)
KINDS = {"report_fault_ranks": "fault", "report_stop_complete": "stop_complete",
         "report_strategies": "strategy", "report_result": "result"}


def request(job_id: str, callback: str, args: tuple[Any, ...]) -> bytes | None:
    """The request a callback makes, encoded as ``ReportPath`` encodes it (reports.py),
    or None when any fault entry is bad; raises on a malformed argument, as the loop's
    handler does. Tests hold the two to the same bytes (tests/test_report_lane.py)."""
    if callback == "report_fault_ranks":
        cleaned = codec.clean_faults(args[0] if args else {})
        if cleaned.bad or not cleaned.faults:
            return None
        return codec.encode_process_fault_request(job_id, cleaned.faults)
    if callback == "report_strategies":
        cleaned = codec.clean_faults(args[0])
        strategies = [str(s) for s in args[1]]
        return None if cleaned.bad else codec.encode_recover_strategy_request(job_id, cleaned.faults, strategies)
    code, msg = status_code(args[0]), str(args[1])
    cleaned = codec.clean_faults(args[2] if len(args) > 2 else {})
    if cleaned.bad:
        return None
    if callback == "report_stop_complete":
        return codec.encode_stop_complete_request(job_id, code, msg, cleaned.faults)
    if callback == "report_result":
        strategy = str(args[3]) if len(args) > 3 else ""
        isolate = [str(rank) for rank in sorted(cleaned.faults)] if code == 201 else []
        return codec.encode_recover_status_request(job_id, code, msg, strategy, isolate)
    return None


#: Posts one batch of reports to the event loop (``Handoff``); may raise RuntimeError
#: when the loop is closed.
Post = Callable[["list[ControllerReport]"], None]


class ReportLane:
    """On the hand-off thread: route each batch, straight to the loop or, led by a
    report the lane may take, through the report thread first. On the loop: hand over
    what is held before reacting to ClusterD, and count handled batches."""

    def __init__(self, job_id: str, relay: Relay, session: Session, client: ClusterDClient,
                 loop: asyncio.AbstractEventLoop, flow: ControllerFlow) -> None:
        self.job_id = job_id
        self.flow = flow
        self.relay = relay
        self.session = session
        self.client = client
        self.loop = loop
        self.lock = relay.lane_lock
        self.unhandled = 0  # batches posted (or held) and not handled by the loop yet (under ``lock``)
        self.held: list[list[ControllerReport]] | None = None  # the lane's batch and those behind it
        self.last: Call | None = None  # the lane's latest call while ``held`` (under ``lock``)
        self.taken = 0  # reports sent this way (tests and benchmarks read it)
        self.chained = 0  # ... of which chained to the lane's call before them
        self._post: Post | None = None
        # On the loop: handles one held batch as a posted one is handled (``Handoff``).
        self.deliver: Post = lambda reports: None

    def dispatch(self, reports: list[ControllerReport], post: Post) -> None:
        """Route one batch (hand-off thread). Never raises but ``post``'s RuntimeError."""
        with self.lock:
            self._post = post
            self.unhandled += 1
            if self.held is not None:  # the lane's batch has not reached the loop: keep the order
                covered = all(report.presend is not None for batch in self.held for report in batch)
                self.held.append(reports)
                if covered:
                    self._chain(reports, 0)
                return
            first = reports[0]
            kind = KINDS.get(first.callback)
            if kind is not None and self._open():
                cycle = None if kind == "fault" else self.flow.answering
                if (kind == "fault" or self.session.cycle_alive(cycle)) and self._take(reports, 0, kind, cycle):
                    self.held = [reports]  # before the lock is free: ``_release`` needs it
                    self._chain(reports, 1)
                    return
        # Nothing is held, so every batch ``_release`` posts is already posted: this one
        # comes after them. Outside the lock: the loop takes it too, and must never wait
        # for this thread (SCHED_BATCH) to be scheduled again.
        post(reports)

    def _open(self) -> bool:
        return (self.unhandled == 1 and self.client.report_thread and self.client.rpc_thread is not None
                and self.relay.idle() and self.session.live.is_set())

    def _take(self, reports: list[ControllerReport], index: int, kind: str, cycle: str | None) -> bool:
        """Queue ``reports[index]`` on the report thread (under ``lock``), chained to the
        lane's latest call if there is one; False when that failed (the ordinary way is
        always open)."""
        report = reports[index]
        try:
            callback, args = report.callback, report.args
            call = self.client.rpc_thread.submit_from(  # type: ignore[union-attr]
                self.loop, METHODS[kind], b"", self.client.config.rpc_timeout, after=self.last,
                prepare=lambda: self._prepare(callback, args), after_call=self._release)
        except Exception:  # noqa: BLE001 - the ordinary way is always open
            log.exception("the report lane failed; the report goes through the event loop")
            return False
        call.cycle = cycle
        self.relay.presend_pending += 1
        self.taken += 1
        self.chained += self.last is not None
        self.last = call
        reports[index] = report._replace(presend=call)
        return True

    def _chain(self, reports: list[ControllerReport], start: int) -> None:
        """Chain the batch's reports from ``start`` on to the lane's latest call, every
        held report before ``start`` being the lane's, until one cannot be: a cycle-bound
        report of the live cycle, sent on the report thread the moment the call before it
        answers code 0, as the outbox chains one (relay.py). Never a fault report (the
        outbox merges those instead), and nothing once the loop queued a report of its
        own (under ``lock``)."""
        for index in range(start, len(reports)):
            kind = KINDS.get(reports[index].callback)
            cycle = self.flow.answering
            if not (kind is not None and kind != "fault" and self.relay.idle(lane=True)
                    and self.session.live.is_set() and self.session.cycle_alive(cycle)
                    and self._take(reports, index, kind, cycle)):
                return

    def _prepare(self, callback: str, args: tuple[Any, ...]) -> bytes | None:
        """On the report thread: the request, or None when an argument is bad (the loop
        answers a malformed report 499 and logs and counts bad fault entries; the outbox
        then sends what it would have sent the ordinary way)."""
        try:
            return request(self.job_id, callback, args)
        except Exception:  # noqa: BLE001 - never kill the report thread
            return None

    def _release(self, call: Call) -> None:
        """On the report thread, once a lane's call is over: the held batches to the
        loop, in order, unless a call chained to this one will do it (or the loop took
        them already, ``flush``); from now on batches go straight there again."""
        with self.lock:
            if self.held is None or call is not self.last:
                return
            held = self._unhold()
            post = self._post
            for reports in held:
                try:
                    if post is not None:
                        post(reports)
                except RuntimeError:  # the loop is closed: the bridge is gone
                    log.error("dropped %d controller report(s): the event loop is closed", len(reports))

    def flush(self) -> None:
        """On the loop, before it reacts to ClusterD (a signal, a stream's start or end,
        a Subscribe) or stops: handle the held batches now, so the loop never learns of
        ClusterD's answer to a report before it knows the report (see the module
        docstring)."""
        with self.lock:
            held = self._unhold()
        for reports in held:
            self.deliver(reports)

    def _unhold(self) -> list[list[ControllerReport]]:
        """The held batches, taken: from now on batches go straight to the loop (under
        ``lock``)."""
        held, self.held, self.last = self.held or [], None, None
        return held

    def handled(self) -> None:
        """The loop handled a batch: its reports are in the outbox (loop)."""
        with self.lock:
            self.unhandled -= 1
