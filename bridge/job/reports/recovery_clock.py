"""The recovery clock: the phase timings of one controller fault flow.

``RecoveryClock`` is fed by the report bookkeeping (``bridge.job.reports.ledger``) with the
controller's own callback times, for ``tft_bridge_recovery_phase_duration_seconds``,
``tft_bridge_recovery_duration_seconds`` and ``tft_bridge_recovery_cycles_total``. Event
loop only.
"""

from __future__ import annotations

from bridge.job.reports.controller_flow import STRATEGIES
from bridge.job.metrics import BridgeMetrics


class RecoveryClock:
    """Phase timings of one controller fault flow, for the duration histograms."""

    def __init__(self, metrics: BridgeMetrics) -> None:
        self.metrics = metrics
        self.started: float | None = None
        self.stopped: float | None = None
        self.offered: float | None = None

    def fault(self, at: float) -> None:
        if self.started is None:
            self.started = at

    def stop_complete(self, at: float) -> None:
        if self.started is not None and self.stopped is None:
            self.metrics.recovery_phase_seconds.labels("fault_to_stop").observe(at - self.started)
            self.stopped = at

    def strategies(self, at: float) -> None:
        if self.stopped is not None and self.offered is None:
            self.metrics.recovery_phase_seconds.labels("stop_to_strategy").observe(at - self.stopped)
            self.offered = at

    def exited(self, at: float) -> None:
        """ClusterD chose exit: the controller goes down and reports no result."""
        self.metrics.recovery_cycles.labels("exit", "exit").inc()
        if self.started is not None:
            self.metrics.recovery_seconds.labels("exit").observe(at - self.started)
        self.started = self.stopped = self.offered = None

    def result(self, at: float, strategy: str, code: int, outcome: str | None = None) -> None:
        """``outcome``: a label that overrides the code's (a repeated cycle, ``repeated_cycles``)."""
        label = strategy if strategy in STRATEGIES else "other"
        outcome = outcome or ("success" if code == 0 else "isolated" if code == 201 else "failed")
        self.metrics.recovery_cycles.labels(label, outcome).inc()
        if self.offered is not None:
            self.metrics.recovery_phase_seconds.labels("strategy_to_result").observe(at - self.offered)
        if self.started is not None:
            self.metrics.recovery_seconds.labels(label).observe(at - self.started)
        if code in (0, 201):
            self.started = self.stopped = self.offered = None
        else:  # a failed strategy: the flow goes on with the next one
            self.offered = None
