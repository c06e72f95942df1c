"""The one owner of a job's cycle state, and the snapshot of it the report wire reads.

What the stream shows (live, subscribed, the running cycle, the stream's token, why the
last stream ended, a request to subscribe again) and what the controller answers (the
flow's answering cycle, the resume's rebound one) are written here by their sources on
the event loop and published to the report wire's thread as one immutable ``Cycles``
snapshot (docs/architecture.md, "the report path"). Every part that reads or asks for a
change of the cycle state holds this object; none of them holds another part for it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol


@dataclass(frozen=True)
class Rebound:
    """A new cycle's globalFault rebound to the controller's coming report_strategies
    (resume.py, at GLOBAL_SENT): the cycle's token and the ranks its globalFault named.
    ``named`` is the resume's own copy, never changed after it is published."""

    cycle: str
    named: frozenset[int]


class Answering(NamedTuple):
    """What the controller answered at one moment, from one publication: the cycle a
    report made then is bound to, and the rebound cycle whose strategies are narrowed."""

    cycle: str | None
    rebound: Rebound | None


#: Before every change kept, and for a report bound to no cycle (a fault report).
NOT_ANSWERED = Answering(None, None)


@dataclass(frozen=True)
class Cycles:
    """The cycle state as the report wire's thread reads it: replaced whole by
    ``CycleState``, never changed in place."""

    live: bool = False  # a subscription is live (its stream delivered a message)
    # A Subscribe request is on its way and its stream has not ended: ClusterD resets the
    # job inside the Subscribe handler before anything else, so a fault report from then
    # on reaches the new subscription's job (docs/architecture.md).
    subscribed: bool = False
    running: str | None = None  # the running cycle's uuid as the stream shows it
    stream: str | None = None  # the live stream's token (the cycle of uuid-less signals)
    answering: str | None = None  # the cycle the controller answers now (ControllerFlow.answering)
    # The cycle whose strategies report the wire narrows when its globalFault named ranks
    # beyond the report's (resume.py: a cycle rebound at GLOBAL_SENT), published with
    # ``answering``.
    rebound: Rebound | None = None

    def alive(self, token: str | None) -> bool:
        """Whether a report answering ``token`` may still be delivered."""
        return bool(token) and self.live and token in (self.running, self.stream)


class AnsweringSource(Protocol):
    """Where the cycle the controller answers is kept (``ControllerFlow``)."""

    answering: str | None


