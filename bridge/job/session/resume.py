"""Carrying a recovery across a ClusterD restart or freeze, unseen by the controller.

``CycleResume``, on the event loop, remembers the controller's answers in the running
flow (its stop-complete, its strategies). When a new stream comes up while the
controller is stopped for a cycle (``STOPPED``), ``on_subscribed`` reports the flow's
faults again; ``intercept`` answers the new cycle's stopTrain and globalFault with the
remembered answers (``RESUMED``) or rebinds the flow so the coming answer goes to the new
cycle; a strategies answer is narrowed to ``NO_REPAIR_STRATEGIES`` when the new
globalFault names ranks beyond those offered (``without_repair``: here for a remembered
answer, on the report wire for the controller's coming one, which ``strategies_sent``
then counts); ``outcome_unknown`` subscribes again when a report's outcome is unknown.
Past ``PAST_RESUME`` nothing is carried over. Counted in
``tft_bridge_cycle_resumes_total{result}``. The cases and the peer facts:
docs/clusterd.md section 14.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable

from bridge import faults as codec
from bridge.job.cycle_state import Rebound
from bridge.job.reports.controller_flow import ControllerFlow, Step
from bridge.job.metrics import BridgeMetrics
from bridge.job.reports.kinds import Outbox

log = logging.getLogger(__name__)

#: The controller has stopped training for a cycle and waits for ClusterD's next step.
STOPPED = frozenset({Step.STOP_SENT, Step.AWAIT_GLOBAL, Step.GLOBAL_SENT, Step.AWAIT_STRATEGY})
#: The controller has been told a strategy (or to dump): a new cycle cannot catch up.
PAST_RESUME = frozenset({Step.REPAIRING, Step.AWAIT_FINAL, Step.DUMPING})
#: Steps at which a stop_train notify is forwarded (a new flow's faults come from it).
_STOP_ACCEPTED = frozenset({Step.IDLE, Step.AWAIT_STOP, Step.PAUSED})
#: ``CycleResume.intercept``: the action was answered by the bridge, not the controller.
RESUMED = "resumed"
#: The controller's strategies that repair no rank: what a resumed cycle naming ranks
#: beyond the controller's is offered (the controller's list always starts with exit).
NO_REPAIR_STRATEGIES = ("exit", "dump")


def without_repair(named: Iterable[int], faults: Collection[int],
                   strategies: list[str]) -> tuple[list[str], frozenset[int]]:
    """The strategies to offer a cycle whose globalFault named the ranks ``named``, for
    the controller's ``strategies`` offered for the ranks ``faults``, and the named ranks
    beyond ``faults``: when there are none, ``strategies`` as they are; otherwise only
    those that repair no rank (``exit`` when the controller offered neither), since a
    repair of fewer ranks than ClusterD restarts never completes (module docstring).
    Pure: any thread (the report wire's, the loop's)."""
    beyond = frozenset(rank for rank in named if rank not in faults)
    if not beyond:
        return strategies, beyond
    return [name for name in strategies if name in NO_REPAIR_STRATEGIES] or ["exit"], beyond


class CycleResume:
    """Remembers the controller's answers of the running flow and replays them to a new
    ClusterD cycle. Runs on the event loop only (never on the controller's thread)."""

    def __init__(self, job_id: str, flow: ControllerFlow, outbox: Outbox, metrics: BridgeMetrics, *,
                 resubscribe: Callable[[str], None], publish: Callable[[Rebound | None], None]) -> None:
        """``resubscribe(reason)``: re-run Init/Register/Subscribe (``CycleState``).
        ``publish(rebound)``: the wire's snapshot of the loop's state is out of date
        (``flow.answering`` or ``rebound_global`` changed here: the wire binds the
        controller's next answer to the one and narrows a strategies report of the other,
        ``CycleState.rebound_changed``)."""
        self.job_id = job_id
        self.flow = flow
        self.outbox = outbox
        self.metrics = metrics
        self._resubscribe = resubscribe
        self._publish = publish
        #: None, "stop" (the new cycle's stopTrain is awaited) or "global" (its globalFault).
        self.pending: str | None = None
        self.stop_faults: dict[int, int] = {}  # ranks of the stop_train notify that started the flow
        # True from a ClusterD-first stop until the controller reports this flow's faults:
        # the return path's flow faults are then still the previous flow's.
        self.flow_faults_stale = False
        self.stop_report: tuple[int, str, dict[int, int]] | None = None  # the controller's stop-complete
        self.strategies_report: tuple[dict[int, int], list[str]] | None = None  # its report_strategies
        # A new cycle's globalFault rebound to the controller's coming report_strategies
        # (GLOBAL_SENT): its token and the ranks it names. Published with
        # ``flow.answering``: the wire narrows that answer as it takes it
        # (``Cycles.rebound``); cleared when the loop hears of it (``strategies_sent``).
        self.rebound_global: Rebound | None = None

    # ------------------------------------------------------------------ from the return path
    def new_flow(self) -> None:
        """A fault flow starts (the controller reported its faults): nothing of the
        previous one may be replayed."""
        self.stop_report = self.strategies_report = self.rebound_global = None
        self.flow_faults_stale = False
        self._publish(self.rebound_global)

    # The maps are the return path's own cleaned copies, never changed after the report
    # is encoded: kept by reference (copying 100 000 ranks would cost the loop a few ms).
    def remember_stop(self, code: int, message: str, faults: dict[int, int]) -> None:
        self.stop_report = (code, message, faults)

    def remember_strategies(self, faults: dict[int, int], strategies: list[str]) -> None:
        self.strategies_report = (faults, strategies)

    def strategies_sent(self, cycle: str | None, offered: list[str], beyond: frozenset[int]) -> None:
        """The controller's strategies report for ``cycle`` as the wire took it: the rebound
        cycle is answered (cleared and published), and when the wire narrowed the report
        to ``offered`` for the named ranks ``beyond`` the controller's, that is counted
        and logged here. Decides nothing: the wire narrowed it from the publication it
        bound the report with (``relay.Wire._intake``)."""
        self._clear_rebound()
        if beyond:
            self._narrowed(cycle, beyond, offered)
            self._count("answered_without_repair")

    def _clear_rebound(self) -> None:
        """No cycle rebound any more: published (once) only when there was one."""
        if self.rebound_global is not None:
            self.rebound_global = None
            self._publish(None)

    def on_subscribed(self, flow_faults: dict[int, int]) -> None:
        """A new stream is live: ClusterD's job was reset. Restart the cycle the
        controller is stopped for, or say that it cannot be."""
        self.pending = None
        self._clear_rebound()  # its cycle ended with the stream: no answer is narrowed for it
        step = self.flow.step
        if step in PAST_RESUME:
            self._count("too_late")
            log.warning("ClusterD's job was reset (new subscription) while the controller is at %s: the new "
                        "ClusterD would restart the cycle at stopTrain, which the controller is already past; "
                        "not re-reporting (its result will be dropped as no_live_cycle)", step.value)
            return
        if step not in STOPPED:
            return
        faults = dict(self.stop_faults) if self.flow_faults_stale else dict(flow_faults) or dict(self.stop_faults)
        if not faults:
            log.error("ClusterD's job was reset while the controller is stopped at %s, but no fault rank of "
                      "the flow is known: cannot restart the cycle", step.value)
            return
        self.pending = "stop"
        self._count("re_reported")
        log.warning("ClusterD's job was reset (new subscription) while the controller is stopped at %s: "
                    "re-reporting %d fault rank(s) to start the cycle again; the new stopTrain will be "
                    "answered without stopping the controller twice", step.value, len(faults))
        self.outbox.submit_faults(faults)

    def outcome_unknown(self, kind: str) -> None:
        """The controller's stop-complete or strategies report may or may not have reached
        ClusterD (its deadline passed: a freeze, a broken connection). It is never resent
        (ClusterD's one-slot buffers), and if it was lost nothing ever shows it: ClusterD
        waits 15 minutes for it, the controller only ``MINDIO_WAIT_MINDX_TIME``. So while
        the controller is stopped, subscribe again on purpose: that resets ClusterD's job,
        and the new stream resumes the cycle (``on_subscribed``) from the answers kept
        here, whatever became of the lost one."""
        if kind not in ("stop_complete", "strategy") or self.flow.step not in STOPPED:
            return
        log.warning("the %s report's outcome is unknown while the controller is stopped at %s: re-subscribing "
                    "to restart the cycle on a clean slate rather than wait for an answer that may never come",
                    kind, self.flow.step.value)
        self._resubscribe("report_outcome_unknown")

    # ------------------------------------------------------------------ from the signal side
    def intercept(self, action: str, faults: dict[int, int], token: str) -> str | None:
        """What to do with ``action`` of a signal for cycle ``token``: None to let the
        dispatcher gate and forward it as usual, ``RESUMED`` when it was answered here
        and must not reach the controller, any other string: refuse it for that reason."""
        if self.pending is None:
            if action == "stop_train" and self.flow.step in _STOP_ACCEPTED:
                self.stop_faults = dict(faults)
                self.flow_faults_stale = self.flow.step is not Step.AWAIT_STOP  # ClusterD stopped first
            return None
        step = self.flow.step
        if self.pending == "stop" and action == "stop_train":
            return RESUMED if self._resume_stop(step, faults, token) else None
        if self.pending == "global" and action == "on_global_rank":
            return RESUMED if self._resume_global(step, faults, token) else None
        if self.pending == "stop" and action == "on_global_rank":
            # Not the new cycle's (which starts with stopTrain): the old cycle's globalFault
            # that a reset does not stop (docs/clusterd.md section 7). A strategy report in
            # answer would sit in ClusterD's slot and be consumed by the new cycle.
            log.warning("not forwarding on_global_rank (cycle %r) before the new cycle's stopTrain: the "
                        "reset cycle's late globalFault", token)
            return "unexpected_step"
        return None

    def _resume_stop(self, step: Step, faults: dict[int, int], token: str) -> bool:
        self.pending = None
        if step is Step.STOP_SENT:
            # The controller's own stop-complete is still to come: it answers this cycle.
            self.flow.answering = token
            self._publish(self.rebound_global)
            self._resumed("rebound", "stopTrain", token, "the controller's coming stop-complete answers it")
            return True
        if step not in STOPPED:
            return False  # the controller moved on meanwhile (e.g. its wait ran out): the gate decides
        if self.stop_report is None:
            log.error("cannot answer the new cycle's stopTrain (%s): the controller's stop-complete is not known",
                      token)
            return False
        extra = set(faults) - set(self.stop_report[2]) - set(self.stop_faults)
        if extra:
            log.warning("the new cycle's stopTrain names %d rank(s) the controller did not stop for (e.g. %s); "
                        "answering with the controller's stop-complete anyway (a second stop would kill the job)",
                        len(extra), sorted(extra)[:5])
        code, message, stopped = self.stop_report
        self.outbox.submit_cycle_report("stop_complete", token,
                                        codec.encode_stop_complete_request(self.job_id, code, message, stopped))
        if step is Step.AWAIT_GLOBAL:
            self.flow.answering = token
            self._publish(self.rebound_global)
        else:  # GLOBAL_SENT / AWAIT_STRATEGY: the new globalFault must not reach the controller either
            self.pending = "global"
        self._resumed("answered_stop_complete", "stopTrain", token, f"with code {code}")
        return True

    def _resume_global(self, step: Step, named: dict[int, int], token: str) -> bool:
        self.pending = None
        if step is Step.GLOBAL_SENT:
            self.rebound_global = Rebound(token, frozenset(named))  # published with the new answering cycle
            self.flow.answering = token
            self._publish(self.rebound_global)
            self._resumed("rebound", "globalFault", token, "the controller's coming report_strategies answers it")
            return True
        if step is not Step.AWAIT_STRATEGY or self.strategies_report is None:
            return False
        faults, strategies = self.strategies_report
        strategies, beyond = without_repair(named, faults, strategies)
        if beyond:
            self._narrowed(token, beyond, strategies)
        result = "answered_without_repair" if beyond else "answered_strategies"
        self.outbox.submit_cycle_report("strategy", token,
                                        codec.encode_recover_strategy_request(self.job_id, faults, strategies))
        self.flow.answering = token
        self._publish(self.rebound_global)
        self._resumed(result, "globalFault", token, f"with {strategies}")
        return True

    @staticmethod
    def _narrowed(token: str | None, beyond: frozenset[int], offered: list[str]) -> None:
        log.error("the new cycle's globalFault (%s) names %d rank(s) the controller did not offer its "
                  "strategies for (e.g. %s) and cannot be told of now: a repair would hang on them, so "
                  "the cycle is offered %s only", token, len(beyond), sorted(beyond)[:5], offered)

    def _resumed(self, result: str, signal_type: str, token: str, how: str) -> None:
        self._count(result)
        log.warning("resumed the recovery on ClusterD's new cycle %s: %s answered by the bridge (%s), "
                    "not forwarded to the controller, which already had it", token, signal_type, how)

    def _count(self, result: str) -> None:
        self.metrics.cycle_resumes.labels(result).inc()
