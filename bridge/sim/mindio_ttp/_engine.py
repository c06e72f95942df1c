"""The MindX side of the controller: the one-slot wake-up, the waits, the four reports
and the notify handlers (MindXEngine + Controller::MindXNotify* in the real sources).

The dangerous behaviour lives here, reproduced exactly:

* ``event`` is ONE slot (``repairEvent_``), overwritten by every accepted notify.
* ``flag`` is ONE boolean (``PthreadTimedwait::signalFlag``), set by every notify that
  wakes the controller. ``mindx_wait`` returns at once when it is already set, and
  clears it. It is cleared beforehand only by report_stop_complete, report_strategies
  and report_result, each time *before* the callback runs (so a notify sent from inside
  a callback survives), and never before the first wait of a fault flow (so a
  ClusterD-first stop_train counts).

So a notify that arrives while the controller is not waiting for it is latched, and
the next wait consumes it as whatever event the slot holds then: a duplicated
stop_train, a stale change_strategy or a pause racing a fault makes that wait see the
wrong event, and the controller exits.

Locking: every field is guarded by ``training.cond`` (one RLock-backed condition for the
whole stub). Callbacks are always invoked with that lock released, so a callback may
call notify functions (safe in the real library) and other threads are never blocked
behind a slow callback, except on the registry's own lock, as in the real library.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from bridge.sim.mindio_ttp import _log
from bridge.sim.mindio_ttp._constants import FAULT_TYPES, HOT_SWITCH, MAX_WORLD_SIZE, MAX_ZIT_PARAM_LEN, PROCESS_ERROR, STOP_SWITCH, STRATEGY_EVENTS, WAIT_MINDX_MAX, Event, RepairType, State

if TYPE_CHECKING:
    from bridge.sim.mindio_ttp._training import Training


class Halt(BaseException):
    """Unwinds the controller thread: the process aborted, the controller hung (destroy
    from a callback), or ``Training.reset`` tore the stub down. A BaseException so that
    no ``except Exception`` on the way can swallow it."""


class MindXEngine:
    """State shared between the controller thread and the notify callers."""

    def __init__(self, training: Training, rank: int, world_size: int, local_copy: bool,
                 arf: bool, zit: bool, wait_env: int) -> None:
        self.training = training
        self.cond = training.cond
        self.generation = training.generation
        self.rank = rank
        self.world_size = world_size
        self.local_copy = local_copy
        self.arf = arf
        self.zit = zit
        self.wait_env = wait_env  # MINDIO_WAIT_MINDX_TIME read at init

        # MindXEngine
        self.handlers_ready = False  # event handlers exist between start (INIT) and destroy
        self.is_registered = False  # "all four registered", latched once at INIT
        self.flag = False  # the waiter's signalFlag
        self.last_strategy = ""  # curr_strategy of report_result
        self.offered: list[str] = []  # the list last sent by report_strategies

        # Controller fields written by notifies
        self.event = Event.NONE
        self.errors: dict[int, int] = {}  # errorRankMsg_
        # Ranks whose device a retry stopped, cleaned and repaired, with no fault since: a
        # second device stop on them fails (499 "notify device stop failed"), as observed
        # when ClusterD v7.3.2 repeats a retry cycle that already succeeded.
        self.retried: set[int] = set()
        self.codes: dict[int, str] = {}  # errorRankCode_
        self.registered: set[int] = set()  # statusMap_ keys: ranks that registered
        self.wait_pause_time = 0
        self.wait_hccl_time = 0
        self.hot_switch_ranks: set[int] = set()
        self.hot_switch_registered: set[int] = set()
        self.zit_param = ""

        # Controller flow fields
        self.checker_flag = False  # pthreadTimeChecker_: wakes the NORMAL loop early
        self.stopping = False  # isStopped_ (set by destroy)
        self.stop_flag = False  # the state machine's stopFlag_ (set by destroy)
        self.halted = False  # stub only: torn down by Training.reset, or hung/aborted
        self.hung = False  # destroy was called from inside a callback
        self.inited = True  # isInited_ (cleared by destroy, and by EXIT's own destroy)
        self.started = False  # isStarted_
        self.repair_type = RepairType.NONE
        self.repair_step = 0
        self.need_report = False  # isNeedToReportResult_
        self.can_retry_clean = False
        self.isolated: set[int] = set()
        self.prerepair_ready: set[int] = set()
        self.arf_restarted: set[int] = set()
        # After stop-complete, before the strategy: a rank that dies now is never reported
        # (``Training.disconnect_ranks``).
        self.paused_for_recovery = False
        self.state = State.INIT
        self.exit_reason = ""
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ logging

    def log(self, kind: str, name: str, args: tuple[Any, ...] = (), result: Any = None) -> None:
        """Record, unless this controller belongs to a stub generation already reset."""
        if self.generation == self.training.generation:
            self.training.record(kind, name, args, result)

    def note(self, name: str, *args: Any) -> None:
        self.log(_log.NOTE, name, args)

    # ------------------------------------------------------------------ waits

    def wait_mindx(self, at_least: int = 0) -> float:
        """How long a MindX wait lasts: max(``at_least``, MINDIO_WAIT_MINDX_TIME as read
        at init) seconds. Only the clock can be sped up (``training.wait_scale``, for the
        stub's own unit tests), never the value replaced: a bridge that does not export
        its configured wait must meet the real default here too."""
        return float(max(at_least, self.wait_env)) * self.training.wait_scale

    def pause_seconds(self) -> float:
        """The pause timeout of the last pause_train, on the same clock as the MindX waits."""
        return float(self.wait_pause_time) * self.training.wait_scale

    def mindx_wait(self, seconds: float, expecting: str) -> bool:
        """MindXEngine::Wait: True when woken (flag consumed), False on timeout. Returns
        True at once when the callbacks are not all registered, like the real one."""
        if not self.is_registered:
            return True
        woken = self._consume("flag", seconds)
        if not woken:
            self.note("wait timed out", expecting, seconds)
        return woken

    def checker_wait(self, seconds: float) -> None:
        """The NORMAL-loop timed wait, cut short by a heartbeat with a bad status or by
        stop_train / pause / dump / continue / hot switch."""
        self._consume("checker_flag", seconds)

    def _consume(self, flag: str, seconds: float) -> bool:
        """Wait up to ``seconds`` for the named flag, then clear it; whether it was set.
        Raises Halt when the controller is being destroyed meanwhile."""
        deadline = time.monotonic() + seconds
        with self.cond:
            while not getattr(self, flag) and not self.halted:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.cond.wait(remaining)
            if self.halted:
                raise Halt
            was_set = bool(getattr(self, flag))
            setattr(self, flag, False)
        return was_set

    def sleep(self, seconds: float) -> None:
        """An uninterruptible sleep of the real controller (only a reset cuts it short)."""
        if seconds <= 0:
            return
        deadline = time.monotonic() + seconds
        with self.cond:
            while not self.halted:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self.cond.wait(remaining)
            raise Halt

    def wake(self) -> None:
        """MindXEngine::WakeUp (a no-op when the callbacks are not all registered)."""
        if self.is_registered:
            self.flag = True
            self.cond.notify_all()

    def signal_checker(self) -> None:
        self.checker_flag = True
        self.cond.notify_all()

    # ------------------------------------------------------------------ reports

    def invoke(self, action: str, args: tuple[Any, ...]) -> int:
        """Run one callback on this (the controller's) thread and block until it returns.
        0 after a normal return, 1 after an Exception; a BaseException that is not an
        Exception aborts the real process, so here it halts the controller."""
        training = self.training
        self.log(_log.CALLBACK, action, _snapshot(args))
        started = time.monotonic()
        try:
            ret, exc = training.registry.execute(action, args)
        except BaseException as exc:  # noqa: BLE001 - reproducing std::terminate
            training.add_duration(action, time.monotonic() - started)
            training.abort(self, f"{type(exc).__name__} escaped the {action} callback: the real "
                                 "controller throws Swig::DirectorMethodException and std::terminate "
                                 "aborts the whole process")
            raise Halt from None
        training.add_duration(action, time.monotonic() - started)
        if exc is not None:
            self.log(_log.CALLBACK_ERROR, action, (), repr(exc))
        if self.hung or self.halted:
            raise Halt
        return ret

    def report_fault_ranks(self) -> bool:
        """ReportFaultRanks: fails (False) without calling anything when the callbacks are
        not all registered. Two dicts, or one with ``training.legacy_fault_report``."""
        if not self.is_registered:
            return False
        with self.cond:
            errors, codes = dict(self.errors), dict(self.codes)
        args: tuple[Any, ...] = (errors,) if self.training.legacy_fault_report else (errors, codes)
        return self.invoke("report_fault_ranks", args) == 0

    def report_stop_complete(self, code: int, msg: str) -> bool:
        if not self.is_registered:
            return True
        with self.cond:
            self.flag = False  # SignalClean, before the callback
            errors = dict(self.errors)
        return self.invoke("report_stop_complete", (code, msg, errors)) == 0

    def report_strategies(self, strategies: list[str]) -> bool:
        if not self.is_registered:
            return True
        with self.cond:
            self.offered = list(strategies)
            self.flag = False
            errors = dict(self.errors)
        return self.invoke("report_strategies", (errors, list(strategies))) == 0

    def report_result(self, code: int, msg: str) -> bool:
        if not self.is_registered:
            return True
        with self.cond:
            self.flag = False
            errors, strategy = dict(self.errors), self.last_strategy
        ok = self.invoke("report_result", (code, msg, errors, strategy)) == 0
        if code == 0:
            with self.cond:
                self.last_strategy = ""
                self.offered = []
        return ok

    # ------------------------------------------------------------------ notify handlers
    # Each runs on the caller's thread and returns the controller's 0/1. Argument types
    # were already checked by the API layer (the SWIG conversions).

    def _merge_errors(self, faults: dict[int, int]) -> bool:
        """ErrorRankMsgModify: validation stops at the first bad entry, but the entries
        before it (in rank order) are already merged; type 1 is never overwritten."""
        for rank in sorted(faults):
            kind = faults[rank]
            if not 0 <= rank < self.world_size or kind not in FAULT_TYPES or rank not in self.registered:
                return False
            if self.errors.get(rank) == PROCESS_ERROR:
                continue
            self.errors[rank] = kind
        return True

    def notify_stop_train(self, faults: dict[int, int]) -> int:
        with self.cond:
            if not self.handlers_ready or len(faults) > self.world_size:
                return 1
            if not self._merge_errors(faults):
                return 1
            self.event = Event.STOP_TRAIN
            self.wake()
            self.signal_checker()
            return 0

    def notify_pause_train(self, timeout: int) -> int:
        with self.cond:
            if not self.handlers_ready:
                return 1
            self.wait_pause_time = timeout
            self.event = Event.PAUSE_TRAIN
            self.wake()
            self.signal_checker()
            return 0

    def notify_fault_ranks(self, faults: dict[int, int], seconds: int) -> int:
        with self.cond:
            if not self.handlers_ready or len(faults) > MAX_WORLD_SIZE:
                return 1
            if not 0 < seconds <= WAIT_MINDX_MAX:
                return 1
            self.wait_hccl_time = seconds
            if not self._merge_errors(faults):
                return 1
            self.event = Event.NOTIFY_FAULT_RANKS
            self.wake()
            return 0

    def notify_prepare_action(self, action: str, faults: dict[int, int]) -> int:
        with self.cond:
            if not self.handlers_ready:
                return 1
            if action == HOT_SWITCH:
                if len(faults) > self.world_size:
                    return 1
                self.hot_switch_ranks = set(faults)
                self.hot_switch_registered = set()
                self.event = Event.HOT_SWITCH  # no wake-up: only the NORMAL loop looks
                self.signal_checker()
                return 0
            if action == STOP_SWITCH:
                self.hot_switch_ranks = set()
                self.event = Event.STOP_SWITCH
                self.wake()  # latched even in NORMAL, where nothing consumes it
                self.signal_checker()
                return 0
            return 1

    def notify_change_strategy(self, strategy: str, params: str) -> int:
        """MindXEngine::ChangeStrategy. The offered-list check comes first: any name not
        in a non-empty offered list fires INVALID and returns 0."""
        with self.cond:
            if self.offered and strategy not in self.offered:
                return self._fire(Event.INVALID)
            self.last_strategy = strategy  # set even when the name turns out unknown
            event = STRATEGY_EVENTS.get(strategy)
            if event is None or not self.handlers_ready:
                return 1
            if event in (Event.DOWNGRADE, Event.UPGRADE):
                size = len(params.encode())
                if not 0 < size < MAX_ZIT_PARAM_LEN:
                    return 1
                self.zit_param = params
                self.event = event
                if event is Event.DOWNGRADE:
                    self.wake()  # upgrade does not wake the controller
                return 0
            self._fire(event)
            if event is Event.CONTINUE_TRAIN:
                self.signal_checker()
            return 0

    def notify_dump(self) -> int:
        with self.cond:
            self.last_strategy = "dump"
            if not self.handlers_ready:
                return 1
            self.event = Event.ELEGANT_DUMP
            self.wake()
            self.signal_checker()
            return 0

    def _fire(self, event: Event) -> int:
        if not self.handlers_ready:
            return 1
        self.event = event
        self.wake()
        return 0


def _snapshot(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Copies of the dicts/lists handed to a callback, so the log shows what was passed
    even if the callback mutates its arguments."""
    out: list[Any] = []
    for arg in args:
        if isinstance(arg, dict):
            out.append(dict(arg))
        elif isinstance(arg, list):
            out.append(list(arg))
        else:
            out.append(arg)
    return tuple(out)