class CycleState:
    """The cycle state of one job's bridge.

    Written on the event loop only: by the session (``stream_opening``,
    ``subscribe_sent``, ``heard``, ``stream_ended``), by the dispatcher after it moved the
    flow (``answering_changed``), by the resume (``rebound_changed``), and by any part
    asking for a new subscription (``request_resubscribe``). Read on the report wire's
    thread through ``snapshot``, ``answering_at``, ``begin_send`` and ``end_send``.

    Invariants: each change is published once, whole, under ``_lock``, before the loop
    acts on it; a change of the stream (live, subscribed, running, stream) wakes the
    wire once (``wake``: it may send or must drop what waits), a change of what the
    controller answers wakes it not (the wire reads it when it takes the next report);
    once a stream's end is published no cycle-bound report of it starts (``begin_send``).
    """

    def __init__(self, flow: AnsweringSource, wake: Callable[[], None]) -> None:
        """``flow``: read for the answering cycle at each publication. ``wake``: wakes the
        report wire's thread (``ReportInbox.wake``); any thread, never blocks."""
        self._flow = flow
        self._wake = wake
        self._lock = threading.Lock()  # ``snapshot`` replaced, and read with ``_unsettled`` changed
        self.snapshot = Cycles()  # replaced whole under ``_lock``; the wire's thread reads it
        # When ``answering`` or ``rebound`` changed (monotonic, stamped before the
        # publication), newest last: appended on the loop and read on the wire's thread,
        # both under ``_lock``.
        self._answering_since: deque[tuple[float, Answering]] = deque([(float("-inf"), NOT_ANSWERED)], maxlen=64)
        self._unsettled = 0  # cycle-bound calls on the wire (under ``_lock``)
        self._settled = asyncio.Event()  # the loop's: set when ``_unsettled`` fell to 0
        # -- the loop's own
        self.live = asyncio.Event()  # set while a subscription is live (the side services wait for it)
        self.stream_count = 0  # subscriptions made; names the stream in cycle tokens
        self._end_reason = "start"
        self._resubscribe = False
        self._end_stream: Callable[[], None] | None = None  # ends the open stream (``stream_opening``)
        self.publications = 0  # how many times the snapshot was replaced (tests count them)

    # ================================================================ the stream (the session's)
    @property
    def end_reason(self) -> str:
        """Why the previous stream ended (``cycle_end``: ClusterD closed it after a cycle
        or a reset; ``start`` before the first; otherwise a loss, a freeze or a request)."""
        return self._end_reason

    @property
    def resubscribe_requested(self) -> bool:
        return self._resubscribe

    def cycle_running(self) -> bool:
        """Whether the stream shows a running cycle."""
        return self.snapshot.running is not None

    def stream_token(self) -> str:
        """The token of the newest stream (the cycle of its uuid-less signals)."""
        return f"stream:{self.stream_count}"

    def stream_opening(self, end: Callable[[], None]) -> str:
        """A Subscribe is about to be made: counts the stream and keeps ``end``, which a
        resubscribe request calls to end it. Returns the stream's token."""
        self._resubscribe = False
        self._end_stream = end
        self.stream_count += 1
        return self.stream_token()

    def subscribe_sent(self) -> None:
        """The Subscribe had its head start: fault reports may leave."""
        self._publish(subscribed=True)

    def heard(self, running: str | None) -> None:
        """The stream delivered a message; ``running`` is the cycle it shows now."""
        if not self.live.is_set():
            self.live.set()
        self._publish(live=True, running=running, stream=self.stream_token())

    def stream_ended(self, reason: str) -> None:
        """The stream ended for ``reason`` (kept unless a request named another)."""
        self._end_stream = None
        if not self._resubscribe:
            self._end_reason = reason
        self.live.clear()
        self._publish(live=False, subscribed=False, running=None, stream=None)

    def request_resubscribe(self, reason: str) -> None:
        """Subscribe again (ClusterD lost the job, an orphaned globalFault, a report whose
        outcome is unknown): the open stream ends, the session starts a new one."""
        self._end_reason = reason
        self._resubscribe = True
        if self._end_stream is not None:
            self._end_stream()

    # ================================================================ what the controller answers
    def answering_changed(self) -> None:
        """The flow's answering cycle may have changed (a notify about to be made, or
        undone): published before the notify, since the controller answers only after."""
        self._publish()

    def rebound_changed(self, rebound: Rebound | None) -> None:
        """The resume's rebound cycle (and with it perhaps the answering one) changed:
        published together, so a report is bound and narrowed from one publication."""
        self._publish(rebound=rebound)

    # ================================================================ settling (the session's)
    async def settle(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until no cycle-bound report is on the wire; False on
        timeout. Awaited before every Subscribe: a Subscribe resets ClusterD's job and
        empties its one-slot buffers, and a report of the ended stream still on the wire
        would land in the new cycle's."""
        with self._lock:
            if not self._unsettled:
                return True
            self._settled.clear()
        try:
            await asyncio.wait_for(self._settled.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def mark_settled(self) -> None:
        """On the loop, posted by the wire when its last cycle-bound call ended."""
        self._settled.set()

    # ================================================================ the report wire's thread
    def answering_at(self, at: float) -> Answering:
        """What the controller answered at ``at`` (monotonic): the cycle and the rebound
        cycle of the last publication before then; neither when older than every change
        kept (64)."""
        with self._lock:
            for since, answering in reversed(self._answering_since):
                if since <= at:
                    return answering
        return NOT_ANSWERED

    def begin_send(self, cycle: str | None) -> bool:
        """Before a cycle-bound call: whether ``cycle`` is alive, counting the call as on
        the wire when it is (with ``_publish``'s lock: no report of a stream the loop saw
        end starts)."""
        with self._lock:
            alive = self.snapshot.alive(cycle)
            if alive:
                self._unsettled += 1
        return alive

    def end_send(self) -> bool:
        """After a cycle-bound call; True when none is left on the wire (the wire then
        posts ``mark_settled`` to the loop)."""
        with self._lock:
            self._unsettled -= 1
            return self._unsettled == 0

    # ================================================================ publication
    def _publish(self, **changes: Any) -> None:
        stamp = time.monotonic()  # before the store: a callback answering this cycle comes after it
        answering = self._flow.answering
        with self._lock:
            before = self.snapshot
            after = replace(before, answering=answering, **changes)
            if after == before:
                return
            self.snapshot = after
            self.publications += 1
            answer = Answering(answering, after.rebound)
            if answer != self._answering_since[-1][1]:
                self._answering_since.append((stamp, answer))
        if (after.live, after.subscribed, after.running, after.stream) != \
                (before.live, before.subscribed, before.running, before.stream):
            self._wake()
