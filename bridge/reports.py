"""The return path: the controller's four callbacks -> ClusterD's Report* RPCs.

``signals.py`` carries ClusterD -> controller; this module carries the other way, from
the moment a callback's arguments leave the controller's thread to the moment a report
is queued in the outbox (``relay.py``). The split is between *what* a report is and
*how* it is delivered: here, which cycle a report answers, what the controller's flow
and the recovery clock learn from it, and what a bad argument costs; in ``relay.py``,
the rules the real ClusterD forces on delivery (order, merging, retry, drop when the
cycle died), which hold whatever report produced the request.

The peer facts behind the rules here:

* The controller calls a callback on its own C++ state-machine thread and is blocked
  until it returns; an exception kills the job. So the callback only queues a tuple
  (``controller.make_callback``) and wakes the event loop (``Handoff``), which does
  everything else (validation, copying, encoding) -- but for a report that comes while
  the outbox is idle, which the hand-off thread encodes and sends before the loop's
  bookkeeping (``fastlane.py``).
* A stop-complete, strategy or result report answers the cycle whose notify the
  controller last accepted (``ControllerFlow.answering``); it is bound to that cycle's
  uuid *before* the flow moves on, so a late report can never answer the next cycle.
* ClusterD's rank parser empties a whole fault map for one bad rank: bad entries are
  left out (``faults.clean_faults``), counted in ``tft_bridge_bad_inputs_total`` and
  logged; the rest still goes out. A malformed callback never raises into the loop.
* Every subscription resets ClusterD's job, fault cache included: when a new stream
  opens while the controller still waits for stop_train, the running flow's faults
  are reported again (``ReportPath.on_session_state``); when it opens while the
  controller is stopped for a cycle, ``resume.CycleResume`` restarts that cycle with the
  answers remembered here (stop-complete, strategies).

Seams for later work: every callback enters through ``ReportPath.handle`` -> one entry
of ``REPORT_HANDLERS``; every report leaves through ``Relay.submit_faults`` or
``Relay.submit_cycle_report``, whose RPC outcome ``relay.py`` knows in one place.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from . import faults as codec
from . import realtime
from .affinity import ControllerPin
from .clusterd import SessionState
from .codes import Code
from .flow import STRATEGIES, ControllerFlow, Step
from .metrics import BridgeMetrics
from .recorder import NullRecorder
from .relay import Relay
from .repeats import RepeatedCycles
from .rpcthread import Call
from .resume import CycleResume

if TYPE_CHECKING:
    from .fastlane import ReportLane

log = logging.getLogger(__name__)


class ControllerReport(NamedTuple):
    """One callback invocation, as handed to the event loop."""

    callback: str
    args: tuple[Any, ...]
    at: float  # time.monotonic() on the controller's thread
    waiter: Future[int] | None = None  # resolved with the delivery outcome (seed API callers)
    # The report thread's call, when the hand-off thread already queued this report
    # there (bridge/fastlane.py); None for every other report.
    presend: Call | None = None


#: A ControllerReport from its five fields, in one C call: NamedTuple's ``__new__`` is a
#: Python function, one more to run cold between a callback and the wire.
report_of: Callable[[tuple[Any, ...]], ControllerReport] = partial(tuple.__new__, ControllerReport)


# What a callback puts on the hand-off queue: a ControllerReport's fields as a plain
# tuple (a ControllerReport itself is one too).
ReportFields = tuple[str, tuple[Any, ...], float, "Future[int] | None"]


#: How the controller's callbacks reach the event loop (``Handoff(mode=...)``).
WAKE = "wake"  # the callback wakes the loop itself (opt-in: controller.handoff)
THREAD = "thread"  # via a SCHED_BATCH hand-off thread (the default)


class Handoff:
    """Controller thread -> event loop, never releasing the GIL inside the callback.

    Two ways, chosen by ``mode``; both deliver in callback order, in batches, to
    ``handle`` on the loop, and neither raises into the callback.

    ``THREAD`` is the default (``controller.handoff``): measured on a quiet 2-core node
    with ``bench/bench_relay.py``, WAKE's wake-up costs the controller's thread itself
    (the woken loop preempts it, the very effect SCHED_BATCH keeps off the THREAD
    hand-off): callback block p50 19-40 us and p99 33-77 us, over the 50 us target at
    10 000 and 100 000 ranks, against THREAD's p50 7-17 us and p99 16-45 us. Under CPU
    load WAKE reached the loop far sooner, so a node whose cores are busy may choose it
    (``bench/bench_relay.py --handoff wake`` measures it).

    ``WAKE``: the callback appends the tuple to a deque and, unless a wake-up
    is already pending, writes to an eventfd the loop watches. The write is made through
    a ctypes ``PyDLL`` function, which keeps the GIL: ``os.write`` and
    ``call_soon_threadsafe`` release it around the syscall, and the woken loop could
    then take the GIL and keep the controller's thread waiting up to the switch
    interval (5 ms) to get it back. One thread wake-up per burst of reports, and the
    woken thread is the loop itself under the normal policy: measured under CPU load, the
    report path crossing controller thread -> hand-off thread -> loop, each wake-up
    costing a scheduling delay on busy cores, the SCHED_BATCH hand-off thread the
    worst of them (it waits for the running task's slice to end rather than
    preempting: 8-185 ms callback -> ClusterD on a loaded node, against 1 ms for the
    synchronous client). WAKE hands batches to the loop only: it has no report lane.

    ``THREAD``: a ``SimpleQueue.put`` (a C call that keeps the GIL) wakes a hand-off
    thread blocked in ``get``, which calls ``call_soon_threadsafe`` once the callback has
    returned. That thread runs as ``SCHED_BATCH``: under the normal policy Linux often
    preempted the controller's thread at the put to run it, doubling the callback's
    median block time. It is the one thread of the report path that is *not* realtime
    (``realtime.py``): Linux puts a woken realtime thread on the CPU it last ran on,
    whatever runs there, so it preempted the controller's thread at the put, which then
    had to wait behind the busy processes for its CPU back while holding the GIL (block
    p99 0.05-3.6 ms against 8-12 us as SCHED_BATCH, bench_loaded A/B at one and two busy
    processes). Also the fall back where WAKE is unavailable (no eventfd/ctypes).
    With ``lane`` (``bridge/fastlane.py``) this thread may send a batch's report to
    ClusterD itself first (running ``SCHED_FIFO`` for the call), and posts the batch to
    the loop once no callback is left to dispatch (``ReportLane.release``).
    With ``pin_cpu`` the thread, after each batch, moves to the CPU the controller's
    thread is pinned to by its first callback (``bridge/affinity.py``): woken there, it
    runs as soon as the controller's thread goes back to waiting instead of behind a
    busy process on another CPU.
    """

    _STOP = object()

    def __init__(self, loop: asyncio.AbstractEventLoop, handle: Callable[[list[ControllerReport]], None],
                 mode: str = THREAD, *, pin_cpu: bool = True, lane: ReportLane | None = None) -> None:
        self._loop = loop
        self.lane = lane  # THREAD mode: a fault report may go straight to the report thread
        self.pin: ControllerPin | None = None  # THREAD mode: the controller's thread and this one on one CPU
        self._handle = handle
        self.batch_policy = False  # True once the hand-off thread (THREAD mode) runs under SCHED_BATCH
        self._thread: threading.Thread | None = None
        self._closed = False
        self._fd = -1
        self._write = _gil_holding_write() if mode == WAKE else None
        if mode == WAKE and self._write is None:
            log.warning("no GIL-holding write available: the controller hand-off falls back to a thread")
        if mode == WAKE and self._write is not None:
            self.mode = WAKE
            self._pending: collections.deque[object] = collections.deque()
            self._armed = False  # a wake-up is written and not yet read by the loop
            self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            loop.add_reader(self._fd, self._drain)
            self.put: Callable[[ReportFields], None] = self._put_and_wake
            return
        self.mode = THREAD
        self.pin = ControllerPin(pin_cpu)
        if lane is not None:
            lane.deliver = self._handle_posted  # what the loop runs on a batch it takes from the lane
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        # The callbacks' sink: the C method itself, no Python frame on the controller's thread.
        self.put = self._queue.put
        self._thread = threading.Thread(target=self._run, name="tft-handoff", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ WAKE mode
    def _put_and_wake(self, item: ReportFields) -> None:
        """On the controller's thread: O(1), never releases the GIL, never raises on a
        closed hand-off (the write then goes to fd -1 and fails harmlessly)."""
        self._pending.append(item)
        if not self._armed:
            self._armed = True
            self._write(self._fd, _ONE, 8)  # type: ignore[misc]

    def _drain(self) -> None:
        """On the loop: everything put so far, in order. The eventfd is read *before*
        the flag is cleared and the deque is drained *after*: a put that saw the flag set
        appended before the flag was cleared, so this drain takes it; a put after the
        clear writes a new wake-up."""
        try:
            os.eventfd_read(self._fd)
        except (BlockingIOError, OSError):
            pass
        self._armed = False
        pending = self._pending
        batch: list[object] = []
        while pending:
            batch.append(pending.popleft())
        if batch:
            self._deliver(batch)

    def _deliver(self, batch: list[object]) -> None:
        reports: list[ControllerReport] = []
        for item in batch:  # one malformed item costs itself, never its neighbours
            try:
                reports.append(_as_report(item))
            except (TypeError, ValueError):
                log.error("dropped a controller report that is not a report tuple: %.200r", item)
        if reports:
            self._handle(reports)

    # ------------------------------------------------------------------ THREAD mode
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:  # noqa: BLE001 - the bridge's supervisor sees the thread end; this says why
            log.exception("the controller hand-off thread failed")

    def _serve(self) -> None:
        self.batch_policy = realtime.batch_policy()
        pin = self.pin
        assert pin is not None
        # Between the controller's callback and the lane's call: no exception for the
        # empty queue and no generator, only C calls where a Python frame is not needed.
        get, empty = self._queue.get, self._queue.empty
        while True:
            batch = [get()]
            while not empty():
                batch.append(get())  # the only consumer: it is not empty until this thread takes it
            stop = False
            reports = []
            for item in batch:  # a loop, not a comprehension: no function of its own to run cold
                if item is self._STOP:
                    stop = True
                else:
                    reports.append(_as_report(item))
            if reports:
                try:
                    if self.lane is not None:  # led by a report the lane may take, it may go to ClusterD first
                        self.lane.dispatch(reports, self._post)
                    else:
                        self._post(reports)
                except RuntimeError:  # the loop is closed: the bridge is gone
                    log.error("dropped %d controller report(s): the event loop is closed", len(reports))
            if self.lane is not None and (stop or self._queue.empty()):
                # Callbacks that came during the lane's call are dispatched first: one
                # chained to it goes out now, from this thread (fastlane.py).
                self.lane.release()
            if stop:
                return
            pin.follow()  # after the batch is on its way: a migration never delays it

    def _post(self, reports: list[ControllerReport]) -> None:
        self._loop.call_soon_threadsafe(self._handle_posted, reports)

    def _handle_posted(self, reports: list[ControllerReport]) -> None:
        """On the loop: one batch from the hand-off thread; the lane learns it is handled
        (its reports are in the outbox) whatever happens. A batch the lane's ``flush``
        handled before this run came is not handled twice."""
        if self.lane is not None and not self.lane.claim(reports):
            return
        try:
            self._handle(reports)
        finally:
            if self.lane is not None:
                self.lane.handled()

    # ------------------------------------------------------------------ both
    def close(self, timeout: float = 2.0) -> None:
        """Deliver what was put, then stop; callable from any thread."""
        if self._thread is not None:
            self._queue.put(self._STOP)
            self._thread.join(timeout)
            if self.pin is not None:
                self.pin.release()
            return
        if self._closed:
            return
        done = threading.Event()

        def finish() -> None:
            try:
                self._drain()
            finally:
                self._shut()
                done.set()

        if _on_loop_thread(self._loop):
            finish()
            return
        try:
            self._loop.call_soon_threadsafe(finish)
        except RuntimeError:  # the loop is closed: nothing can be delivered any more
            self._shut()
            return
        done.wait(timeout)

    def _shut(self) -> None:
        if self._closed:
            return
        self._closed = True
        fd, self._fd = self._fd, -1  # under the GIL: a put from now on writes to -1
        try:
            self._loop.remove_reader(fd)
        except (RuntimeError, ValueError):
            pass
        os.close(fd)

    @property
    def alive(self) -> bool:
        if self._thread is not None:
            return self._thread.is_alive()
        return not self._closed


def _as_report(item: object) -> ControllerReport:
    """A callback's 4-tuple (or the seed API's whole ControllerReport) as a report; a
    TypeError for anything else."""
    if type(item) is ControllerReport:
        return item
    if type(item) is tuple and len(item) == 4:  # a callback's fields, the common case: one C call
        return report_of((*item, None))
    return ControllerReport._make((*item, None))  # type: ignore[misc]  # raises for anything but 4 fields


_ONE = (1).to_bytes(8, sys.byteorder)  # an eventfd write: one 8-byte counter increment


def _gil_holding_write() -> Callable[[int, bytes, int], int] | None:
    """libc ``write`` called without releasing the GIL (ctypes ``PyDLL``); None where
    unavailable (no eventfd or no libc), which selects the THREAD hand-off."""
    if not hasattr(os, "eventfd"):
        return None
    try:
        import ctypes

        write = ctypes.PyDLL(None).write
    except (ImportError, OSError, AttributeError):
        return None
    write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    return write  # type: ignore[no-any-return]


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


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
        """``outcome``: a label that overrides the code's (a repeated cycle, repeats.py)."""
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


