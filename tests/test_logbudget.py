"""The log budget (bridge/core/log_budget.py): bounded lines per kind, truthful about the rest."""

from __future__ import annotations

import threading

import pytest

from bridge.core.log_budget import LogBudget, suppressed_note


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_burst_lines_per_window_then_the_first_line_after_says_how_many_were_dropped() -> None:
    clock = Clock()
    budget = LogBudget(burst=3, window=10.0, clock=clock)
    assert [budget.allow("k") for _ in range(10)] == [0, 0, 0] + [None] * 7
    clock.now += 10.0  # the window itself is the behaviour under test: a fake clock, no sleep
    assert budget.allow("k") == 7
    assert budget.allow("k") == 0


def test_keys_have_budgets_of_their_own() -> None:
    budget = LogBudget(burst=1, window=60.0, clock=Clock())
    assert budget.allow("a") == 0 and budget.allow("a") is None
    assert budget.allow(("b", 1)) == 0


def test_the_key_table_is_bounded() -> None:
    budget = LogBudget(burst=1, window=60.0, clock=Clock(), max_keys=8)
    for key in range(10_000):
        budget.allow(key)
    assert len(budget._keys) == 8


def test_threads_never_get_more_than_the_burst() -> None:
    budget = LogBudget(burst=5, window=3600.0)
    allowed: list[int] = []

    def hammer() -> None:
        for _ in range(2_000):
            if budget.allow("k") is not None:
                allowed.append(1)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(allowed) == 5


@pytest.mark.parametrize("burst, window", [(0, 1.0), (1, 0.0), (1, float("nan"))])
def test_a_budget_that_allows_nothing_is_refused(burst: int, window: float) -> None:
    with pytest.raises(ValueError, match="burst"):
        LogBudget(burst=burst, window=window)


def test_the_note_is_empty_unless_lines_were_suppressed() -> None:
    assert suppressed_note(0) == ""
    assert "3 similar" in suppressed_note(3)
