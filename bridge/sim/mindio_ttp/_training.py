"""The test-facing side of the stub: the training job (ranks, faults, steps), the knobs
that make the controller fail on purpose, and everything the stub observed.

There is one ``Training`` per process, like the real controller singleton; tests call
``training.reset()`` in a fixture so no test leaks state into the next.

Timing knobs default to the real controller's observed timings (``REAL_TIMINGS``, the
table in docs/mindio-controller.md), because a bridge tuned against a faster stand-in is
too tight against the real one. Tests and benchmarks that need speed shorten them
explicitly and visibly, with ``training.use_timings(FAST_TIMINGS)`` or their own
mapping. The controller's MindX wait is not a knob at all: like the real controller the
stub reads ``MINDIO_WAIT_MINDX_TIME`` from the process environment at
``tft_init_controller`` and nowhere else, so a bridge that forgets to export its
configured wait is caught (``wait_scale`` only makes the clock of the MindX waits and
pause timeouts run faster in the stub's own unit tests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal, Protocol

from bridge.sim.mindio_ttp import _log
from bridge.sim.mindio_ttp._constants import FAULT_TYPES, MAX_ERROR_CODE_LEN, State
from bridge.sim.mindio_ttp._registry import CallbackRegistry



class Controller(Protocol):
    """What the job tells the stub's controller (``_controller.Controller``)."""

    paused_for_recovery: bool

    def on_rank_connected(self, rank: int) -> None: ...

    def poke(self) -> None: ...

    def halt(self, join_timeout: float) -> None: ...


class MindXEngine(Protocol):
    """What the job reads and changes of an engine that broke a rule (``_engine.MindXEngine``)."""

    generation: int
    halted: bool

ReplicaInfo = Literal["complete", "partial", "missing"]

#: fail_next_repair accepts a stage name or the code the stage typically produces.
_FAILURE_STAGES = {
    "device_stop": "device_stop", 499: "device_stop",
    "device_clean": "device_clean", 405: "device_clean",
    "repair": "repair", 406: "repair",
}

_STEPPING_STATES = frozenset({State.UNINIT, State.INIT, State.NORMAL, State.DOWNGRADE})

#: The real controller's timings, as observed on a real MindIO TFT build with fake ranks
#: (docs/mindio-controller.md, "Timings"); the stub's defaults. Seconds.
REAL_TIMINGS: Final[Mapping[str, float]] = MappingProxyType({
    "fault_detect_delay": 2.0,  # a rank raises -> report_fault_ranks (NORMAL re-checks after 2 s)
    "retry_repair_time": 2.3,  # change_strategy retry -> report_result (observed 1-5 s, smoke runs 2.3 s)
    "recover_repair_time": 2.9,  # restarted ranks registered -> report_result after recover
    "destroy_delay": 5.0,  # tft_destroy_controller blocks (observed 1-5 s; ~5 s typical)
    # a rank's heartbeats stop -> a process fault (~8 s); report_fault_ranks({rank: 1})
    # follows fault_detect_delay later: about 10 s after a rank process is killed
    "heartbeat_loss_time": 8.0,
    # an action the repair sends to a rank whose process died fails after this (the
    # ARF repair then reports 406): observed 6.0 s from the last action to "ActionSend failed"
    "repair_action_timeout": 6.0,
})  # read-only: a test that shortens a timing must do it on ``training``, not here

#: What the stub's own tests, the end-to-end tests and the benchmarks use when the real
#: pace is not what they test: every controller-side delay shortened, none removed
#: entirely (an ordering bug that a zero delay would hide still shows).
FAST_TIMINGS: Final[Mapping[str, float]] = MappingProxyType({
    "fault_detect_delay": 0.01,
    "retry_repair_time": 0.01,
    "recover_repair_time": 0.01,
    "destroy_delay": 0.01,
    "heartbeat_loss_time": 0.08,
    "repair_action_timeout": 0.06,
})

_WAIT_TIME_MOVED = ("training.wait_time is gone: like the real controller, the stub reads "
                    "MINDIO_WAIT_MINDX_TIME from the environment at tft_init_controller and nowhere "
                    "else (set it with monkeypatch.setenv, or let the bridge export it); "
                    "training.wait_scale speeds that wait up in the stub's own unit tests")


@dataclass
class Rank:
    """One training process, as its heartbeats describe it."""

    connected: bool = True
    fault: int | None = None  # 0 UCE, 1 process, 2 HCCL
    code: str = ""  # the error code string passed to report_status (<= 15 chars)
    disconnected_at: float | None = None
    # Killed while training was paused for a recovery (after stop-complete, before the
    # strategy): the real controller reports its heartbeat loss only in that cycle's
    # second report_fault_ranks, when it has been silent ``heartbeat_loss_time`` by then;
    # never after the cycle (observed: not in the 15 s before destroy).
    unwatched: bool = False


