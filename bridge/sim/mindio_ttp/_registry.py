"""The callback registry (the real ``MindxEngineHandler`` of ttp_mindx_api.py).

It survives tft_destroy_controller (only ``Training.reset`` clears it), holds one lock
around every callback invocation (so registering from inside a callback deadlocks in the
real library), swallows ``Exception`` into a return value of 1 and lets every other
``BaseException`` escape, because that is what aborts the real process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from bridge.sim.mindio_ttp._constants import ACTIONS

RET_OK = 0
RET_ERROR = 1


class CallbackRegistry:
    """action -> function, looked up at every call (re-registering takes effect at once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread ident holding the lock during a callback
        self._funcs: dict[str, Callable[..., Any]] = {}

    def register(self, action: str, func: object) -> int:
        """0 on success; 1 for an unknown action or a non-callable (nothing changes)."""
        with self._lock:
            if action not in ACTIONS or func is None or not callable(func):
                return RET_ERROR
            self._funcs[action] = func
            return RET_OK

    def held_by_current_thread(self) -> bool:
        """True inside a callback: registering now would deadlock the real library."""
        return self._owner == threading.get_ident()

    def all_registered(self) -> bool:
        """The check the controller makes once, while starting."""
        with self._lock:
            return len(self._funcs) == len(ACTIONS)

    def registered(self, action: str) -> Callable[..., Any] | None:
        """The function registered for ``action`` (tests and benchmarks call it as the
        controller's thread would), or None."""
        with self._lock:
            return self._funcs.get(action)

    def count(self) -> int:
        with self._lock:
            return len(self._funcs)

    def execute(self, action: str, args: tuple[Any, ...]) -> tuple[int, BaseException | None]:
        """Call the function for ``action``; ``(0, None)`` after a normal return whatever it
        returned, ``(1, exc)`` when it raised an Exception. Other BaseExceptions propagate."""
        with self._lock:
            self._owner = threading.get_ident()
            try:
                func = self._funcs.get(action)
                if func is None:
                    return RET_ERROR, None
                try:
                    func(*args)
                except Exception as exc:  # noqa: BLE001 - the trampoline's own ``except Exception``
                    return RET_ERROR, exc
                return RET_OK, None
            finally:
                self._owner = None

    def clear(self) -> None:
        with self._lock:
            self._funcs.clear()
