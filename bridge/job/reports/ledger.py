"""The return path's bookkeeping: what the controller's reports tell the bridge.

The report wire (``relay.py``) binds, cleans, encodes (narrowing a rebound cycle's
strategies) and sends each controller report and hands it here as it took it
(``Taken``), on the event loop, where the rest happens: the flow learns the callback (it
gates ClusterD's next notify on it), the recovery clock and the repeated-cycle watch
their phases, the resume remembers the controller's answers and counts a narrowed one,
bad entries are logged and counted, the recorder and the timeline see it. The peer facts
behind the rules (a bad rank empties ClusterD's whole fault map; every subscription
resets ClusterD's job, fault cache included) are in docs/clusterd.md and resume.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from bridge import faults as codec
from bridge.job.cycle_state import CycleState
from bridge.job.metrics import BridgeMetrics
from bridge.job.recorder import NullRecorder
from bridge.job.reports.controller_flow import ControllerFlow, Step
from bridge.job.reports.recovery_clock import RecoveryClock
from bridge.job.reports.refault import RECORD_TYPES, FaultCentreTimes, FaultFollowUp
from bridge.job.reports.relay import ReportInbox, Taken
from bridge.job.session.clusterd import SessionState
from bridge.job.session.codes import Code
from bridge.job.session.repeated_cycles import RepeatedCycles
from bridge.job.session.resume import CycleResume

log = logging.getLogger(__name__)


class ReportPath:
    """The controller's reports on the event loop, after the wire took them: the wire's
    ``WireListener``. Owns the recovery clock, the repeated-cycle watch, the resume and
    the fault follow-up; the dispatcher reaches the ones it needs through
    ``signals.ReportSide``. Every method runs on the loop; none raises for bad input."""

    def __init__(self, job_id: str, flow: ControllerFlow, inbox: ReportInbox, cycles: CycleState,
                 metrics: BridgeMetrics, *, recorder: NullRecorder | None = None,
                 observer: Callable[[str], None] | None = None,
                 fault_centre: FaultCentreTimes = FaultCentreTimes()) -> None:
        """``inbox``: where the loop's own reports go. ``cycles``: asked for a new
        subscription, read for the running cycle and why the last stream ended,
        published to by the resume. ``recorder``: the flight recorder (O(1) hooks).
        ``observer``: the demo's timeline. ``fault_centre``: ClusterD's fault centre
        times, for the re-report of a fault it skipped (refault.py)."""
        self.job_id = job_id
        self.flow = flow
        self.inbox = inbox  # where the loop's own reports go (the wire's inbox)
        self._cycles = cycles
        self.metrics = metrics
        self.clock = RecoveryClock(metrics)
        self.recorder: NullRecorder = recorder or NullRecorder()
        # A retry cycle ClusterD repeats after its success.
        self.repeats = RepeatedCycles(metrics, on_repeat=self.recorder.repeated)
        self.observer: Callable[[str], None] = observer or (lambda line: None)
        self._observed = observer is not None  # formatting a 100 000-rank timeline line costs ms
        self.flow_faults: dict[int, int] = {}  # the controller's faults in the running flow
        # Remembers this flow's answers, to carry the recovery across a ClusterD restart (resume.py).
        self.resume = CycleResume(job_id, flow, inbox, metrics, resubscribe=cycles.request_resubscribe,
                                  publish=cycles.rebound_changed)
        # A fault ClusterD answered 0 but starts no recovery for: reported once more (refault.py).
        self.follow_up = FaultFollowUp(flow, inbox, metrics, fault_centre, cycles.cycle_running,
                                       recorder=self.recorder)

    # ------------------------------------------------------------------ the wire's listener
    def taken(self, reports: list[Taken]) -> None:
        """The wire's reports, in callback order."""
        for report in reports:
            self.on_report(report)

    def dropped(self, kind: str, cycle: str | None, reason: str) -> None:
        """The wire dropped a report (counted there): the recorder closes its cycle's record."""
        self.recorder.dropped(kind, cycle, reason)

    def outcome_unknown(self, kind: str) -> None:
        """A cycle-bound report's deadline passed: it may or may not have reached ClusterD."""
        self.resume.outcome_unknown(kind)

    def faults_delivered(self, faults: dict[int, int], at: float) -> None:
        """ClusterD answered 0 to a fault report."""
        self.follow_up.delivered(faults, at)

    def on_report(self, taken: Taken) -> None:
        """One callback; never raises (a malformed one is counted, logged and answered 499)."""
        report = taken.report
        self.metrics.callbacks.labels(report.callback).inc()
        try:
            if taken.problem:
                raise ValueError(taken.problem)
            bad = taken.cleaned.bad
            if bad:
                log.error("bad fault map from the controller in %s: %s (%d entr%s left out)", report.callback,
                          taken.cleaned.error, bad, "y" if bad == 1 else "ies")
                self.metrics.bad_inputs.labels("controller_fault_map").inc(bad)
            REPORT_HANDLERS[report.callback](self, taken)
        except (TypeError, ValueError, IndexError, KeyError) as error:
            self.metrics.bad_inputs.labels(f"controller_{report.callback}").inc()
            log.error("malformed %s from the controller: %s", report.callback, error)
            self.recorder.callback(report.callback, report.at, malformed=str(error)[:200])
            _answer(taken, Code.ClientError)
        except Exception:
            self.metrics.callback_errors.inc()
            log.exception("failed to handle %s", report.callback)
            _answer(taken, Code.ClientError)

    # ------------------------------------------------------------------ the four callbacks
    def fault_ranks(self, taken: Taken) -> None:
        faults, at = taken.cleaned.faults, taken.report.at
        first_of_flow = self.flow.step in (Step.IDLE, Step.PAUSED, Step.STOP_SENT)
        if self.flow.step is Step.IDLE:  # the controller saw a fault first: a new one
            self.repeats.controller_fault()
        self.flow.on_callback("report_fault_ranks")
        by_type = self.metrics.count_faults(faults)
        if first_of_flow:
            self.clock.fault(at)
            self.flow_faults = dict(faults)
            self.resume.new_flow()
            self.metrics.faulty_ranks.set(len(faults))
        else:
            self.flow_faults = codec.merge_into(self.flow_faults, faults)
            self.metrics.faulty_ranks.set(len(self.flow_faults))
        if self._observed:
            self.observer(f"controller report_fault_ranks {codec.format_faults(faults) or '(none)'}")
        self.recorder.callback("report_fault_ranks", at, faults=faults, by_type=by_type)
        self.follow_up.controller_fault(faults, at, first_of_flow)

    def stop_complete(self, taken: Taken) -> None:
        report = taken.report
        code, msg = report.code, str(report.message)
        self.flow.on_callback("report_stop_complete", code=code)
        self.clock.stop_complete(report.at)
        self.resume.remember_stop(code, msg, taken.cleaned.faults)
        self.observer(f"controller report_stop_complete code={code}")
        self.recorder.callback("report_stop_complete", report.at, code=code)

    def strategies(self, taken: Taken) -> None:
        faults, strategies, at = taken.cleaned.faults, taken.strategies, taken.report.at
        self.flow.on_callback("report_strategies", strategies=tuple(strategies))
        self.clock.strategies(at)
        self.resume.remember_strategies(faults, strategies)
        self.observer(f"controller report_strategies {strategies}")
        self.recorder.callback("report_strategies", at, strategies=strategies)
        self.resume.strategies_sent(taken.cycle, taken.offered, taken.beyond)

    def result(self, taken: Taken) -> None:
        report = taken.report
        code, strategy = report.code, str(report.strategy)
        self.flow.on_callback("report_result", code=code, strategy=strategy)
        self.clock.result(report.at, strategy, code, self.repeats.outcome(code))
        if code == 0:
            self.metrics.faulty_ranks.set(0)
            if strategy == "retry":
                self.repeats.retry_succeeded(self.flow_faults)
        self.observer(f"controller report_result code={code} strategy={strategy or '(none)'}")
        self.recorder.callback("report_result", report.at, code=code, strategy=strategy)

    # ------------------------------------------------------------------ from the signal side
    def exit_decided(self) -> None:
        """ClusterD chose exit and the controller accepted it: no result will follow."""
        self.clock.exited(time.monotonic())
        self.repeats.cycle_ended()

    def on_session_state(self, state: SessionState) -> None:
        """A new stream: every subscription reset ClusterD's job, fault cache included.
        While the controller still waits for stop_train, a fault reported as a cycle ended
        may have been lost with code 0; only a fresh report can start the cycle. While it
        is stopped for a cycle, ``CycleResume`` restarts that cycle (resume.py)."""
        if state is not SessionState.SUBSCRIBED:
            return
        if self.flow.step is Step.AWAIT_STOP and self.flow_faults:
            if self._cycles.end_reason == "cycle_end" and set(self.flow_faults.values()) <= RECORD_TYPES:
                # UCE/HCCL after ClusterD closed the stream: its fault centre, not the
                # reset, decides, and a report now would only refresh a record it still
                # holds (refault.py re-reports them once it does not). After a lost or
                # frozen stream ClusterD may have restarted and forgotten its records:
                # reported at once, as any fault.
                return
            log.warning("re-reporting %d fault rank(s) on the new stream: ClusterD forgot them",
                        len(self.flow_faults))
            self.inbox.submit_faults(dict(self.flow_faults))
            return
        self.resume.on_subscribed(self.flow_faults)


def _answer(taken: Taken, code: int) -> None:
    waiter = taken.report.waiter
    if waiter is not None and not waiter.done():
        waiter.set_result(code)


#: callback name -> its handler: the one place each callback is handled.
REPORT_HANDLERS: dict[str, Callable[[ReportPath, Taken], None]] = {
    "report_fault_ranks": ReportPath.fault_ranks,
    "report_stop_complete": ReportPath.stop_complete,
    "report_strategies": ReportPath.strategies,
    "report_result": ReportPath.result,
}
