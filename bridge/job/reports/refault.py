"""A fault ClusterD answered 0 but started no recovery for: reported once more, once.

``FaultFollowUp``, on the event loop: while the controller's flow waits for stop_train
after its UCE/HCCL report (``Step.AWAIT_STOP``) and ClusterD shows no running cycle, it
reports the flow's faults again at the first moment ClusterD's fault centre counts them
new: the last delivery of any of those ranks (each delivery moves it) + the record hold
+ ``MARGIN``. When that leaves the controller's wait less than ``START_ALLOWANCE``, it
reports them as process faults ("1") instead, which start a cycle at once. At most once
per controller fault flow; never once a stop_train was forwarded, while ClusterD shows
a cycle, or for a flow with a process fault. Counted in
``tft_bridge_fault_rereports_total{reason}``. The peer facts: docs/clusterd.md sections 7
and 15.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from itertools import islice
from dataclasses import dataclass

from bridge.job.reports.controller_flow import ControllerFlow, Step
from bridge.job.metrics import BridgeMetrics
from bridge.job.recorder import NullRecorder
from bridge.job.reports.kinds import Outbox

log = logging.getLogger(__name__)

#: fault types ClusterD's fault centre turns into records (UCE, HCCL)
RECORD_TYPES = frozenset({0, 2})
#: Fault maps larger than this are remembered whole, not rank by rank (the loop's time).
PER_RANK = 1024
#: In fault-centre periods (ClusterD's 1 s): past the first publication without the
#: record before the re-report leaves ...
MARGIN = 0.5
#: ... what the controller's wait must still have once it leaves: ClusterD's next tick
#: (observed 0.7-1.0 s after a report) and its stopTrain ...
START_ALLOWANCE = 2.0
#: ... and after a delivery, before a flow whose re-report cannot wait out the hold is
#: reported as process faults: a new record's cycle would have started by then.
PROCESS_FAULT_GRACE = 2.0


@dataclass(frozen=True)
class FaultCentreTimes:
    """ClusterD's fault centre, in seconds (configuration)."""

    hold: float = 10.0  # clusterd.retry_record_hold
    period: float = 1.0  # clusterd.fault_centre_period


class FaultFollowUp:
    """The one owner of the re-report decision; every method runs on the event loop.
    ``cycle_running`` says whether ClusterD's stream shows a running cycle."""

    def __init__(self, flow: ControllerFlow, outbox: Outbox, metrics: BridgeMetrics, times: FaultCentreTimes,
                 cycle_running: Callable[[], bool], recorder: NullRecorder | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.flow = flow
        self.outbox = outbox
        self.metrics = metrics
        self.times = times
        self._cycle_running = cycle_running
        self.recorder: NullRecorder = recorder or NullRecorder()
        self._clock = clock
        self._delivered: dict[int, float] = {}  # rank -> when ClusterD last answered 0 to a UCE/HCCL report of it
        self._bulk_at = float("-inf")  # the last such answer to a map too large to remember by rank
        self._faults: dict[int, int] = {}  # the running controller flow's faults
        self._reported_at: float | None = None  # the flow's first report_fault_ranks (the controller's clock)
        self._done = True  # this flow had its re-report (or has none to have)
        self._timer: asyncio.TimerHandle | None = None
        self.due: tuple[float, str] | None = None  # when, and as what, the re-report is planned (tests read it)

    def controller_fault(self, faults: dict[int, int], at: float, first_of_flow: bool) -> None:
        """The controller's report_fault_ranks (``at``: its callback's time)."""
        if first_of_flow:
            self._faults, self._reported_at, self._done = dict(faults), at, False
        else:
            self._faults.update(faults)
        self._plan()

    def delivered(self, faults: dict[int, int], at: float) -> None:
        """ClusterD answered 0 to a fault report (``at``: when the answer came). A map of
        more than ``PER_RANK`` entries is remembered as a whole (no Python loop over a
        100 000-rank map on the event loop): it moves the re-report of any flow."""
        if len(faults) > PER_RANK:
            if not RECORD_TYPES.isdisjoint(faults.values()):
                self._bulk_at = at
        else:
            for rank, kind in faults.items():
                if kind in RECORD_TYPES:
                    self._delivered[rank] = at
            if len(self._delivered) > 2 * PER_RANK:  # forget records ClusterD no longer holds
                horizon = at - (self.times.hold + self.times.period * (1 + MARGIN))
                self._delivered = {rank: when for rank, when in self._delivered.items() if when >= horizon}
        self._plan()

    def _plan(self) -> None:
        """(Re)schedule the re-report for the running flow, or none."""
        self._cancel()
        if self._done or self.flow.step is not Step.AWAIT_STOP or not self._faults or self._reported_at is None:
            return
        if not set(self._faults.values()) <= RECORD_TYPES:
            return  # a process fault starts a cycle at once
        if len(self._faults) > PER_RANK:
            last = max(self._bulk_at, max(self._delivered.values(), default=float("-inf")))
        else:
            last = max(self._bulk_at, max((self._delivered.get(rank, float("-inf")) for rank in self._faults),
                                          default=float("-inf")))
        if last == float("-inf"):
            return  # not delivered yet: planned once it is
        period = self.times.period
        free_at = last + self.times.hold + period * (1 + MARGIN)
        wait = self.flow.wait_limit()  # the controller's wait for stop_train (MINDIO_WAIT_MINDX_TIME, a pause's)
        gives_up_at = self._reported_at + (wait if wait is not None else 0.0)
        if free_at + period * START_ALLOWANCE <= gives_up_at:
            self.due = (free_at, "record_held")
        else:
            self.due = (last + period * PROCESS_FAULT_GRACE, "as_process_fault")
        delay = max(0.0, self.due[0] - self._clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self._fire)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.due = None

    def _fire(self) -> None:
        self._timer = None
        due, self.due = self.due, None
        if due is None or self._done or self.flow.step is not Step.AWAIT_STOP or self._cycle_running():
            return
        self._done = True
        reason = due[1]
        faults = dict(self._faults) if reason == "record_held" else {rank: 1 for rank in self._faults}
        waited = self._clock() - (self._reported_at or self._clock())
        log.warning("ClusterD answered the fault report of rank(s) %s with OK but started no recovery in %.1f s "
                    "(its fault centre still held the rank's earlier fault: 'no new faults added'); reporting %s "
                    "before the controller gives the job up (%s)", sorted(islice(self._faults, 16)), waited,
                    "them again" if reason == "record_held" else "them as process faults", reason)
        self.metrics.fault_rereports.labels(reason).inc()
        self.recorder.rereported(reason, faults)
        self.outbox.submit_faults(faults)

    def close(self) -> None:
        self._done = True
        self._cancel()