class Training:
    """Drive the simulated training job and observe the stub controller."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.registry = CallbackRegistry()
        self.controller: Controller | None = None
        self.generation = 0
        self.events: list[_log.Record] = []
        self.violations: list[str] = []
        self.callback_durations: list[tuple[str, float]] = []
        self._defaults()

    def _defaults(self) -> None:
        """Knobs and observations as after a fresh import."""
        # knobs
        self.wait_scale: float = 1.0  # stub only: the clock of every MindX and pause wait (unit tests)
        self.auto_step: bool = False  # training steps on its own while NORMAL/DOWNGRADE
        self.step_interval: float = 0.05  # seconds per auto step
        self.replica_info: ReplicaInfo = "complete"  # processors' DP-group (replica) reports
        self.legacy_fault_report: bool = False  # report_fault_ranks with one dict (pre-2026 builds)
        self.destroy_delay: float = REAL_TIMINGS["destroy_delay"]  # how long destroy blocks
        self.destroy_join_timeout: float | None = None  # None: block until the thread ends (real)
        self.bind_retry_time: float = 0.5  # port-in-use retries before SystemExit(2) (real: ~5 s)
        self.fault_detect_delay: float = REAL_TIMINGS["fault_detect_delay"]  # NORMAL re-checks a bad status after this
        self.retry_repair_time: float = REAL_TIMINGS["retry_repair_time"]  # ENV_CLEAR + REPAIR of a retry
        self.recover_repair_time: float = REAL_TIMINGS["recover_repair_time"]  # REPAIR of a recover, once registered
        self.heartbeat_loss_time: float = REAL_TIMINGS["heartbeat_loss_time"]  # a silent rank is a process fault
        self.repair_action_timeout: float = REAL_TIMINGS["repair_action_timeout"]  # a repair action to a dead rank
        self.arf_wait_time: float = 600.0  # recover waits this long for restarted ranks (real: ~10 min)
        self.auto_restart: bool = True  # MindCluster's node agent restarts the pods of a recover at once
        # Ranks per pod, as MindCluster's node agent restarts them (``restart_pods``): 1
        # (every rank its own pod) for the stub's own unit tests; SimulatedJob sets its
        # SimJob's, so the simulated job restarts whole pods as the real one does.
        self.devices_per_pod: int = 1
        self.poll_interval: float = 0.02  # the NORMAL loop's timed wait (real: 2 s, cut short by events)
        # the job
        self.ranks: dict[int, Rank] = {}
        self.step_count: int = 10  # a job that has been running (step 0: pre-lock fails)
        self._last_auto_step = time.monotonic()
        self._failures: list[str] = []
        # observations
        self.state: State = State.UNINIT
        self.job_killed: bool = False
        self.exit_reason: str = ""
        self.wait_mindx_time: int | None = None  # MINDIO_WAIT_MINDX_TIME as read by the last init
        self.processors_exited: bool = False
        self.aborted: bool = False
        self.hung: bool = False
        # Ranks restarted under a recover's repair that did not include them: that repair
        # hangs (``Flows.arf_repair``). Empty while no repair hangs.
        self.repair_hang_ranks: tuple[int, ...] = ()

    # ------------------------------------------------------------------ knobs with a shape

    @property
    def wait_time(self) -> float:
        """Removed: a silent no-op here would hide a bridge that never exports the wait."""
        raise AttributeError(_WAIT_TIME_MOVED)

    @wait_time.setter
    def wait_time(self, value: float | None) -> None:
        raise AttributeError(_WAIT_TIME_MOVED)

    def use_timings(self, timings: Mapping[str, float]) -> None:
        """Set timing knobs by name (e.g. ``FAST_TIMINGS``). An unknown name or a negative
        or non-finite value is refused before anything changes, so a typo cannot
        silently leave a real-length delay in place."""
        problems = [f"unknown timing {name!r} (known: {sorted(REAL_TIMINGS)})"
                    for name in timings if name not in REAL_TIMINGS]
        problems += [f"timing {name!r} = {value!r}: use a finite number of seconds >= 0"
                     for name, value in timings.items()
                     if name in REAL_TIMINGS and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                                      and 0 <= value < float("inf"))]
        if problems:
            raise ValueError("; ".join(problems))
        with self.cond:
            for name, value in timings.items():
                setattr(self, name, float(value))

    def timings(self) -> dict[str, float]:
        """The timing knobs as they are now (compare with ``REAL_TIMINGS``)."""
        with self.cond:
            return {name: float(getattr(self, name)) for name in REAL_TIMINGS}

    @property
    def replica_info_complete(self) -> bool:
        return self.replica_info == "complete"

    @replica_info_complete.setter
    def replica_info_complete(self, value: bool) -> None:
        """False: no processor reported replica info, so report_stop_complete gets 404."""
        self.replica_info = "complete" if value else "missing"

    def fail_next_repair(self, stage: int | str) -> None:
        """Make the next repair fail at one stage. The code the controller then reports
        follows the real rules, not the argument:

        * ``"device_stop"`` (or 499): report_result(499, "controller:N notify device stop
          failed"), then only exit (a dump gets a second 499 and exit).
        * ``"device_clean"`` (or 405): with ARF on, the ranks become process faults and
          the controller reports 405; if the strategy was retry it waits for
          on_global_rank again and re-offers strategies. Without ARF it reports 499.
        * ``"repair"`` (or 406): report_result(406 for recover/upgrade, 499 for retry,
          "do repair failed, ret: 1"), then waits for dump or exit.
        """
        try:
            name = _FAILURE_STAGES[stage]
        except KeyError:
            known = sorted(map(str, _FAILURE_STAGES))
            raise ValueError(f"unknown repair failure {stage!r}; use one of {known}") from None
        with self.cond:
            self._failures.append(name)

    def fail_next_pause(self) -> None:
        """The next hot switch's pause fails: the controller offers ``["exit"]`` instead
        of ``["migration"]`` (StepFinishCallback)."""
        with self.cond:
            self._failures.append("pause")

    def fail_next_dump(self) -> None:
        """The next dump fails: report_result(499, "DumpCallback: save ckpt failed, ret: 1")."""
        with self.cond:
            self._failures.append("dump")

    def take_failure(self, stages: Iterable[str]) -> str | None:
        """The controller consumes an armed failure for one of ``stages``."""
        with self.cond:
            for name in stages:
                if name in self._failures:
                    self._failures.remove(name)
                    return name
        return None

    # ------------------------------------------------------------------ the training job

    def connect_ranks(self, ranks: Iterable[int]) -> None:
        """These processes start (or restart) and register with the controller."""
        with self.cond:
            for rank in ranks:
                info = self.ranks.setdefault(rank, Rank())
                info.connected, info.disconnected_at, info.fault, info.code = True, None, None, ""
                info.unwatched = False
                self.record(_log.TRAINING, "connect", (rank,))
                if self.controller is not None:
                    self.controller.on_rank_connected(rank)

    def disconnect_ranks(self, ranks: Iterable[int]) -> None:
        """These processes die (their links drop, their heartbeats stop). During normal
        training a registered rank becomes a process fault after ``heartbeat_loss_time``
        and the controller reports ``{rank: 1}`` ``fault_detect_delay`` later (real:
        about 8 + 2 s). A rank that dies while training is paused for a recovery (after
        stop-complete, before the strategy) is reported only in that cycle's second
        report_fault_ranks, if its heartbeats have been missing ``heartbeat_loss_time``
        by then (the real one: killed at the stop-complete of a type-1 fault, 11 s before
        the globalFault); otherwise never, neither during the recovery nor after it. A
        recover whose repair reaches a dead rank it was not told to wait for fails (406)
        ``repair_action_timeout`` later (``Flows.arf_repair``)."""
        now = time.monotonic()
        with self.cond:
            unwatched = self.controller is not None and self.controller.paused_for_recovery
            for rank in ranks:
                info = self.ranks.get(rank)
                if info is None or not info.connected:
                    continue
                info.connected, info.disconnected_at, info.unwatched = False, now, unwatched
                self.record(_log.TRAINING, "disconnect", (rank,))

    def pod_ranks(self, ranks: Iterable[int]) -> set[int]:
        """Every rank of the job in a pod that holds one of ``ranks`` (pod = rank //
        ``devices_per_pod``, ClusterD's own rule, docs/clusterd.md section 8)."""
        size = max(1, int(self.devices_per_pod))
        with self.cond:
            pods = {rank // size for rank in ranks}
            return {rank for rank in self.ranks if rank // size in pods}

    def restart_pods(self, ranks: Iterable[int]) -> set[int]:
        """MindCluster's node agent: kill and restart every process of each pod that holds
        one of ``ranks`` (a process fault's recover), not just the faulty ranks. The
        restarted ranks register with the controller again; those its repair did not
        expect make that repair hang, as on the real controller (``Flows.arf_repair``).
        Returns the ranks restarted."""
        with self.cond:
            restarted = self.pod_ranks(ranks)
            self.record(_log.TRAINING, "restart pods", (sorted(restarted),))
            self.connect_ranks(sorted(restarted))
            return restarted

    def inject_fault(self, faults: Mapping[int, int], codes: Mapping[int, str] | None = None) -> None:
        """Training ranks report a fault through their heartbeat (0 UCE, 1 process,
        2 HCCL), with optional error-code strings; the controller starts a fault flow."""
        codes = dict(codes or {})
        with self.cond:
            for rank, kind in faults.items():
                if kind not in FAULT_TYPES:
                    raise ValueError(f"fault type {kind!r} for rank {rank}: use 0, 1 or 2")
                info = self.ranks.get(rank)
                if info is None or not info.connected:
                    raise ValueError(f"rank {rank} is not connected; connect_ranks() first")
                code = codes.get(rank, "")
                if len(code) > MAX_ERROR_CODE_LEN:
                    raise ValueError(f"error code {code!r} is longer than {MAX_ERROR_CODE_LEN} characters")
                info.fault, info.code = kind, code
            self.record(_log.TRAINING, "fault", (dict(faults), codes))
            if self.controller is not None:
                self.controller.poke()

    def step(self) -> bool:
        """Training finishes one step. False (and nothing happens) while the controller
        holds training stopped (any state but NORMAL/DOWNGRADE)."""
        with self.cond:
            if self.state not in _STEPPING_STATES:
                self.record(_log.TRAINING, "step refused", (str(self.state),))
                return False
            self.step_count += 1
            self.record(_log.TRAINING, "step", (self.step_count,))
            if self.controller is not None:
                self.controller.poke()
            return True

    def auto_advance(self) -> None:
        """Called by the controller's status check: one auto step per ``step_interval``."""
        if not self.auto_step or self.state not in _STEPPING_STATES:
            return
        now = time.monotonic()
        if now - self._last_auto_step >= self.step_interval:
            self._last_auto_step = now
            self.step_count += 1  # not logged: a long demo would fill the log with steps

    # ------------------------------------------------------------------ observations

    def record(self, kind: str, name: str, args: tuple[Any, ...] = (), result: Any = None) -> None:
        with self.cond:
            self.events.append(_log.make_record(kind, name, args, result))
            self.cond.notify_all()

    def add_duration(self, action: str, seconds: float) -> None:
        with self.cond:
            self.callback_durations.append((action, seconds))

    def violation(self, source: MindXEngine | None, message: str) -> None:
        """Something the real controller punishes with a hang or an abort."""
        with self.cond:
            if source is not None and source.generation != self.generation:
                return
            self.violations.append(message)
            self.record(_log.VIOLATION, message)

    def abort(self, source: MindXEngine, message: str) -> None:
        with self.cond:
            source.halted = True
            if source.generation != self.generation:
                return
            self.aborted = True
            self.job_killed = True
            self.state = State.ABORTED
            self.violation(source, message)

    def callbacks(self, action: str | None = None) -> list[_log.Record]:
        """Callback invocations so far (optionally of one action), in order."""
        with self.cond:
            return [e for e in self.events if e.kind == _log.CALLBACK and (action is None or e.name == action)]

    def notifies(self, name: str | None = None) -> list[_log.Record]:
        """Notify calls so far; ``name`` without the ``tft_notify_controller_`` prefix."""
        with self.cond:
            return [e for e in self.events if e.kind == _log.NOTIFY and (name is None or e.name == name)]

    def states(self) -> list[str]:
        """Every state entered so far, in order."""
        with self.cond:
            return [e.name for e in self.events if e.kind == _log.STATE]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Wait until ``predicate()`` is true (re-checked on every observation); False on timeout."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cond.wait(min(remaining, 0.05))
            return True

    def wait_state(self, state: str, timeout: float = 5.0) -> bool:
        """Wait until the controller is in ``state`` (a State or its name)."""
        return self.wait_for(lambda: self.state == state, timeout)

    def wait_callback(self, action: str, count: int = 1, timeout: float = 5.0) -> _log.Record | None:
        """Wait for the ``count``-th invocation of ``action``; that record, or None."""
        if not self.wait_for(lambda: len(self.callbacks(action)) >= count, timeout):
            return None
        return self.callbacks(action)[count - 1]

    # ------------------------------------------------------------------ reset

    def reset(self) -> None:
        """Tear the controller down at once (no destroy delay), forget the registered
        callbacks, the ranks and every observation, and restore the default knobs."""
        with self.cond:
            controller, self.controller = self.controller, None
            self.generation += 1
        if controller is not None:
            controller.halt(join_timeout=2.0)
        with self.cond:
            # A new registry, not clear(): a callback stuck on the old thread holds its lock.
            self.registry = CallbackRegistry()
            self.events.clear()
            self.violations.clear()
            self.callback_durations.clear()
            self._defaults()
            self.cond.notify_all()


#: The one training job of this process (the controller is a process-wide singleton).
training = Training()
