"""What a controller report is, and the names it travels under: the one definition.

A leaf module (it imports nothing of the bridge), so that every module of the report
path -- the callbacks (``controller.py``), the flow (``flow.py``), the metrics, the
bookkeeping (``reports.py``) and the report wire (``wire.py``) -- names the same four callbacks, report kinds and RPC paths without
importing each other.

The peer facts: the controller has exactly four report callbacks
(``tft_register_mindx_callback``, docs/mindio-controller.md), and each maps to one
unary RPC of ClusterD's ``Recover`` service (docs/clusterd.md); ClusterD answers every
one with a ``Status`` whose ``code`` decides delivery.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, NamedTuple, Protocol

#: The controller's four callbacks, in the order of one fault flow.
CALLBACKS = ("report_fault_ranks", "report_stop_complete", "report_strategies", "report_result")

#: callback -> the outbox's kind of report (the ``kind`` label of the report metrics).
KINDS: dict[str, str] = {
    "report_fault_ranks": "fault",
    "report_stop_complete": "stop_complete",
    "report_strategies": "strategy",
    "report_result": "result",
}

#: The report kinds, in the order of one fault flow.
REPORT_KINDS = tuple(KINDS[callback] for callback in CALLBACKS)

#: report kind -> ClusterD's RPC path.
METHODS: dict[str, str] = {
    "fault": "/Recover/ReportProcessFault",
    "stop_complete": "/Recover/ReportStopComplete",
    "strategy": "/Recover/ReportRecoverStrategy",
    "result": "/Recover/ReportRecoverStatus",
}

#: The four Report* RPC paths: the report path's, made over the report channel.
REPORT_METHODS = frozenset(METHODS.values())


class ControllerReport(NamedTuple):
    """One callback invocation, as handed to the event loop."""

    callback: str
    args: tuple[Any, ...]
    at: float  # time.monotonic() on the controller's thread
    waiter: Future[int] | None = None  # resolved with the delivery outcome (seed API callers)


#: A ControllerReport from its four fields, in one C call: NamedTuple's ``__new__`` is a
#: Python function, one more to run cold between a callback and the wire.
report_of: Callable[[tuple[Any, ...]], ControllerReport] = partial(tuple.__new__, ControllerReport)

#: What a callback puts into the report wire's inbox: a ControllerReport's fields as a plain
#: tuple (a ControllerReport itself is one too).
ReportFields = tuple[str, tuple[Any, ...], float, "Future[int] | None"]


class Outbox(Protocol):
    """Where the event loop's own reports go (``wire.Wire``): a re-report on a new stream,
    the resume's answers, the seed API's. Both calls return at once."""

    def submit_faults(self, faults: dict[int, int], waiter: Future[int] | None = None) -> None: ...

    def submit_cycle_report(self, kind: str, cycle: str | None, payload: bytes,
                            waiter: Future[int] | None = None) -> None: ...


def status_code(value: Any) -> int:
    """A callback's status code; a TypeError for anything but an int (the controller's
    SWIG layer passes ints; a bool is a caller's mistake)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"status code must be an int, got {value!r}")
    return value
