"""A fault report from the hand-off thread to the report thread, ahead of the event loop.

Every report crossed controller thread -> hand-off thread -> event loop -> report
thread, and the loop did all of its bookkeeping (validate, flow, metrics, recorder,
outbox) before the report thread could put it on the wire. Measured against a server
that answers like the real ClusterD (``bench/bench_loaded.py``), the loop's share was
~0.15 ms of a fault report's hop at the median, and the report thread, woken while
the loop held the GIL, waited for the loop to finish.

A fault report needs nothing of the loop's state to be encoded: it answers no cycle;
its content is the cleaned map and the job id. So when the outbox is idle the hand-off
thread gives the report to the report thread *first*, with the batch it came in: the
report thread cleans and encodes it, posts the batch to the loop and only then makes the
call. The loop does its bookkeeping while the request is on its way and adopts the call
as the outbox's head (``Relay.submit_faults(presend=...)``), learning its outcome as for
any call it made itself: a failure is retried, code 0 is never resent.

Where the work runs is measured, not chosen for symmetry: done on the hand-off thread,
it made the controller wait (that thread runs under ``SCHED_BATCH``, busy processes
preempt it while it holds the GIL, and a callback then waits for the GIL: block p99
0.05-1.8 ms at two busy processes against 0.03-0.05 ms); posted to the loop before the
call, the loop's bookkeeping took the GIL from the report thread and the request left
no sooner. The report thread runs realtime (``realtime.py``) and posts the batch only
when the request is ready to go.

The outbox's rules hold because the lane opens only when taking it cannot reorder
anything (decided under ``lock``, which the outbox also holds when it queues a report):
the outbox is empty, no pre-sent report waits for adoption, it is not stopping, no
earlier batch is still on its way to the loop (callback order), the subscription is
live (ClusterD loses a fault reported while no stream is open), and the report thread
exists. While the lane's batch has not reached the loop, every later batch waits behind
it and is posted after it (``_release``): the loop sees the callbacks in their order. A
map with a bad entry is not sent this way (``prepare`` returns None): the loop logs and
counts the bad entries and the outbox sends the rest the ordinary way. Cycle-bound
reports always go through the loop: the cycle they answer is its state
(``ControllerFlow.answering``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import faults as codec
from .relay import METHODS

if TYPE_CHECKING:
    from .clusterd import ClusterDClient, Session
    from .relay import Relay
    from .reports import ControllerReport

log = logging.getLogger(__name__)

FAULT_CALLBACK = "report_fault_ranks"

#: Posts one batch of reports to the event loop (``Handoff``); may raise RuntimeError
#: when the loop is closed.
Post = Callable[["list[ControllerReport]"], None]


class FaultLane:
    """On the hand-off thread: route each batch, straight to the loop or, led by a fault
    report, through the report thread first. On the loop: count handled batches."""

    def __init__(self, job_id: str, relay: Relay, session: Session, client: ClusterDClient,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.job_id = job_id
        self.relay = relay
        self.session = session
        self.client = client
        self.loop = loop
        self.lock = relay.lane_lock
        self.unhandled = 0  # batches posted (or held) and not handled by the loop yet (under ``lock``)
        self.held: list[list[ControllerReport]] | None = None  # the lane's batch and those behind it
        self.taken = 0  # reports sent this way (tests and benchmarks read it)
        self._post: Post | None = None

    def dispatch(self, reports: list[ControllerReport], post: Post) -> None:
        """Route one batch (hand-off thread). Never raises but ``post``'s RuntimeError."""
        with self.lock:
            self._post = post
            self.unhandled += 1
            if self.held is not None:  # the lane's batch has not reached the loop: keep the order
                self.held.append(reports)
                return
            first = reports[0]
            if self._open(first):
                try:
                    raw = first.args[0]
                    call = self.client.rpc_thread.submit_from(  # type: ignore[union-attr]
                        self.loop, METHODS["fault"], b"", self.client.config.rpc_timeout,
                        prepare=lambda: self._prepare(raw), before_send=self._release)
                except Exception:  # noqa: BLE001 - the ordinary way is always open
                    log.exception("the fault lane failed; the report goes through the event loop")
                else:
                    self.relay.presend_pending += 1
                    self.taken += 1
                    reports[0] = first._replace(presend=call)
                    self.held = [reports]
                    return
            post(reports)  # under the lock: ordered with ``_release``'s posts

    def _open(self, report: ControllerReport) -> bool:
        return (report.callback == FAULT_CALLBACK and len(report.args) >= 1 and type(report.args[0]) is dict
                and bool(report.args[0]) and self.unhandled == 1 and self.client.report_thread
                and self.client.rpc_thread is not None and self.relay.idle() and self.session.live.is_set())

    def _prepare(self, raw: Any) -> bytes | None:
        """On the report thread: the request, or None when the map has a bad entry (the
        loop's to log and count; the outbox then sends the rest the ordinary way)."""
        try:
            cleaned = codec.clean_faults(raw)
            if cleaned.bad or not cleaned.faults:
                return None
            return codec.encode_process_fault_request(self.job_id, cleaned.faults)
        except Exception:  # noqa: BLE001 - never kill the report thread
            log.exception("the fault lane could not encode a fault report; it goes the ordinary way")
            return None

    def _release(self) -> None:
        """On the report thread, once the request is ready to go: the held batches to the
        loop, in order; from now on batches go straight there again."""
        with self.lock:
            held, self.held = self.held or [], None
            post = self._post
            for reports in held:
                try:
                    if post is not None:
                        post(reports)
                except RuntimeError:  # the loop is closed: the bridge is gone
                    log.error("dropped %d controller report(s): the event loop is closed", len(reports))

    def handled(self) -> None:
        """The loop handled a batch: its reports are in the outbox (loop)."""
        with self.lock:
            self.unhandled -= 1
