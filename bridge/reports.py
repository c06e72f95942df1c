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
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from . import faults as codec
from . import lowlevel, realtime
from .affinity import ControllerPin
from .clusterd import SessionState
from .codes import Code
from .flow import STRATEGIES, ControllerFlow, Step
from .metrics import BridgeMetrics
from .recorder import NullRecorder
from .relay import Relay
from .repeats import RepeatedCycles
from .reporttypes import ControllerReport, ReportFields, report_of, status_code
from .resume import CycleResume

log = logging.getLogger(__name__)

#: Posts one batch of reports to the event loop; may raise RuntimeError when the loop is closed.
Post = Callable[[list[ControllerReport]], None]


class ReportLane(Protocol):
    """What the THREAD hand-off needs of the report lane (``fastlane.ReportLane``)."""

    def dispatch(self, reports: list[ControllerReport], post: Post) -> None: ...

    def release(self) -> None: ...


#: How the controller's callbacks reach the event loop (``Handoff(mode=...)``).
WAKE = "wake"  # the callback wakes the loop itself (opt-in: controller.handoff)
THREAD = "thread"  # via a SCHED_BATCH hand-off thread (the default)


class Handoff:
    """Controller thread -> event loop, never releasing the GIL inside the callback.

    Two ways, chosen by ``mode``; both deliver in callback order, in batches, to
    ``handle`` on the loop, and neither raises into the callback.

    ``THREAD`` is the default (``controller.handoff``): WAKE's wake-up costs the
    controller's thread itself (the woken loop preempts it, the very effect SCHED_BATCH
    keeps off the THREAD hand-off), and the controller blocks on every callback. Under
    CPU load WAKE reaches the loop sooner, so a node whose cores are busy may choose it
    (``bench/bench_relay.py --handoff wake`` measures both; docs/performance.md).

    ``WAKE``: the callback appends the tuple to a deque and, unless a wake-up is already
    pending, writes to an eventfd the loop watches, through a write that keeps the GIL
    (``lowlevel.gil_holding_write``): ``os.write`` and ``call_soon_threadsafe`` release it
    around the syscall, and the woken loop could then take the GIL and keep the
    controller's thread waiting up to the interpreter's switch interval to get it back.
    One thread wake-up per burst of reports, and no report lane.

    ``THREAD``: a ``SimpleQueue.put`` (a C call that keeps the GIL) wakes a hand-off
    thread blocked in ``get``, which calls ``call_soon_threadsafe`` once the callback has
    returned. That thread waits as ``SCHED_BATCH``: under the normal policy Linux often
    preempted the controller's thread at the put to run it, and a woken realtime thread
    goes to the CPU it last ran on whatever runs there, so it preempted the controller's
    thread, which then waited for its CPU back while holding the GIL (``realtime.py``).
    Also the fall back where WAKE is unavailable (no eventfd).
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
        self._write = lowlevel.gil_holding_write() if mode == WAKE else None
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
            self._write(self._fd, lowlevel.EVENTFD_ONE, 8)  # type: ignore[misc]

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
        self._loop.call_soon_threadsafe(self.handle_posted, reports)

    def handle_posted(self, reports: list[ControllerReport]) -> None:
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
                 observer: Callable[[str], None] | None = None, *, recorder: NullRecorder | None = None) -> None:
        """``recorder``: the flight recorder (bridge/recorder/), told of every callback and
        of a repeated retry cycle; its hooks are O(1)."""
        self.job_id = job_id
        self.flow = flow
        self.relay = relay
        self.metrics = metrics
        self.clock = RecoveryClock(metrics)
        self.recorder: NullRecorder = recorder or NullRecorder()
        # A retry cycle ClusterD repeats after its success.
        self.repeats = RepeatedCycles(metrics, on_repeat=self.recorder.repeated)
        self.observer: Callable[[str], None] = observer or (lambda line: None)
        self._observed = observer is not None  # formatting a 100 000-rank timeline line costs ms
        self.flow_faults: dict[int, int] = {}  # the controller's faults in the running flow
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


#: callback name -> its handler: the one place each callback is handled.
REPORT_HANDLERS: dict[str, Callable[[ReportPath, ControllerReport], None]] = {
    "report_fault_ranks": ReportPath.fault_ranks,
    "report_stop_complete": ReportPath.stop_complete,
    "report_strategies": ReportPath.strategies,
    "report_result": ReportPath.result,
}
