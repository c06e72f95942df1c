"""The return path's bookkeeping: what the controller's reports tell the bridge.

The wire (``wire.py``) takes each of the controller's reports from its callback, binds
it to its cycle, encodes it and sends it; it hands each one, as it took it (``Taken``),
to the event loop, where this module does the rest: the flow learns the callback (it
gates ClusterD's next notify on it), the recovery clock and the repeated-cycle watch
their phases, the resume remembers the controller's answers, bad entries are logged and
counted, the recorder and the timeline see it. The loop takes them before it reacts to
anything from ClusterD (``Wire.catch_up``), so the flow is never behind ClusterD's
answer to a report.

The peer facts behind the rules here:

* ClusterD's rank parser empties a whole fault map for one bad rank: the wire leaves
  bad entries out (``faults.clean_faults``); here they are counted in
  ``tft_bridge_bad_inputs_total`` and logged. A malformed callback is answered 499 to a
  waiting caller and never raises into the loop.
* Every subscription resets ClusterD's job, fault cache included: when a new stream
  opens while the controller still waits for stop_train, the running flow's faults are
  reported again (``ReportPath.on_session_state``); when it opens while the controller is
  stopped for a cycle, ``resume.CycleResume`` restarts that cycle with the answers
  remembered here (stop-complete, strategies).
* A strategies report for a cycle the resume rebound (``Cycles.narrowed``) is held by
  the wire until ``offer`` here says what it may offer (``Wire.fill``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from bridge import faults as codec
from bridge.job.session.clusterd import SessionState
from bridge.job.session.codes import Code
from bridge.job.reports.controller_flow import ControllerFlow, Step
from bridge.job.metrics import BridgeMetrics
from bridge.job.recorder import NullRecorder
from bridge.job.reports.recovery_clock import RecoveryClock
from bridge.job.reports.refault import RECORD_TYPES, FaultCentreTimes, FaultFollowUp
from bridge.job.session.repeated_cycles import RepeatedCycles
from bridge.job.reports.kinds import Outbox
from bridge.job.session.resume import CycleResume
from bridge.job.reports.relay import Pending, Taken

log = logging.getLogger(__name__)

#: Fills a held strategies report with its request (``Wire.fill``; None: not sent).
Fill = Callable[[Pending, "bytes | None"], None]


class ReportPath:
    """The controller's reports, on the event loop, after the wire took them."""

    def __init__(self, job_id: str, flow: ControllerFlow, outbox: Outbox, metrics: BridgeMetrics,
                 observer: Callable[[str], None] | None = None, *, recorder: NullRecorder | None = None,
                 fill: Fill, resubscribe: Callable[[str], None], publish: Callable[[], None],
                 fault_centre: FaultCentreTimes = FaultCentreTimes(),
                 cycle_running: Callable[[], bool] = lambda: False,
                 stream_end_reason: Callable[[], str] = lambda: "start") -> None:
        """``recorder``: the flight recorder, told of every callback and of a repeated retry
        cycle (O(1) hooks). ``fill``: the wire's, for a held strategies report.
        ``resubscribe`` and ``publish``: the resume's (resume.py). ``fault_centre`` and
        ``cycle_running`` (whether ClusterD's stream shows a running cycle): the
        re-report of a fault ClusterD skipped (refault.py). ``stream_end_reason``: why the
        session's previous stream ended (``Session.end_reason``)."""
        self._stream_end_reason = stream_end_reason
        self.job_id = job_id
        self.flow = flow
        self.outbox = outbox
        self.metrics = metrics
        self._fill = fill
        self.clock = RecoveryClock(metrics)
        self.recorder: NullRecorder = recorder or NullRecorder()
        # A retry cycle ClusterD repeats after its success.
        self.repeats = RepeatedCycles(metrics, on_repeat=self.recorder.repeated)
        self.observer: Callable[[str], None] = observer or (lambda line: None)
        self._observed = observer is not None  # formatting a 100 000-rank timeline line costs ms
        self.flow_faults: dict[int, int] = {}  # the controller's faults in the running flow
        # Remembers this flow's answers, to carry the recovery across a ClusterD restart (resume.py).
        self.resume = CycleResume(job_id, flow, outbox, metrics, resubscribe=resubscribe, publish=publish)
        # A fault ClusterD answered 0 but starts no recovery for: reported once more (refault.py).
        self.follow_up = FaultFollowUp(flow, outbox, metrics, fault_centre, cycle_running, recorder=self.recorder)

    # ------------------------------------------------------------------ intake
    def taken(self, reports: list[Taken]) -> None:
        """The wire's reports, in callback order (the wire's ``WireListener.taken``)."""
        for report in reports:
            self.on_report(report)

    def on_report(self, report: Taken) -> None:
        """One callback; never raises (a malformed one is counted, logged and answered 499)."""
        self.metrics.callbacks.labels(report.callback).inc()
        try:
            if report.malformed:
                raise ValueError(report.error)
            if report.bad:
                log.error("bad fault map from the controller in %s: %s (%d entr%s left out)", report.callback,
                          report.error, report.bad, "y" if report.bad == 1 else "ies")
                self.metrics.bad_inputs.labels("controller_fault_map").inc(report.bad)
            REPORT_HANDLERS[report.callback](self, report)
        except (TypeError, ValueError, IndexError) as error:
            self.metrics.bad_inputs.labels(f"controller_{report.callback}").inc()
            log.error("malformed %s from the controller %r: %s", report.callback, report.args[:2], error)
            self.recorder.callback(report.callback, report.at, malformed=str(error)[:200])
            _answer(report, Code.ClientError)
            if report.held is not None:
                self._fill(report.held, None)
        except Exception:
            self.metrics.callback_errors.inc()
            log.exception("failed to handle %s", report.callback)
            _answer(report, Code.ClientError)
            if report.held is not None:
                self._fill(report.held, None)

    # ------------------------------------------------------------------ the four callbacks
    def fault_ranks(self, report: Taken) -> None:
        faults = report.faults
        first_of_flow = self.flow.step in (Step.IDLE, Step.PAUSED, Step.STOP_SENT)
        if self.flow.step is Step.IDLE:  # the controller saw a fault first: a new one
            self.repeats.controller_fault()
        self.flow.on_callback("report_fault_ranks")
        by_type = self.metrics.count_faults(faults)
        if first_of_flow:
            self.clock.fault(report.at)
            self.flow_faults = dict(faults)
            self.resume.new_flow()
            self.metrics.faulty_ranks.set(len(faults))
        else:
            self.flow_faults = codec.merge_into(self.flow_faults, faults)
            self.metrics.faulty_ranks.set(len(self.flow_faults))
        if self._observed:
            self.observer(f"controller report_fault_ranks {codec.format_faults(faults) or '(none)'}")
        self.recorder.callback("report_fault_ranks", report.at, faults=faults, by_type=by_type)
        self.follow_up.controller_fault(faults, report.at, first_of_flow)

    def faults_delivered(self, faults: dict[int, int], at: float) -> None:
        """ClusterD answered 0 to a fault report (the wire's ``WireListener.faults_delivered``)."""
        self.follow_up.delivered(faults, at)

    def stop_complete(self, report: Taken) -> None:
        code, msg = report.args[0], str(report.args[1])
        self.flow.on_callback("report_stop_complete", code=code)
        self.clock.stop_complete(report.at)
        self.resume.remember_stop(code, msg, report.faults)
        self.observer(f"controller report_stop_complete code={code}")
        self.recorder.callback("report_stop_complete", report.at, code=code)

    def strategies(self, report: Taken) -> None:
        faults = report.faults
        strategies = [str(s) for s in report.args[1]]
        self.flow.on_callback("report_strategies", strategies=tuple(strategies))
        self.clock.strategies(report.at)
        self.resume.remember_strategies(faults, strategies)
        self.observer(f"controller report_strategies {strategies}")
        self.recorder.callback("report_strategies", report.at, strategies=strategies)
        offered = self.resume.offer(report.cycle, faults, strategies)
        if report.held is not None:
            self._fill(report.held, codec.encode_recover_strategy_request(self.job_id, faults, offered))

    def result(self, report: Taken) -> None:
        code = report.args[0]
        strategy = str(report.args[3]) if len(report.args) > 3 else ""
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
            if self._stream_end_reason() == "cycle_end" and set(self.flow_faults.values()) <= RECORD_TYPES:
                # UCE/HCCL after ClusterD closed the stream: its fault centre, not the
                # reset, decides, and a report now would only refresh a record it still
                # holds (refault.py re-reports them once it does not). After a lost or
                # frozen stream ClusterD may have restarted and forgotten its records:
                # reported at once, as any fault.
                return
            log.warning("re-reporting %d fault rank(s) on the new stream: ClusterD forgot them",
                        len(self.flow_faults))
            self.outbox.submit_faults(dict(self.flow_faults))
            return
        self.resume.on_subscribed(self.flow_faults)


def _answer(report: Taken, code: int) -> None:
    if report.waiter is not None and not report.waiter.done():
        report.waiter.set_result(code)


#: callback name -> its handler: the one place each callback is handled.
REPORT_HANDLERS: dict[str, Callable[[ReportPath, Taken], None]] = {
    "report_fault_ranks": ReportPath.fault_ranks,
    "report_stop_complete": ReportPath.stop_complete,
    "report_strategies": ReportPath.strategies,
    "report_result": ReportPath.result,
}
