"""A log budget: at most ``burst`` lines per key per ``window`` seconds, the rest summed up.

A peer decides how often an event happens; the budget decides how much log it costs
(docs/architecture.md, invariants). Keys are a refusal reason, a (callback, step) pair:
small fixed sets, and the table is bounded anyway (``max_keys``, oldest out). The first
line after a suppressed stretch says how many were suppressed. Metrics still count every
event; only log lines are budgeted. Thread-safe (one lock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable


class LogBudget:
    """Decides whether one more log line of a kind may be written now.

    Thread-safe: ``controller_flow`` asks from whichever thread follows a callback,
    ``signals`` from the event loop. ``allow`` is O(1) and never raises."""

    def __init__(self, burst: int = 5, window: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 256) -> None:
        if burst < 1 or not window > 0:
            raise ValueError(f"a log budget needs burst >= 1 and window > 0, got burst={burst}, window={window}")
        self.burst = burst
        self.window = window
        self._clock = clock
        self._max_keys = max_keys
        self._lock = threading.Lock()
        # key -> [window start, lines written in it, lines suppressed since the last one written]
        self._keys: dict[Hashable, list[float]] = {}

    def allow(self, key: Hashable) -> int | None:
        """None: do not log this one. An int: log it, and that many were suppressed
        since the last line of this key (say so in the line when it is not 0)."""
        now = self._clock()
        with self._lock:
            entry = self._keys.get(key)
            if entry is None:
                if len(self._keys) >= self._max_keys:
                    del self._keys[next(iter(self._keys))]
                entry = self._keys[key] = [now, 0.0, 0.0]
            if now - entry[0] >= self.window:
                entry[0], entry[1] = now, 0.0
            if entry[1] >= self.burst:
                entry[2] += 1
                return None
            entry[1] += 1
            suppressed, entry[2] = int(entry[2]), 0.0
            return suppressed


def suppressed_note(suppressed: int) -> str:
    """The tail of a budgeted line: empty, or how many like it were not written."""
    return f" [{suppressed} similar line(s) suppressed]" if suppressed else ""
