"""A retry cycle ClusterD repeats after it succeeded, told apart from a new failure.

``RepeatedCycles``, on the event loop: a cycle is a repeat when ClusterD, not the
controller, starts it (``stop_train`` while the controller's flow is idle), naming only
ranks of a retry that succeeded within ``WINDOW`` seconds, with no controller fault
since (the fault centre of ClusterD v7.3.2 and its kin, docs/releases.md). Such a cycle
is counted in ``tft_bridge_recovery_repeated_cycles_total`` and its result gets the
outcome ``repeat_after_success``, not ``failed``. Signals are forwarded unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from bridge.job.metrics import BridgeMetrics

log = logging.getLogger(__name__)

#: The outcome label of a repeated cycle's result (metrics and flight record).
REPEAT_OUTCOME = "repeat_after_success"
#: How long after a successful retry a ClusterD-started cycle on the same ranks counts as
#: its repeat: v7.3.2 starts it 0.7 s / 4 s after the first cycle ended, plus the
#: re-subscription; a genuine new fault on those ranks is reported by the controller
#: first, which ends the window at once.
WINDOW = 30.0


class RepeatedCycles:
    """The last successful retry, and whether the running cycle repeats it."""

    def __init__(self, metrics: BridgeMetrics, clock: Callable[[], float] = time.monotonic, *,
                 on_repeat: Callable[[], None] = lambda: None) -> None:
        """``on_repeat``: the flight recorder's mark of a repeated cycle."""
        self.metrics = metrics
        self._clock = clock
        self._succeeded: frozenset[int] = frozenset()
        self._succeeded_at = 0.0
        self.repeating = False  # the running cycle repeats a retry that succeeded
        self._on_repeat = on_repeat

    def retry_succeeded(self, ranks: Mapping[int, int]) -> None:
        """The controller reported a retry's success for these ranks."""
        self._succeeded, self._succeeded_at = frozenset(ranks), self._clock()
        self.repeating = False

    def controller_fault(self) -> None:
        """The controller reported a fault with its flow idle: a new fault, no repeat."""
        self._succeeded = frozenset()
        self.repeating = False

    def cycle_ended(self) -> None:
        """ClusterD's exit decision or a final result ended the running cycle."""
        self.repeating = False

    def clusterd_stop(self, ranks: Mapping[int, int]) -> bool:
        """ClusterD starts a cycle (stop_train with the controller idle); True when it
        repeats the retry that just succeeded."""
        if not self._succeeded or not ranks or not set(ranks) <= self._succeeded:
            return False
        since = self._clock() - self._succeeded_at
        if since > WINDOW:
            return False
        self.repeating = True
        self._succeeded = frozenset()  # one repeat per success
        self.metrics.recovery_repeats.inc()
        log.warning("ClusterD starts another cycle for ranks %s %.1f s after their retry succeeded, with no new "
                    "fault from the controller: a repeated cycle (ClusterD v7.3.2's fault centre keeps the "
                    "repaired fault). The controller will likely fail it (499 notify device stop failed) and "
                    "ClusterD mark retry-failed; the repair itself had worked", sorted(ranks)[:16], since)
        self._on_repeat()
        return True

    def outcome(self, code: int) -> str | None:
        """The outcome label of a result in the running cycle, when it is a repeat's."""
        return REPEAT_OUTCOME if self.repeating and code not in (0, 201) else None
