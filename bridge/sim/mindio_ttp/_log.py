"""The observation log: everything the stub saw, in order, with monotonic timestamps.

Tests and benchmarks assert on this log instead of on private state, so a record says
what crossed the boundary between the bridge and the controller: a callback invocation
(with the exact arguments), a notify call (with its arguments and return value), a state
change, or something the stub noted (an unexpected event, a timeout, a violation).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

#: Record kinds.
CALLBACK: Final = "callback"  # a callback was invoked (logged before it runs)
CALLBACK_ERROR: Final = "callback_error"  # it raised an Exception (the controller saw 1)
NOTIFY: Final = "notify"  # a tft_notify_controller_* call, with its return value
API: Final = "api"  # init / start / destroy / register / query
STATE: Final = "state"  # the state machine entered a state
TRAINING: Final = "training"  # connect, disconnect, fault, step (the training side)
NOTE: Final = "note"  # what the controller would log: unexpected event, timeout, exit reason
VIOLATION: Final = "violation"  # something the real controller punishes with a hang or abort


@dataclass(frozen=True, slots=True)
class Record:
    """One observation. ``result`` is the return value for notify/api records and the
    exception ``repr`` for callback errors."""

    t: float
    kind: str
    name: str
    args: tuple[Any, ...] = ()
    result: Any = None
    thread: str = field(default="")

    def __repr__(self) -> str:
        res = "" if self.result is None else f" -> {self.result!r}"
        return f"<{self.t:.3f} {self.kind} {self.name}{self.args!r}{res} [{self.thread}]>"


def make_record(kind: str, name: str, args: tuple[Any, ...] = (), result: Any = None) -> Record:
    """A record stamped now, on the calling thread."""
    return Record(time.monotonic(), kind, name, args, result, threading.current_thread().name)
