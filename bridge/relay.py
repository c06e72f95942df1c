"""The ordered outbox from the controller's callbacks to ClusterD's Report* RPCs.

This module is the delivery rules only; what a report is, which cycle it answers and
what the controller's flow learns from it is the return path, ``bridge/reports.py``.
The rules below hold for every request whatever produced it (a callback, the re-report
on a new stream, the seed API), so they live apart from the callbacks and are tested
against the simulated ClusterD on their own.

Delivery rules, each from a way the real ClusterD punishes a careless client:

* Reports go out in callback order, by one task; the one exception, a report the
  hand-off thread gives the report thread while this outbox is idle (``fastlane.py``,
  with the cycle reports chained right behind it there), is decided under ``lane_lock``
  so that nothing can be queued before or beside it, and is adopted at the head
  (``presend``, in callback order) before anything else is sent.
* Fault reports wait for a live subscription (ClusterD loses faults reported while no
  stream is open), survive reconnects, and consecutive ones are merged into one request
  with ClusterD's own rule. Resending a fault report is harmless: ClusterD merges faults.
* Stop-complete, strategy and result reports answer one cycle (uuid). ClusterD queues
  them in one-slot buffers whatever its state, so a report that outlives its cycle
  would be consumed by the next one: it is dropped, counted and logged instead.
* A report that got code 0 is never resent. A cycle-bound report is retried only when
  it provably did not reach ClusterD; an unknown outcome is final.
* Memory is bounded: queued fault reports merge with their neighbour, so the fault
  entries never outnumber the cycle-bound ones by more than one; past ``limit`` the
  oldest cycle-bound report is dropped. No fault rank is ever dropped.
* A cycle-bound report queued right behind the request on the wire is *chained* to it on
  the report thread (``rpcthread.py``): sent the moment that request answers code 0, as
  the synchronous client sends its next report, without a round trip through this loop
  (the cycle's second fault report and the strategy report follow each other,
  and every thread wake-up between them costs a scheduling delay on busy cores). The
  rules above hold unchanged: the chained report leaves only after its predecessor's
  code 0, is withdrawn if its cycle ends before the thread takes it, and a chain that
  breaks (the predecessor failed) leaves it unsent, to go the ordinary way. Fault
  reports are never chained: they keep merging until they are the head.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from . import faults as codec
from .backoff import Backoff
from .clusterd import ClusterDClient, Delivery, RpcFailure, Session
from .codes import Code
from .metrics import BridgeMetrics, drop_reason_for_code
from .reporttypes import METHODS
from .rpcthread import Call, ChainBroken

log = logging.getLogger(__name__)

#: The code a caller waiting for a dropped report receives (bridge.recover_manager).
DROP_CODES = {
    "no_live_cycle": Code.OrderMix,  # the cycle it answers is over: out of state-machine order
    "cycle_ended": Code.OrderMix,
    "outbox_full": Code.EventQueueBusy,
    "shutdown": Code.ServerInnerError,  # never sent
}



@dataclass
class Pending:
    kind: str  # a key of METHODS
    cycle: str | None = None  # the uuid a cycle-bound report answers
    payload: bytes = b""  # encoded request (cycle-bound reports)
    faults: dict[int, int] = field(default_factory=dict)  # fault reports, merged until sent
    merged: int = 1  # callback reports this entry carries
    sending: bool = False  # on the wire now: nothing may merge into it any more
    waiters: list[Future[int]] = field(default_factory=list)  # callers waiting for the outcome
    chained: Call | None = None  # queued on the report thread behind the request on the wire
    lane: bool = False  # sent by the report lane before the loop saw it (bridge/fastlane.py)

    def resolve(self, code: int) -> None:
        for waiter in self.waiters:
            if not waiter.done():
                waiter.set_result(code)


class Relay:
    def __init__(self, job_id: str, client: ClusterDClient, session: Session, metrics: BridgeMetrics,
                 limit: int = 10_000, *, on_drop: Callable[[str, str | None, str], None],
                 on_outcome_unknown: Callable[[str], None]) -> None:
        """``on_drop(kind, cycle, reason)``: a report was dropped (the flight recorder).
        ``on_outcome_unknown(kind)``: a cycle-bound report whose outcome is unknown was
        dropped while its cycle lives (resume.py may then reset ClusterD's cycle on
        purpose, to resume it deterministically)."""
        self.job_id = job_id
        self.client = client
        self.session = session
        self.metrics = metrics
        self.limit = limit
        self._queue: deque[Pending] = deque()
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._settled = asyncio.Event()  # set while no cycle-bound report is on the wire
        self._settled.set()
        self._unsettled = 0  # cycle-bound calls on the wire or chained
        self._on_wire: tuple[Pending, Call | None] | None = None  # the head while its call is out
        # The report lane (bridge/fastlane.py): held by the hand-off thread while it decides
        # and queues a fault report on the report thread, and here around every append.
        self.lane_lock = threading.Lock()
        self.presend_pending = 0  # reports queued by the lane, not adopted yet (under lane_lock)
        self._on_drop = on_drop
        self._on_outcome_unknown = on_outcome_unknown
        metrics.outbox_depth.set_function(lambda: len(self._queue))
        session.cycle_listeners.append(self._cycle_over)

    def __len__(self) -> int:
        return len(self._queue)

    # ------------------------------------------------------------------ submission (event loop)
    def idle(self, lane: bool = False) -> bool:
        """Nothing queued, on the wire or waiting for adoption, and not stopping: a report
        the lane queues now is the next on the wire (called under ``lane_lock``). With
        ``lane``: the lane's own calls waiting for adoption aside (one chained to them)."""
        return not self._queue and (lane or self.presend_pending == 0) and not self._stopping

    def _adopt(self, pending: Pending) -> None:
        """A lane's report into the outbox: behind the lane's reports adopted before it
        (its call was chained to theirs), ahead of anything the loop queued meanwhile."""
        pending.lane = True
        at = 0
        while at < len(self._queue) and self._queue[at].lane:
            at += 1
        self._queue.insert(at, pending)

    def submit_faults(self, faults: dict[int, int], waiter: Future[int] | None = None,
                      presend: Call | None = None) -> None:
        """Queue a fault report; merged into the queued one before it when possible. With
        ``presend``: the lane already queued it on the report thread while the outbox was
        idle (bridge/fastlane.py); it becomes the head, its outcome learnt like any other's."""
        if presend is not None:
            with self.lane_lock:
                self.presend_pending -= 1
            if not faults:  # every entry was bad: the lane does not send it either (ChainBroken)
                presend.adopted = True
                presend.future.add_done_callback(_retrieve)
                if waiter is not None:
                    waiter.set_result(Code.OK)
                self._wakeup.set()
                return
            presend.adopted = True
            head = Pending("fault", faults=faults, sending=True, chained=presend)
            if waiter is not None:
                head.waiters.append(waiter)
            self._adopt(head)
            self._wakeup.set()
            return
        if not faults:
            if waiter is not None:
                waiter.set_result(Code.OK)
            return
        tail = self._queue[-1] if self._queue else None
        if tail is not None and tail.kind == "fault" and not tail.sending:
            tail.faults = codec.merge_into(tail.faults, faults)
            tail.merged += 1
            self.metrics.reports_merged.inc()
        else:
            tail = Pending("fault", faults=faults)
            with self.lane_lock:
                self._queue.append(tail)
        if waiter is not None:
            tail.waiters.append(waiter)
        self._wakeup.set()

    def submit_cycle_report(self, kind: str, cycle: str | None, payload: bytes,
                            waiter: Future[int] | None = None, presend: Call | None = None) -> None:
        """Queue a report answering ``cycle``. With ``presend``: the lane already queued
        it on the report thread while the outbox was idle (bridge/fastlane.py); it becomes
        the head, counted as on the wire for ``settle``, withdrawn if its cycle is over
        and the report thread has not taken it, its outcome learnt like a chained call's."""
        pending = Pending(kind, cycle, payload, waiters=[waiter] if waiter is not None else [])
        if presend is not None:
            with self.lane_lock:
                self.presend_pending -= 1
            presend.adopted = True
            pending.sending, pending.chained = True, presend
            self._adopt(pending)
            self._unsettle()
            presend.future.add_done_callback(lambda _: self._chain_ended(pending, presend))
            if not self.session.cycle_alive(cycle):
                self._unchain(pending)  # never leaves if not taken yet; the delivery then drops it
            self._wakeup.set()
            return
        if not self.session.cycle_alive(cycle):
            self._drop(pending, "no_live_cycle")
            return
        with self.lane_lock:
            self._queue.append(pending)
        self._enforce_limit()
        self._wakeup.set()
        self._chain_next()

    def abandon(self, presend: Call) -> None:
        """A lane's call whose report the loop could not handle (malformed): withdrawn
        if not taken (it never leaves), its outcome ignored; the outbox goes on."""
        with self.lane_lock:
            self.presend_pending -= 1
        presend.adopted = True
        self.client.unchain(presend)
        presend.future.add_done_callback(_retrieve)
        self._wakeup.set()

    def _enforce_limit(self) -> None:
        while len(self._queue) > self.limit:
            # never one on the wire or chained to it: its fate is the delivery's to decide
            victim = next((p for p in self._queue if p.kind != "fault" and not p.sending), None)
            if victim is None and any(p.sending for p in self._queue):
                break  # at most the head and its chained follower over the limit
            if victim is None:  # only fault reports: merge the two oldest (nothing is lost)
                first, second = self._queue.popleft(), self._queue.popleft()
                second.faults = codec.merge_faults(first.faults, second.faults)
                self._queue.appendleft(second)
                continue
            self._queue.remove(victim)
            self._drop(victim, "outbox_full")

    def _drop(self, pending: Pending, reason: str) -> None:
        pending.resolve(DROP_CODES.get(reason, Code.ServerInnerError))
        self.metrics.reports_dropped.labels(pending.kind, reason).inc()
        self._on_drop(pending.kind, pending.cycle, reason)
        log.warning("dropped %s report for cycle %s: %s", pending.kind, pending.cycle, reason)

    def _cycle_over(self, uuid: str) -> None:
        """The cycle ended or was aborted: its undelivered reports must never reach the next."""
        for pending in self._queue:
            if pending.cycle == uuid:
                self._unchain(pending)
        for pending in [p for p in self._queue if p.cycle == uuid and not p.sending]:
            self._queue.remove(pending)
            self._drop(pending, "cycle_ended")

    def _unchain(self, pending: Pending) -> None:
        """Withdraw a chained report the report thread has not taken yet: it never left."""
        if pending.chained is not None and self.client.unchain(pending.chained):
            pending.chained = None
            pending.sending = False

    def stop(self) -> None:
        """Stop delivering; callers still waiting learn the report was not sent (599)."""
        self._stopping = True
        self._wakeup.set()
        for pending in self._queue:
            self._unchain(pending)
            if not pending.sending:
                self._drop(pending, "shutdown")

    # ------------------------------------------------------------------ delivery
    async def run(self) -> None:
        backoff = Backoff(self.client.config.reconnect_initial, self.client.config.reconnect_max)
        while not self._stopping:
            if not self._queue or self.presend_pending:  # a pre-sent fault report goes first: wait for it
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            head = self._queue[0]
            if head.kind == "fault":
                done = await self._deliver_faults(head, backoff)
            else:
                done = await self._deliver_cycle_report(head, backoff)
            if done and self._queue and self._queue[0] is head:
                self._queue.popleft()

    async def _wait_live(self) -> bool:
        """Wait for a live subscription or a wake-up; True when live."""
        if self.session.live.is_set():
            return True
        live = asyncio.ensure_future(self.session.live.wait())
        woken = asyncio.ensure_future(self._wakeup.wait())
        try:
            await asyncio.wait({live, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            live.cancel()
            woken.cancel()
        self._wakeup.clear()
        return self.session.live.is_set()

    async def _deliver_faults(self, head: Pending, backoff: Backoff) -> bool:
        presend, head.chained = head.chained, None  # queued by the report lane: already on its way
        if presend is None and not await self._wait_live():
            return False
        head.sending = True  # later reports queue behind it
        try:
            if presend is not None:
                code = await self._in_flight(head, METHODS["fault"], b"", presend)
            else:
                payload = codec.encode_process_fault_request(self.job_id, head.faults)
                code = await self._in_flight(head, METHODS["fault"], payload)
        except ChainBroken:  # withdrawn before the report thread took it (stopping): it never left
            head.sending = False
            return False
        except RpcFailure as failure:
            log.warning("fault report not delivered (%s), will retry: %s", failure.status, failure.detail)
            head.sending = False
            await asyncio.sleep(backoff.next())
            return False
        if code == Code.UnRegistry:
            # ClusterD lost the job (restarted?): re-Init/Register/Subscribe, then resend.
            head.sending = False
            self.session.request_resubscribe("clusterd_lost_job")
            await asyncio.sleep(backoff.next())
            return False
        head.sending = False
        backoff.reset()
        if code != Code.OK:
            log.error("ClusterD refused a fault report: %s", Code.describe(code))
            self.metrics.reports_dropped.labels("fault", drop_reason_for_code(code)).inc()
            head.resolve(code)
            return True
        self._delivered(head)
        return True

    async def _deliver_cycle_report(self, head: Pending, backoff: Backoff) -> bool:
        head.sending = True  # from here on this loop alone decides its fate
        while True:
            chained, head.chained = head.chained, None
            if chained is None and not self.session.cycle_alive(head.cycle):
                self._drop(head, "cycle_ended")
                return True
            try:
                if chained is not None:  # already queued behind its predecessor (``_chain_next``)
                    code = await self._in_flight(head, METHODS[head.kind], head.payload, chained)
                else:
                    code = await self._call_unsettled(head, METHODS[head.kind], head.payload)
            except ChainBroken:
                continue  # it never left: now the ordinary way, its cycle checked first
            except RpcFailure as failure:
                if failure.delivery is Delivery.NOT_DELIVERED:
                    log.warning("%s report did not reach ClusterD (%s); retrying", head.kind, failure.status)
                    await asyncio.sleep(backoff.next())
                    continue
                # Deadline or broken connection mid-call: ClusterD may hold it in a slot.
                self._drop(head, f"outcome_unknown_{failure.status.lower()}")
                if self.session.cycle_alive(head.cycle):
                    self._on_outcome_unknown(head.kind)  # (once the stream is gone, ClusterD has reset anyway)
                return True
            backoff.reset()
            if code == Code.OK:
                self._delivered(head)
                return True
            head.resolve(code)  # a waiting caller learns ClusterD's own answer
            self._drop(head, drop_reason_for_code(code))
            if code == Code.UnRegistry:
                self.session.request_resubscribe("clusterd_lost_job")
            return True

    async def _call_unsettled(self, head: Pending, method: str, payload: bytes) -> int:
        """A cycle-bound report's call; ``settle`` waits while it is on the wire."""
        self._unsettle()
        try:
            return await self._in_flight(head, method, payload)
        finally:
            self._resettle()

    def _unsettle(self) -> None:
        self._unsettled += 1
        self._settled.clear()

    def _resettle(self) -> None:
        self._unsettled -= 1
        if self._unsettled == 0:
            self._settled.set()

    async def _in_flight(self, head: Pending, method: str, payload: bytes, call: Call | None = None) -> int:
        """The code of the head's call (``call``: already queued, chained); while it is
        out, the cycle report behind it may be chained to it."""
        if call is None:
            call = self.client.submit(method, payload)
        self._on_wire = (head, call)
        self._chain_next()
        try:
            if call is None:  # not made on the report thread: nothing can be chained to it
                return await self.client.call(method, payload)
            return (await self.client.finish(call)).code
        finally:
            self._on_wire = None

    def _chain_next(self) -> None:
        """Queue the report right behind the head's call on the report thread, chained to
        it, when it is a cycle-bound report of a live cycle (see the module docstring)."""
        if self._on_wire is None or len(self._queue) < 2:
            return
        head, call = self._on_wire
        follower = self._queue[1]
        if (call is None or self._queue[0] is not head or follower.kind == "fault" or follower.sending
                or not self.session.cycle_alive(follower.cycle)):
            return
        chained = self.client.submit(METHODS[follower.kind], follower.payload, after=call)
        if chained is None:
            return
        follower.sending = True
        follower.chained = chained
        self._unsettle()
        chained.future.add_done_callback(lambda _: self._chain_ended(follower, chained))

    def _chain_ended(self, pending: Pending, call: Call) -> None:
        """A chained call is off the wire (answered, failed, or never sent)."""
        self._resettle()
        if pending.chained is call and not call.future.cancelled() and isinstance(call.future.exception(), ChainBroken):
            pending.chained = None  # never left: the head's delivery sends it the ordinary way
            pending.sending = False

    async def settle(self, timeout: float) -> bool:
        """Wait (at most ``timeout``: one RPC deadline bounds a call) until no cycle-bound
        report is on the wire; False on timeout. The session awaits this before every
        Subscribe: a report of the ended stream that reached ClusterD after the new
        Subscribe would sit in the new cycle's one-slot buffer and be consumed as its
        answer (seen: a stop-complete that crossed the stream's end on the wire).
        A call that timed out on our side may still arrive late; nothing a client does
        can order that, and its outcome was already counted as unknown."""
        if self._settled.is_set():
            return True
        try:
            await asyncio.wait_for(self._settled.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _delivered(self, pending: Pending) -> None:
        self.metrics.reports_sent.labels(pending.kind).inc()
        pending.resolve(Code.OK)

    async def drain(self, timeout: float) -> bool:
        """Wait until the outbox is empty (shutdown); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return not self._queue


def _retrieve(future: asyncio.Future[object]) -> None:
    """Mark an unawaited call's outcome as seen (asyncio logs an unretrieved exception)."""
    if not future.cancelled():
        future.exception()
