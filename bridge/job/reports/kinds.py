"""What a controller report is, and the names it travels under: the one definition.

A leaf module (it imports nothing of the bridge): the callbacks (``host/controller.py``),
the flow (``controller_flow.py``), the metrics, the bookkeeping (``ledger.py``) and the
report wire (``relay.py``) name the same four callbacks, report kinds, RPC paths and
report record (``ControllerReport``) without importing each other.

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
    """One controller report, its arguments named once: by the report wire as it takes a
    controller callback's ``Callback`` (``report_of``, the only place they are read by
    position), or where the seed API and ``report-fault`` make one. Carried unchanged
    to the event loop.

    The values are as the caller gave them: the wire cleans the fault map
    (``faults.clean_faults``), checks the code (``status_code``) and the strategies."""

    callback: str  # one of CALLBACKS
    at: float  # time.monotonic() on the caller's thread
    faults: Any  # the fault map ({rank: fault type}); {} when the callback gave none
    code: Any  # report_stop_complete, report_result: the status code; None otherwise
    message: Any  # their message; "" otherwise
    strategies: Any  # report_strategies: the strategy list; () otherwise
    strategy: Any  # report_result: the strategy that ran ("" when not given)
    waiter: Future[int] | None  # resolved with the delivery outcome (seed API callers)
    problem: str  # why the arguments do not fit the callback ("": they do)


#: What a controller callback puts into the wire's inbox: its name, its positional
#: arguments and ``time.monotonic()`` on the controller's thread, named by the wire.
Callback = tuple[str, tuple[Any, ...], float]

#: A ControllerReport from its nine fields as one tuple, in C (NamedTuple's ``__new__``
#: is a Python function).
record: Callable[[tuple[Any, ...]], ControllerReport] = partial(tuple.__new__, ControllerReport)

#: What each callback takes, for the message of a call that does not fit it.
SIGNATURES: dict[str, str] = {
    "report_fault_ranks": "(fault_ranks[, fault_codes])",
    "report_stop_complete": "(code, msg[, fault_ranks])",
    "report_strategies": "(fault_ranks, strategy_list)",
    "report_result": "(code, msg[, fault_ranks[, strategy]])",
}


#: Where a report enters the report path: the wire's inbox (``relay.ReportInbox.put``).
#: Any thread; never blocks.
ReportSink = Callable[[ControllerReport | Callback], None]


def misfit(callback: str, args: tuple[Any, ...], at: float, waiter: Future[int] | None = None) -> ControllerReport:
    """The report of a call whose arguments do not fit ``callback`` (never raises)."""
    problem = f"{callback} takes {SIGNATURES.get(callback, '?')}, got {len(args)} argument(s)"
    return record((callback, at, {}, None, "", (), "", waiter, problem))


def report_of(callback: str, args: tuple[Any, ...], at: float, waiter: Future[int] | None = None) -> ControllerReport:
    """``callback``'s positional arguments, named (never raises): on the report wire's
    thread for the controller's callbacks, on their own for the seed API and
    ``report-fault``."""
    n = len(args)
    if callback == "report_fault_ranks" and n >= 1:
        return record((callback, at, args[0], None, "", (), "", waiter, ""))
    if callback == "report_stop_complete" and n >= 2:
        return record((callback, at, args[2] if n > 2 else {}, args[0], args[1], (), "", waiter, ""))
    if callback == "report_strategies" and n >= 2:
        return record((callback, at, args[0], None, "", args[1], "", waiter, ""))
    if callback == "report_result" and n >= 2:
        return record((callback, at, args[2] if n > 2 else {}, args[0], args[1], (), args[3] if n > 3 else "",
                       waiter, ""))
    return misfit(callback, args, at, waiter)


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
