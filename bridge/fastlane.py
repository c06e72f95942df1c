"""A report from the hand-off thread straight to ClusterD, ahead of the event loop.

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
idle, the hand-off thread binds the report (under the outbox's lock), encodes it and
makes the call itself, on the report thread's channel (``RpcThread.make``), and only
*once it has nothing left to dispatch* posts the batch to the loop, ahead of the call's
outcome. The loop then does its bookkeeping and adopts the call as the outbox's head
(``Relay.submit_faults`` / ``submit_cycle_report`` with ``presend``), learning its
outcome as for a chained call: a failure is retried (a fault report) or, when it
provably never left, sent the ordinary way; code 0 is never resent; a cycle-bound one
counts as on the wire for ``Relay.settle``, and is withdrawn if its cycle ended before
the call was made.

**Why the hand-off thread makes the call.** Handed to the report thread, a report
waited for that thread's wake-up on another CPU: measured in the cycles phase, the
callback -> wire time fell from 0.22 to 0.15 ms for a first fault report and from 0.14
to 0.09 ms for a stop-complete when the thread that already has the report sends it.
Waking the report thread from the callback instead (no hand-off thread) saved nothing:
that wake-up crosses CPUs too, and the callback's own thread still holds the GIL. While
it waits for ClusterD's answer the hand-off thread runs ``SCHED_FIFO``, as the report
thread does, so the answer wakes it at once on busy cores; it is promoted the moment
gRPC has written the request, not before, so that ClusterD's receiving thread may take
this CPU at once (rpcthread.py, "Once the request is written"); before it waits for the
next callback it goes back to ``SCHED_BATCH``, so that a callback's wake-up never
preempts the controller's thread (``realtime.py``). A callback that comes during the call waits
in the hand-off's queue, which the controller's put never blocks on; the stop bounds
the hand-off's end by the call's deadline (``Link.stop``).

**Why the loop learns of it after the call.** Posted before it, the batch woke the loop
while the request was on its way, and on a node's few cores the loop's bookkeeping then
ran exactly when the server (ClusterD on loopback, or the kernel's network work)
needed a core: measured, callback -> server received took ~0.1-0.3 ms longer than the
wire stamp alone explains. Posted after it, nothing of the bridge runs while the
request travels, as for the synchronous client. The price is that the loop learns of
the report late, and it must never react to ClusterD's answer to a report it does not
know yet (the globalFault that follows a stop-complete, say). So the loop *catches up*
before it reacts to anything from ClusterD: before it handles a message of the stream,
when a stream ends and before a Subscribe (``Session.catch_up``), and before it stops;
``flush`` hands it the held batches there and then, in order, and ``release`` then
finds nothing left to post.

**Chained on the lane.** A report that comes while the lane's call is out (the
strategy report right behind the cycle's second fault report, the recovery's critical
path) is held behind it; the loop, not knowing either yet, could not chain it as the
outbox chains one (relay.py). So the lane does: a cycle-bound report of the live
cycle, every held report before it the lane's own and nothing queued by the loop, is
made *chained* to the lane's latest call (``rpcthread.py``, "Chained calls": sent only
right after that call answered code 0), by the hand-off thread the moment it has
dispatched it, which is right after the answer when it came during the call. The
outbox adopts the chain in order (``Relay._adopt``). A fault report is never chained
(the outbox merges those instead).

Where the work runs is measured, not chosen for symmetry. The hand-off thread runs
only once the controller's callback has returned (``SCHED_BATCH``, on the controller's
CPU: ``affinity.py``); the callback itself still only queues. But a callback that
comes while this thread holds the GIL waits for it, and under ``SCHED_BATCH`` busy
processes may preempt it mid-work: block p99 0.05-1.8 ms at two busy processes when
the encoding was done there under that policy with the Python encoders of the request's
head fields. Those are compiled now, and the routing, the encoding and the write all
run under ``SCHED_BATCH``: block p99 10-14 us at two busy processes in
``bench_loaded``'s hops phase, with the write no longer keeping ClusterD's receiving
thread off this CPU (``_send``).

The outbox's rules hold because the lane opens only when taking it cannot reorder
anything (decided under ``lock``, which the outbox also holds when it queues a report):
the outbox is empty, no pre-sent report waits for adoption, it is not stopping, no
earlier batch is still on its way to the loop (callback order), the subscription is
live (ClusterD loses a fault reported while no stream is open), a cycle-bound report's
cycle is the live one, and the report thread's channel exists. While the lane's batch
has not reached the loop, every later batch waits behind it and is posted after it
(``release``) or handed over with it (``flush``): the loop sees the callbacks in their
order. A report with a bad fault entry or a malformed argument is not sent this way
(``_request_or_none`` gives None): the loop logs and counts it, answers a malformed one
499 and sends what it would have sent. Nor is one whose fault map holds more than
``LANE_MAX_RANKS`` ranks: its encoding, not the hand-over, is then the hop's cost, and
it must not hold the controller's CPU.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from . import faults as codec
from . import realtime
from .relay import METHODS
from .reports import ControllerReport, report_of, status_code
from .rpcthread import Call

if TYPE_CHECKING:
    from .clusterd import ClusterDClient, Session
    from .rpcthread import RpcThread
    from .flow import ControllerFlow
    from .relay import Relay

log = logging.getLogger(__name__)

#: callback -> the outbox's kind of report (relay.METHODS)
KINDS = {"report_fault_ranks": "fault", "report_stop_complete": "stop_complete",
         "report_strategies": "strategy", "report_result": "result"}


def request(job_id: str, callback: str, args: tuple[Any, ...]) -> bytes | None:
    """The request a callback makes, encoded as ``ReportPath`` encodes it (reports.py),
    or None when any fault entry is bad; raises on a malformed argument, as the loop's
    handler does. Tests hold the two to the same bytes (tests/test_report_lane.py).

    It runs between the callback and the wire, so it takes the shortest way there: the
    codec's strict merge for the fault map (one bad entry: None, and the loop, which
    logs and counts it, sends the rest) and its compiled encoders."""
    # One merge (ClusterD's rule: ``faults.clean_faults`` without the bad entries' accounting,
    # which is the loop's) and one try for every callback, not a helper each: this runs cold.
    if callback == "report_fault_ranks":
        raw = args[0] if args else {}
    elif callback == "report_strategies":
        raw, strategies = args[0], [str(s) for s in args[1]]
    else:
        code = status_code(args[0])
        msg, raw = str(args[1]), (args[2] if len(args) > 2 else {})
    try:
        faults = codec.merge_faults(raw)
    except (TypeError, ValueError):
        return None
    if callback == "report_fault_ranks":
        return codec.encode_process_fault_request(job_id, faults) if faults else None
    if callback == "report_strategies":
        return codec.encode_recover_strategy_request(job_id, faults, strategies)
    if callback == "report_stop_complete":
        return codec.encode_stop_complete_request(job_id, code, msg, faults)
    if callback == "report_result":
        strategy = str(args[3]) if len(args) > 3 else ""
        isolate = [str(rank) for rank in sorted(faults)] if code == 201 else []
        return codec.encode_recover_status_request(job_id, code, msg, strategy, isolate)
    return None


def _request_or_none(job_id: str, callback: str, args: tuple[Any, ...]) -> bytes | None:
    """Where the lane's call is made: the request, or None when an argument is bad (the
    loop answers a malformed report 499 and logs and counts bad fault entries; the outbox
    then sends what it would have sent the ordinary way)."""
    try:
        return request(job_id, callback, args)
    except Exception:  # noqa: BLE001 - never kill the thread making the call
        return None


#: The largest fault map the lane sends. The hand-off thread shares the controller's CPU
#: and makes the lane's calls under SCHED_FIFO: encoding 100 000 ranks there (about 9 ms)
#: kept the controller's thread off its CPU, and callback block p99 rose from 49 to 75 us
#: (bench/bench_relay.py). A map this large is encoded on the loop as before, where the
#: encoding, not the hand-over, is the hop's cost.
LANE_MAX_RANKS = 10_000

#: The largest fault map whose request the hand-off thread writes before it is promoted
#: (``_send``). Encoding a bigger one takes long enough (about 0.4 ms at 10 000 ranks)
#: that, under ``SCHED_BATCH``, the controller's thread waking from its sleep preempted
#: the hand-off thread mid-encoding, holding the GIL: bench_relay's callback -> wire p99
#: at 10 000 ranks was 0.9, 5.8 and 13.6 ms in three runs (0.8 ms when every lane call
#: was promoted first; 2.7 ms in the one run since). Such a map is encoded and written
#: under ``SCHED_FIFO``, where the ~0.1 ms the write-first order saves is small beside
#: its encoding.
WRITE_FIRST_MAX_RANKS = 1_000


def _ranks(report: ControllerReport) -> int:
    """How many ranks a report's fault map holds (0 when it has none, or no map)."""
    args = report.args
    faults = args[0] if report.callback in ("report_fault_ranks", "report_strategies") and args else (
        args[2] if len(args) > 2 else None)
    try:
        return len(faults)  # type: ignore[arg-type]
    except TypeError:
        return 0