class ReportPath:
    """The controller's reports, on the event loop: validate, tell the flow and the
    clock, bind to a cycle, encode, queue in the outbox."""

    def __init__(self, job_id: str, flow: ControllerFlow, relay: Relay, metrics: BridgeMetrics,
                 observer: Callable[[str], None] | None = None) -> None:
        self.job_id = job_id
        self.flow = flow
        self.relay = relay
        self.metrics = metrics
        self.clock = RecoveryClock(metrics)
        self.repeats = RepeatedCycles(metrics)  # a retry cycle ClusterD repeats after its success
        self.observer: Callable[[str], None] = observer or (lambda line: None)
        self._observed = observer is not None  # formatting a 100 000-rank timeline line costs ms
        self.flow_faults: dict[int, int] = {}  # the controller's faults in the running flow
        self.recorder: NullRecorder = NullRecorder()  # the flight recorder (bridge/recorder/): O(1) hooks
        # Remembers this flow's answers, to carry the recovery across a ClusterD restart (resume.py).
        self.resume = CycleResume(job_id, flow, relay, metrics)

    # ------------------------------------------------------------------ intake
    def handle(self, reports: list[ControllerReport]) -> None:
        """The hand-off's batch, in callback order."""
        for report in reports:
            self.on_report(report)

    def on_report(self, report: ControllerReport) -> None:
        """One callback; never raises (a bad one is counted, logged and answered 499)."""
        self.metrics.callbacks.labels(report.callback).inc()
        try:
            self._dispatch(report)
        except (TypeError, ValueError, IndexError) as error:
            self.metrics.bad_inputs.labels(f"controller_{report.callback}").inc()
            log.error("malformed %s from the controller %r: %s", report.callback, report.args[:2], error)
            self.recorder.callback(report.callback, report.at, malformed=str(error)[:200])
            _answer(report, Code.ClientError)
        except Exception:
            self.metrics.callback_errors.inc()
            log.exception("failed to handle %s", report.callback)
            _answer(report, Code.ClientError)

    def _dispatch(self, report: ControllerReport) -> None:
        try:
            REPORT_HANDLERS[report.callback](self, report)
        finally:
            if report.presend is not None and not report.presend.adopted:  # the handler failed before queueing it
                self.relay.abandon(report.presend)

    def _submit_cycle(self, report: ControllerReport, kind: str, cycle: str | None, payload: bytes) -> None:
        """Into the outbox, bound to ``cycle`` -- or, already on its way by the lane
        (bridge/fastlane.py), to the cycle the lane bound it to when it left."""
        if report.presend is not None:
            self.relay.submit_cycle_report(kind, report.presend.cycle, payload, report.waiter, presend=report.presend)
        else:
            self.relay.submit_cycle_report(kind, cycle, payload, report.waiter)

    def _clean(self, raw: Any, callback: str) -> dict[int, int]:
        cleaned = codec.clean_faults(raw)
        if cleaned.error:
            log.error("bad fault map from the controller in %s: %s (%d entr%s left out)", callback,
                      cleaned.error, cleaned.bad, "y" if cleaned.bad == 1 else "ies")
        if cleaned.bad:
            self.metrics.bad_inputs.labels("controller_fault_map").inc(cleaned.bad)
        return cleaned.faults

    # ------------------------------------------------------------------ the four callbacks
    def fault_ranks(self, report: ControllerReport) -> None:
        faults = self._clean(report.args[0] if report.args else {}, "report_fault_ranks")
        if report.presend is not None:  # already on its way (bridge/fastlane.py): the outbox adopts it first
            self.relay.submit_faults(faults, report.waiter, presend=report.presend)
        first_of_flow = self.flow.step in (Step.IDLE, Step.PAUSED, Step.STOP_SENT)
        if self.flow.step is Step.IDLE:  # the controller saw a fault first: a new one
            self.repeats.controller_fault()
        self.flow.on_callback("report_fault_ranks")
        by_type = self.metrics.count_faults(faults)
        if first_of_flow:
            self.clock.fault(report.at)
            self.flow_faults = dict(faults)
            self.resume.new_flow()
            self.metrics.faulty_ranks.set(len(faults))
        else:
            self.flow_faults = codec.merge_into(self.flow_faults, faults)
            self.metrics.faulty_ranks.set(len(self.flow_faults))
        if self._observed:
            self.observer(f"controller report_fault_ranks {codec.format_faults(faults) or '(none)'}")
        self.recorder.callback("report_fault_ranks", report.at, faults=faults, by_type=by_type)
        if report.presend is None:
            self.relay.submit_faults(faults, report.waiter)

    def stop_complete(self, report: ControllerReport) -> None:
        code, msg = status_code(report.args[0]), str(report.args[1])
        faults = self._clean(report.args[2] if len(report.args) > 2 else {}, "report_stop_complete")
        cycle = self.flow.answering
        self.flow.on_callback("report_stop_complete", code=code)
        self.clock.stop_complete(report.at)
        self.resume.remember_stop(code, msg, faults)
        self.observer(f"controller report_stop_complete code={code}")
        self.recorder.callback("report_stop_complete", report.at, code=code)
        self._submit_cycle(report, "stop_complete", cycle,
                           codec.encode_stop_complete_request(self.job_id, code, msg, faults))

    def strategies(self, report: ControllerReport) -> None:
        faults = self._clean(report.args[0], "report_strategies")
        strategies = [str(s) for s in report.args[1]]
        cycle = self.flow.answering
        self.flow.on_callback("report_strategies", strategies=tuple(strategies))
        self.clock.strategies(report.at)
        self.resume.remember_strategies(faults, strategies)
        self.observer(f"controller report_strategies {strategies}")
        self.recorder.callback("report_strategies", report.at, strategies=strategies)
        offered = self.resume.offer(cycle, faults, strategies)
        self._submit_cycle(report, "strategy", cycle,
                           codec.encode_recover_strategy_request(self.job_id, faults, offered))

    def result(self, report: ControllerReport) -> None:
        code, msg = status_code(report.args[0]), str(report.args[1])
        faults = self._clean(report.args[2] if len(report.args) > 2 else {}, "report_result")
        strategy = str(report.args[3]) if len(report.args) > 3 else ""
        cycle = self.flow.answering
        self.flow.on_callback("report_result", code=code, strategy=strategy)
        self.clock.result(report.at, strategy, code, self.repeats.outcome(code))
        if code == 0:
            self.metrics.faulty_ranks.set(0)
            if strategy == "retry":
                self.repeats.retry_succeeded(self.flow_faults)
        isolate = [str(rank) for rank in sorted(faults)] if code == 201 else []
        self.observer(f"controller report_result code={code} strategy={strategy or '(none)'}")
        self.recorder.callback("report_result", report.at, code=code, strategy=strategy)
        self._submit_cycle(report, "result", cycle, codec.encode_recover_status_request(
            self.job_id, code, msg, strategy, isolate))

    # ------------------------------------------------------------------ from the signal side
    def exit_decided(self) -> None:
        """ClusterD chose exit and the controller accepted it: no result will follow."""
        self.clock.exited(time.monotonic())
        self.repeats.cycle_ended()

    def on_session_state(self, state: SessionState) -> None:
        """A new stream: every subscription reset ClusterD's job, fault cache included.
        While the controller still waits for stop_train, a fault reported as a cycle ended
        may have been lost with code 0; only a fresh report can start the cycle. While it
        is stopped for a cycle, ``CycleResume`` restarts that cycle (resume.py)."""
        if state is not SessionState.SUBSCRIBED:
            return
        if self.flow.step is Step.AWAIT_STOP and self.flow_faults:
            log.warning("re-reporting %d fault rank(s) on the new stream: ClusterD forgot them",
                        len(self.flow_faults))
            self.relay.submit_faults(dict(self.flow_faults))
            return
        self.resume.on_subscribed(self.flow_faults)


def _answer(report: ControllerReport, code: int) -> None:
    if report.waiter is not None and not report.waiter.done():
        report.waiter.set_result(code)


def status_code(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"status code must be an int, got {value!r}")
    return value


#: callback name -> its handler: the one place each callback is handled.
REPORT_HANDLERS: dict[str, Callable[[ReportPath, ControllerReport], None]] = {
    "report_fault_ranks": ReportPath.fault_ranks,
    "report_stop_complete": ReportPath.stop_complete,
    "report_strategies": ReportPath.strategies,
    "report_result": ReportPath.result,
}
