"""The controller's lifecycle: its state-machine thread, its listener, start and destroy.

The state machine runs on one daemon thread named like the real one as Python sees it
("Dummy-1"), and every callback runs on it. Destroy follows the real Destroy(): wake the
MindX wait, mark the controller stopped, close the server, block (``destroy_delay``: the
real one tells every processor and stops ten server workers, 1-5 s), and only then stop
the state machine and wait for it to finish its current action, which can still call a
callback. So a destroy that wakes a MindX wait lets the flow run on into EXIT and FINAL,
as on the real controller, and a destroy during a repair ends before NORMAL sends the
deferred report_result.
Destroy from inside a callback deadlocks the real controller forever; here it records a
violation and the controller stops dead after that callback, as if hung.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import ClassVar

from bridge.sim.mindio_ttp import _log
from bridge.sim.mindio_ttp._constants import TRANSITIONS, RepairType, Ret, State
from bridge.sim.mindio_ttp._engine import Halt
from bridge.sim.mindio_ttp._flows import Flows
from bridge.sim.mindio_ttp._server import Listener

#: States whose action returns STOP_SERVICE at once, without a callback, once destroy began.
_QUICK_UNDER_DESTROY = frozenset({State.NORMAL, State.EXIT})


class Controller(Flows):
    """One initialised controller (the real process-wide singleton, between init and destroy)."""

    STATE_ACTIONS: ClassVar[dict[State, Callable[[Flows], Ret]]] = {
        State.INIT: Flows.on_init,
        State.NORMAL: Flows.on_normal,
        State.PAUSE: Flows.on_pause,
        State.STEP_FINISH: Flows.on_step_finish,
        State.MIGRATION: Flows.on_migration,
        State.ABNORMAL: Flows.on_abnormal,
        State.ENV_CLEAR: Flows.on_env_clear,
        State.REPAIR: Flows.on_repair,
        State.DG_REPAIR: Flows.on_dg_repair,
        State.DOWNGRADE: Flows.on_downgrade,
        State.UPGRADE: Flows.on_upgrade,
        State.DUMP: Flows.on_dump,
        State.EXIT: Flows.on_exit,
    }

    listener: Listener | None = None
    thread_done = False

    # ------------------------------------------------------------------ the thread

    def run(self) -> None:
        state = State.INIT
        try:
            while state is not State.FINAL:
                with self.cond:
                    # NORMAL and EXIT return at once under a destroy (on_normal, on_exit),
                    # so they still reach FINAL however short the stub's destroy_delay is:
                    # the real block lasts seconds, far longer than that step.
                    if self.stop_flag and not (self.stopping and state in _QUICK_UNDER_DESTROY):
                        break
                ret = self.STATE_ACTIONS[state](self)
                following = TRANSITIONS.get((state, ret))
                if following is None:
                    # The real state machine logs "No action defined" and its thread ends.
                    self.note("no transition; the state-machine thread ends", str(state), ret.name)
                    break
                state = following
                self.enter(state)
        except Halt:
            pass
        finally:
            with self.cond:
                self.thread_done = True
                self.cond.notify_all()

    def enter(self, state: State) -> None:
        training = self.training
        with self.cond:
            self.state = state
            current = self.generation == training.generation
            if current:
                training.state = state
                if state is State.EXIT:
                    training.exit_reason = self.exit_reason or "unspecified"
                    # EXIT because destroy woke a wait is the destroyer's business, not a kill.
                    training.job_killed = training.job_killed or not self.stopping
        self.log(_log.STATE, state.value)

    # ------------------------------------------------------------------ start / destroy

    def start(self, listener: Listener) -> None:
        """Start the state machine and return once it has left INIT (like the real one)."""
        self.listener = listener
        self.thread = threading.Thread(target=self.run, name="Dummy-1", daemon=True)
        self.thread.start()
        with self.cond:
            while not self.started and not self.thread_done:
                self.cond.wait(0.1)

    def on_controller_thread(self) -> bool:
        return self.thread is not None and threading.current_thread() is self.thread

    def destroy(self, delay: float, join_timeout: float | None) -> None:
        """External Destroy(). The caller is not the controller thread (checked by the API)."""
        with self.cond:
            was_running = self.thread is not None and not self.thread_done and self.inited
            self.wake()
            self.stopping = True
            self.inited = False
            self.signal_checker()
        if self.listener is not None:
            self.listener.stop()
        if was_running and delay > 0:
            time.sleep(delay)
        with self.cond:
            self.stop_flag = True  # controllerStateMachine::Stop(), after the server stopped
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(join_timeout)
            if self.thread.is_alive():
                self.training.violation(
                    self, f"tft_destroy_controller gave up after {join_timeout} s: the state machine "
                          "is still inside an action (a callback that does not return?); the real "
                          "destroy keeps blocking")
        with self.cond:
            self.handlers_ready = False

    def destroy_inner(self) -> None:
        """Destroy(isInner=true), from EXIT: the server stops; a new init needs a full destroy."""
        with self.cond:
            self.inited = False
            self.stopping = True
        if self.listener is not None:
            self.listener.stop()

    def halt(self, join_timeout: float) -> None:
        """Stub teardown for ``Training.reset``: end every wait at once, drop the thread."""
        with self.cond:
            self.halted = True
            self.stopping = True
            self.stop_flag = True
            self.handlers_ready = False
            self.cond.notify_all()
        if self.listener is not None:
            self.listener.stop()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(join_timeout)

    # ------------------------------------------------------------------ the training side

    def on_rank_connected(self, rank: int) -> None:
        """A processor (re)registers. Caller holds the lock."""
        if not self.handlers_ready or not self.inited:
            return  # not listening yet: it registers when the controller starts
        if not 0 <= rank < self.world_size:
            self.note("rank rejected: outside world size", rank)
            return
        self.registered.add(rank)
        if rank in self.hot_switch_ranks:
            self.hot_switch_registered.add(rank)
        if self.state is State.REPAIR and self.repair_type is RepairType.ARF:
            self.arf_restarted.add(rank)
        if self.state is State.DOWNGRADE and rank in self.isolated:
            self.prerepair_ready.add(rank)
        self.signal_checker()

    def poke(self) -> None:
        """A heartbeat with news (a fault, a step): wake the NORMAL loop. Caller holds the lock."""
        self.signal_checker()

    def high_availability(self) -> bool:
        """True iff at least one registered rank counts as connected on a running server.
        A rank whose process died still counts until its heartbeats have been missing for
        ``heartbeat_loss_time`` (observed: a bridge stopped within ~10 s of the ranks'
        kill still saw the switch on)."""
        with self.cond:
            if not self.started or not self.inited or self.listener is None or self.listener.stopped:
                return False
            ranks, now = self.training.ranks, time.monotonic()
            loss = self.training.heartbeat_loss_time
            return any(r in ranks and (ranks[r].connected or (
                ranks[r].disconnected_at is not None and now - ranks[r].disconnected_at <= loss))
                for r in self.registered)
