"""Telling a retry cycle ClusterD repeats after its success from a new failure
(bridge/job/session/repeated_cycles.py): ClusterD v7.3.2's fault centre keeps the repaired UCE/HCCL fault and
starts a second cycle for it; the controller fails that one with 499."""

from __future__ import annotations

from bridge.job.metrics import BridgeMetrics
from bridge.job.session.repeated_cycles import REPEAT_OUTCOME, WINDOW, RepeatedCycles


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch() -> tuple[RepeatedCycles, BridgeMetrics, Clock]:
    metrics, clock = BridgeMetrics(), Clock()
    return RepeatedCycles(metrics, clock), metrics, clock


def repeats(metrics: BridgeMetrics) -> float:
    return metrics.sample("tft_bridge_recovery_repeated_cycles_total")


def test_clusterd_starting_a_cycle_on_the_ranks_that_just_succeeded_is_a_repeat() -> None:
    metrics, clock = BridgeMetrics(), Clock()
    marked: list[bool] = []
    cycles = RepeatedCycles(metrics, clock, on_repeat=lambda: marked.append(True))
    cycles.retry_succeeded({5: 0, 6: 0})
    clock.now += 0.7
    assert cycles.clusterd_stop({5: 0})
    assert cycles.outcome(499) == REPEAT_OUTCOME and cycles.outcome(0) is None
    assert repeats(metrics) == 1 and marked == [True]
    cycles.cycle_ended()
    assert cycles.outcome(499) is None


def test_one_repeat_per_success() -> None:
    cycles, metrics, _ = watch()
    cycles.retry_succeeded({5: 0})
    assert cycles.clusterd_stop({5: 0})
    cycles.cycle_ended()
    assert not cycles.clusterd_stop({5: 0})
    assert repeats(metrics) == 1


def test_a_new_fault_from_the_controller_ends_the_window() -> None:
    cycles, metrics, _ = watch()
    cycles.retry_succeeded({5: 0})
    cycles.controller_fault()
    assert not cycles.clusterd_stop({5: 0})
    assert cycles.outcome(499) is None and repeats(metrics) == 0


def test_other_ranks_or_a_late_cycle_are_no_repeat() -> None:
    cycles, metrics, clock = watch()
    cycles.retry_succeeded({5: 0})
    assert not cycles.clusterd_stop({5: 0, 9: 1})  # a rank that was not retried
    assert not cycles.clusterd_stop({})
    clock.now += WINDOW + 0.1
    assert not cycles.clusterd_stop({5: 0})
    assert repeats(metrics) == 0


def test_no_success_no_repeat() -> None:
    cycles, metrics, _ = watch()
    assert not cycles.clusterd_stop({5: 0})
    assert repeats(metrics) == 0
