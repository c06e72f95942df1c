"""A report from the hand-off thread straight to ClusterD, ahead of the event loop.

Every report would cross controller thread -> hand-off thread -> event loop -> report
thread, with the loop's bookkeeping (validate, flow, metrics, recorder, outbox) before
the wire; the synchronous MindCluster client's callback makes the call itself. So when
the outbox is idle, the hand-off thread, already awake with the report, binds it to its
cycle, encodes it and makes the call itself on the report thread's channel
(``RpcThread.make``), and posts the batch to the loop only once it has nothing left to
dispatch; the loop then does its bookkeeping and adopts the call as the outbox's head
(``Relay.submit_faults`` / ``submit_cycle_report`` with ``presend``), learning its outcome
as for a chained call. What that saves and costs is in docs/performance.md
("Measurements behind the design").

The rules, each with the peer fact behind it:

* **The cycle is bound when the hand-off takes the report.** A stop-complete, strategy or
  result report answers the cycle whose notify the controller last accepted
  (``ControllerFlow.answering``), which the loop sets before it makes that notify, so it
  is already the right one when the controller's callback runs. ClusterD keeps reports
  in one-slot buffers whatever its state: a report bound to the wrong cycle answers it.
* **The lane opens only when taking a report cannot reorder anything** (decided under
  ``lock``, which the outbox holds when it queues a report): the outbox is empty, no
  pre-sent report waits for adoption, it is not stopping, no earlier batch is still on
  its way to the loop (callback order), the subscription is live (ClusterD loses a fault
  reported while no stream is open), a cycle-bound report's cycle is the live one, and
  the report thread's channel exists. While the lane's batch has not reached the loop,
  every later batch waits behind it (``release``) or is handed over with it (``flush``).
* **The loop catches up before it reacts to ClusterD** (a message of the stream, a
  stream's end, a Subscribe: ``Session.catch_up``; and before it stops): the batch
  reaches the loop after the call, so the loop could otherwise learn of ClusterD's
  answer (the globalFault after a stop-complete) before the report it answers.
* **Chained on the lane.** A cycle-bound report of the live cycle that comes while the
  lane's call is out (the strategies right behind the cycle's second fault report) is
  made chained to it (``rpcthread.py``, "Chained calls": sent only right after that call
  answered code 0, the outbox's order), by the hand-off thread the moment it has
  dispatched it. A fault report is never chained: the outbox merges those.
* **Never what the loop must see first.** A report with a bad fault entry or a malformed
  argument (``_request_or_none`` gives None: the loop logs, counts and answers it), a
  strategies report the resume may narrow (``loop_only_strategies``), and a fault map
  over ``LANE_MAX_RANKS`` (its encoding, not the hand-over, is then the hop's cost, and it
  must not hold the controller's CPU).
* **Scheduling.** The hand-off thread waits for callbacks under ``SCHED_BATCH`` on the
  controller's CPU (``realtime.py``, ``affinity.py``: a realtime wake-up preempted the
  controller's thread inside its callback), and runs ``SCHED_FIFO`` from the moment a
  call's request is written until it waits for callbacks again, so ClusterD's answer wakes
  it at once on busy cores; not before the write, because a realtime writer keeps
  ClusterD's receiving thread, which Linux puts on the writer's CPU on loopback, off it
  (rpcthread.py, "Once the request is written"). The stop bounds the hand-off's end by
  the call's deadline (``Link.stop``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from . import faults as codec
from . import realtime
from .reporttypes import KINDS, METHODS, ControllerReport, report_of, status_code
from .rpcthread import Call

if TYPE_CHECKING:
    from .clusterd import ClusterDClient, Session
    from .rpcthread import RpcThread
    from .flow import ControllerFlow
    from .relay import Relay

log = logging.getLogger(__name__)

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
#: and makes the lane's calls under SCHED_FIFO: encoding a far larger map there kept the
#: controller's thread off its CPU (block time, bench/bench_relay.py). A larger map is
#: encoded on the loop, where the encoding, not the hand-over, is the hop's cost.
LANE_MAX_RANKS = 10_000

#: The largest fault map whose request the hand-off thread writes before it is promoted
#: (``_send``). Encoding a bigger one under ``SCHED_BATCH`` takes long enough that the
#: controller's thread, waking from its sleep, preempted the hand-off thread mid-encoding
#: while it held the GIL; such a map is encoded and written under ``SCHED_FIFO``, where
#: what the write-first order saves is small beside its encoding (bench_relay).
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
Post = Callable[[list[ControllerReport]], None]


class ReportLane:
    """On the hand-off thread: route each batch, straight to the loop or, led by a
    report the lane may take, to ClusterD first (this thread makes the call). On the
    loop: hand over what is held before reacting to ClusterD, and count handled
    batches."""

    def __init__(self, job_id: str, relay: Relay, session: Session, client: ClusterDClient,
                 loop: asyncio.AbstractEventLoop, flow: ControllerFlow, *, deliver: Post,
                 loop_only_strategies: Callable[[str | None], bool]) -> None:
        """``deliver``: on the loop, handles one held batch as a posted one is handled
        (``Handoff.handle_posted``). ``loop_only_strategies(cycle)``: whether a cycle's
        strategies report must go through the loop, which may narrow what it offers
        (``resume.CycleResume.sends_itself``)."""
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
        self._deliver = deliver
        self._loop_only_strategies = loop_only_strategies

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
        return (self.unhandled == 1 and self.client.rpc_thread is not None
                and self.relay.idle() and self.session.live.is_set())

    def _take(self, reports: list[ControllerReport], index: int, kind: str, cycle: str | None,
              ranks: int) -> bool:
        """Make ``reports[index]`` (whose fault map holds ``ranks``) one of the lane's calls
        (under ``lock``), chained to the lane's latest call if there is one; the hand-off
        thread makes it once the lock is free (``dispatch``). False when that failed (the
        ordinary way is always open)."""
        report = reports[index]
        if kind == "strategy" and self._loop_only_strategies(cycle):
            return False
        rpc = self.client.rpc_thread
        try:
            call, self._spare = self._spare or Call.blank(self.loop), None
            call.fill(METHODS[kind], self.client.config.rpc_timeout, self.last,
                      partial(_request_or_none, self.job_id, report.callback, report.args))
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

        Every call, not only those a report waits behind: a call made under
        ``SCHED_BATCH`` left the thread waiting behind busy processes once answered, and
        the next report waited behind it (docs/performance.md)."""
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
            self._deliver(reports)
            self._flushed.add(id(reports))  # after: ``deliver`` claims it first
        for reports in held:
            self._deliver(reports)

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
