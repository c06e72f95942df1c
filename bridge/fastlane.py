"""A fault report straight from the hand-off thread to the report thread.

Every report used to cross controller thread -> hand-off thread -> event loop -> report
thread before it reached the wire, and the loop did all of its bookkeeping (validate,
flow, metrics, recorder, outbox) first. Measured against a server that answers like the
real ClusterD (``bench/bench_loaded.py``, ``bench/fast_clusterd.py``), the loop's share
alone was ~0.15 ms of a fault report's hop at the median, and the report thread, woken
while the loop still held the GIL, waited for the loop to finish it: the bridge's fault
report reached ClusterD 0.2-0.3 ms after the synchronous client's, whose callback makes
the call itself.

A fault report needs nothing of the loop's state to be encoded: it answers no cycle, its
content is the cleaned map and the job id. So when the outbox is idle, the hand-off
thread cleans and encodes it and queues it on the report thread itself, then hands the
report to the loop as before, marked as already queued (``ControllerReport.presend``);
the loop does the bookkeeping while the request is on its way, and the outbox adopts
the call as its head (``Relay.submit_faults(presend=...)``) to learn its outcome exactly
as for one it made itself: a failure is retried, code 0 is never resent.

The outbox's rules hold because the lane opens only when taking it cannot reorder or
duplicate anything (all checked under ``lock``, which the outbox also holds when it
queues a report):

* the outbox is empty, no pre-sent report waits for adoption, and it is not stopping:
  nothing can go on the wire before or beside this report (the outbox sends nothing
  while a pre-sent report waits for adoption);
* no earlier batch of callbacks is still on its way to the loop: callback order;
* the subscription is live (ClusterD loses a fault reported while no stream is open);
* the map has no bad entry (a bad one is the loop's to log and count) and is not empty;
* the report thread exists (``controller.report_thread``).

Anything else goes the ordinary way, through the loop. Cycle-bound reports always do:
the cycle they answer is the loop's state (``ControllerFlow.answering``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

from . import faults as codec
from .relay import METHODS

if TYPE_CHECKING:
    from .clusterd import ClusterDClient, Session
    from .relay import Relay
    from .reports import ControllerReport

log = logging.getLogger(__name__)

FAULT_CALLBACK = "report_fault_ranks"


class FaultLane:
    """Decides on the hand-off thread whether a fault report goes straight to the report
    thread, and sends it there; counts the batches the loop has not handled yet."""

    def __init__(self, job_id: str, relay: Relay, session: Session, client: ClusterDClient,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.job_id = job_id
        self.relay = relay
        self.session = session
        self.client = client
        self.loop = loop
        self.lock = relay.lane_lock
        self.unhandled = 0  # batches posted to the loop and not handled yet (under ``lock``)
        self.taken = 0  # reports sent this way (tests and benchmarks read it)

    def offer(self, report: ControllerReport) -> ControllerReport:
        """``report`` marked as already queued on the report thread when it could take the
        lane, else unchanged. On the hand-off thread, before its batch is posted; never
        raises (the ordinary way is always open)."""
        try:
            return self._offer(report)
        except Exception:  # noqa: BLE001 - an optimisation must never lose a report
            log.exception("the fault lane failed; the report goes through the event loop")
            return report

    def _offer(self, report: ControllerReport) -> ControllerReport:
        if report.callback != FAULT_CALLBACK or not report.args:
            return report
        rpc = self.client.rpc_thread
        if rpc is None or not self.client.report_thread:
            return report
        cleaned = codec.clean_faults(report.args[0])
        if cleaned.bad or not cleaned.faults:
            return report
        payload = codec.encode_process_fault_request(self.job_id, cleaned.faults)
        with self.lock:
            if self.unhandled or not self.relay.idle() or not self.session.live.is_set():
                return report
            call = rpc.submit_from(self.loop, METHODS["fault"], payload, self.client.config.rpc_timeout)
            self.relay.presend_pending += 1
        self.taken += 1
        return report._replace(presend=(call, cleaned.faults))

    def posted(self) -> None:
        """A batch is on its way to the loop (hand-off thread)."""
        with self.lock:
            self.unhandled += 1

    def handled(self) -> None:
        """The loop handled a batch: its reports are in the outbox (loop)."""
        with self.lock:
            self.unhandled -= 1