#: Posts one batch of reports to the event loop (``Handoff``); may raise RuntimeError
#: when the loop is closed.
Post = Callable[["list[ControllerReport]"], None]


class ReportLane:
    """On the hand-off thread: route each batch, straight to the loop or, led by a
    report the lane may take, to ClusterD first (this thread makes the call). On the
    loop: hand over what is held before reacting to ClusterD, and count handled
    batches."""

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
        # Batches ``release`` took from ``held`` and posts, which the loop has not run yet
        # (under ``lock``), and the ids of those ``flush`` handled before their posted run
        # came (loop only): that run is then skipped (``claim``).
        self.posting: list[list[ControllerReport]] = []
        self._flushed: set[int] = set()
        self._outgoing: list[tuple[RpcThread, Call, int]] = []  # (.., ranks) taken under ``lock``, made after it
        self._boosted = False  # the hand-off thread runs SCHED_FIFO for the lane's calls
        self._refused = False  # ... which it may not (priority 0, or refused by the system)
        self._spare: Call | None = None  # the next call, made ahead (``release``, Call.blank)
        self.taken = 0  # reports sent this way (tests and benchmarks read it)
        self.chained = 0  # ... of which chained to the lane's call before them
        self._post: Post | None = None
        # Makes a call's request where the call is made (benchmarks wrap it to stamp it).
        self.prepare_request: Callable[[str, str, tuple[Any, ...]], bytes | None] = _request_or_none
        # On the loop: handles one held batch as a posted one is handled (``Handoff``).
        self.deliver: Post = lambda reports: None
        # Whether a cycle's strategies report must go through the loop, which may narrow
        # what it offers (``resume.CycleResume.sends_itself``); set by the link.
        self.loop_only_strategies: Callable[[str | None], bool] = lambda cycle: False

    def dispatch(self, reports: list[ControllerReport], post: Post) -> None:
        """Route one batch (hand-off thread), and make the calls the lane took for it.
        Never raises but ``post``'s RuntimeError."""
        try:
            self._route(reports, post)
        finally:
            calls, self._outgoing = self._outgoing, []
            self._send(calls)

    def _route(self, reports: list[ControllerReport], post: Post) -> None:
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
            ranks = _ranks(first)
            if kind is not None and ranks <= LANE_MAX_RANKS and self._open():
                cycle = None if kind == "fault" else self.flow.answering
                if (kind == "fault" or self.session.cycle_alive(cycle)) and self._take(reports, 0, kind, cycle, ranks):
                    self.held = [reports]  # before the lock is free: ``release`` needs it
                    if len(reports) > 1:
                        self._chain(reports, 1)
                    return
        # Nothing is held, so every batch ``release`` posts is already posted: this one
        # comes after them. Outside the lock: the loop takes it too, and must never wait
        # for this thread (SCHED_BATCH) to be scheduled again.
        post(reports)

    def _open(self) -> bool:
        return (self.unhandled == 1 and self.client.report_thread and self.client.rpc_thread is not None
                and self.relay.idle() and self.session.live.is_set())

    def _take(self, reports: list[ControllerReport], index: int, kind: str, cycle: str | None,
              ranks: int) -> bool:
        """Make ``reports[index]`` (whose fault map holds ``ranks``) one of the lane's calls
        (under ``lock``), chained to the lane's latest call if there is one; the hand-off
        thread makes it once the lock is free (``dispatch``). False when that failed (the
        ordinary way is always open)."""
        report = reports[index]
        if kind == "strategy" and self.loop_only_strategies(cycle):
            return False
        rpc = self.client.rpc_thread
        try:
            call, self._spare = self._spare or Call.blank(self.loop), None
            call.fill(METHODS[kind], self.client.config.rpc_timeout, self.last,
                      partial(self.prepare_request, self.job_id, report.callback, report.args))
        except Exception:  # noqa: BLE001 - the ordinary way is always open
            log.exception("the report lane failed; the report goes through the event loop")
            return False
        call.cycle = cycle
        self._outgoing.append((rpc, call, ranks))  # type: ignore[arg-type]
        self.relay.presend_pending += 1
        self.taken += 1
        self.chained += self.last is not None
        self.last = call
        # Not NamedTuple._replace: that costs several Python frames on this path.
        reports[index] = report_of((report.callback, report.args, report.at, report.waiter, call))
        return True

    def _chain(self, reports: list[ControllerReport], start: int) -> None:
        """Chain the batch's reports from ``start`` on to the lane's latest call, every
        held report before ``start`` being the lane's, until one cannot be: a cycle-bound
        report of the live cycle, sent by the hand-off thread the moment the call before it
        answers code 0, as the outbox chains one (relay.py). Never a fault report (the
        outbox merges those instead), and nothing once the loop queued a report of its
        own (under ``lock``)."""
        for index in range(start, len(reports)):
            kind = KINDS.get(reports[index].callback)
            cycle = self.flow.answering
            ranks = _ranks(reports[index])
            if not (kind is not None and kind != "fault" and ranks <= LANE_MAX_RANKS
                    and self.relay.idle(lane=True)
                    and self.session.live.is_set() and self.session.cycle_alive(cycle)
                    and self._take(reports, index, kind, cycle, ranks)):
                return

    def _send(self, calls: list[tuple[RpcThread, Call, int]]) -> None:
        """On the hand-off thread, outside ``lock``: make the lane's calls, one after the
        other, waiting for each answer under ``SCHED_FIFO`` (``realtime.py``): the answer
        must wake this thread at once on busy cores, as it wakes the report thread. The
        promotion comes once the first request is written (``_boost``, run by
        ``RpcThread.make``), or before a fault map over ``WRITE_FIRST_MAX_RANKS`` is
        encoded; ``release`` puts it back.

        Every call, not only those a report waits behind: tried with the promotion (a
        system call, 10-20 us on a thread that has just woken) only for the cycle's
        second fault report and chained calls, a call made under ``SCHED_BATCH`` left
        the thread waiting behind busy processes once answered, so the loop learned of
        the report 4.2 ms after the callback at the median at two busy processes (0.7
        ms under ``SCHED_FIFO``) and the next report waited behind it."""
        for rpc, call, ranks in calls:
            if ranks > WRITE_FIRST_MAX_RANKS and not (self._boosted or self._refused):
                self._boost()
            boost = None if self._boosted or self._refused else self._boost
            if not rpc.make(call, boost):
                return  # the loop is closed: the bridge is gone

    def _boost(self) -> None:
        """Under ``SCHED_FIFO`` from now until ``release``: run by ``RpcThread.make`` once
        the request is written (rpcthread.py, "Once the request is written")."""
        self._boosted = realtime.promote(self.client.realtime_priority, realtime.REPORT)
        self._refused = not self._boosted  # off, or refused (logged once): not asked again

    def release(self) -> None:
        """On the hand-off thread, with no callback left to dispatch: the held batches to
        the loop, in order (unless the loop took them already, ``flush``), and the thread
        back under ``SCHED_BATCH`` before it waits for the next callback, whose wake-up
        must never preempt the controller's thread. From now on batches go straight to
        the loop again."""
        with self.lock:
            held = self._unhold()
            self.posting.extend(held)  # ``flush`` handles them if ClusterD is read before their run
            post = self._post
        for reports in held:
            try:
                if post is not None:
                    post(reports)
            except RuntimeError:  # the loop is closed: the bridge is gone
                log.error("dropped %d controller report(s): the event loop is closed", len(reports))
        if self._boosted:
            self._boosted = False
            realtime.batch_policy()
        if self._spare is None and self.taken:  # the lane's next call object, made off its path
            self._spare = Call.blank(self.loop)

    def flush(self) -> None:
        """On the loop, before it reacts to ClusterD (a signal, a stream's start or end,
        a Subscribe) or stops: handle the held batches now, so the loop never learns of
        ClusterD's answer to a report before it knows the report (see the module
        docstring). That includes the batches ``release`` already took but whose posted
        run the loop has not reached: ClusterD's answer (the changeStrategy right after a
        strategies report, say) can be read in between, and the dispatcher would then
        meet it with the flow one step behind and refuse it. Their posted run is skipped."""
        with self.lock:
            early, self.posting = self.posting, []
            held = self._unhold()
        for reports in early:
            self.deliver(reports)
            self._flushed.add(id(reports))  # after: ``deliver`` claims it first
        for reports in held:
            self.deliver(reports)

    def claim(self, reports: list[ControllerReport]) -> bool:
        """On the loop, for a batch posted to it: True to handle it now, False when
        ``flush`` handled it already. Every posted batch is claimed exactly once."""
        if self._flushed and id(reports) in self._flushed:
            self._flushed.discard(id(reports))
            return False
        with self.lock:
            for index, batch in enumerate(self.posting):
                if batch is reports:
                    del self.posting[index]
                    break
        return True

    def _unhold(self) -> list[list[ControllerReport]]:
        """The held batches, taken: from now on batches go straight to the loop (under
        ``lock``)."""
        held, self.held, self.last = self.held or [], None, None
        return held

    def handled(self) -> None:
        """The loop handled a batch: its reports are in the outbox (loop)."""
        with self.lock:
            self.unhandled -= 1
