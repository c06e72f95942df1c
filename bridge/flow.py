"""Which notify the controller is waiting for right now, derived from its callbacks.

The controller keeps one wake-up flag that is not cleared before the first wait of a
fault flow: a notify that arrives when the controller is not waiting for it is consumed
by the next wait as the wrong event, and the controller exits, killing the job. So the
bridge forwards a ClusterD action only when this tracker says the controller's flow is
at the step that expects it, and refuses (and counts) everything else.

The tracker also remembers which ClusterD cycle (uuid) the controller is answering:
the uuid of the signal whose notify it last accepted. Reports carry no uuid on the wire,
so this is the only way to tie a stop-complete, strategy or result report to its cycle.
"""

from __future__ import annotations

import enum
import time

STRATEGIES = frozenset({"retry", "recover", "dump", "exit", "downgrade", "upgrade", "migration", "continue"})
CLUSTERD_ONLY_STRATEGIES = frozenset({"elastic-training", "recover-in-place", "job-rescheduling", "pod-rescheduling"})


class Step(enum.Enum):
    IDLE = "idle"  # training normally; a ClusterD-first stop, a pause or a dump may start a flow
    STOP_SENT = "stop_sent"  # stop forwarded; waiting for report_stop_complete
    AWAIT_STOP = "await_stop"  # report_fault_ranks seen; waiting for stop_train (or dump)
    AWAIT_GLOBAL = "await_global"  # stop complete; waiting for on_global_rank
    GLOBAL_SENT = "global_sent"  # on_global_rank forwarded; waiting for report_strategies
    AWAIT_STRATEGY = "await_strategy"  # strategies offered; waiting for change_strategy
    REPAIRING = "repairing"  # a strategy is running; waiting for report_result
    AWAIT_FINAL = "await_final"  # repair failed (406/499); only dump or exit may follow
    PAUSE_SENT = "pause_sent"  # pause forwarded; waiting for report_stop_complete
    PAUSED = "paused"  # waiting for continue, or a stop that turns the pause into a fault
    DUMPING = "dumping"  # dump running; waiting for its report_result
    EXITING = "exiting"  # the controller is going down; one exit notice may still be given
    EXITED = "exited"  # exit notice given; nothing more


#: Actions each step accepts; change_strategy is further checked against the strategy.
_ACCEPTS: dict[Step, frozenset[str]] = {
    Step.IDLE: frozenset({"stop_train", "pause_train", "save_and_exit", "hot switch", "stop switch", "change_strategy"}),
    Step.STOP_SENT: frozenset(),
    Step.AWAIT_STOP: frozenset({"stop_train", "save_and_exit"}),
    Step.AWAIT_GLOBAL: frozenset({"on_global_rank"}),
    Step.GLOBAL_SENT: frozenset(),
    Step.AWAIT_STRATEGY: frozenset({"change_strategy"}),
    Step.REPAIRING: frozenset(),
    Step.AWAIT_FINAL: frozenset({"change_strategy"}),
    Step.PAUSE_SENT: frozenset(),
    Step.PAUSED: frozenset({"change_strategy", "stop_train"}),
    Step.DUMPING: frozenset(),
    Step.EXITING: frozenset({"change_strategy"}),
    Step.EXITED: frozenset(),
}


class ControllerFlow:
    """The controller's position in its fault flow, as the bridge can know it."""

    def __init__(self, wait_timeout: float = 30.0, clock=time.monotonic) -> None:
        self.step = Step.IDLE
        self.offered: tuple[str, ...] = ()
        self.answering: str | None = None  # uuid of the cycle the controller is answering
        self.progress = 0  # bumped on every callback
        self.rounds = 0  # bumped on every result: ClusterD may legitimately repeat a signal after one
        self.downgraded = False
        self._since = clock()
        self._clock = clock
        # Past this the controller has given up waiting for ClusterD and gone to EXIT.
        self._wait_timeout = wait_timeout

    def _move(self, step: Step) -> None:
        self.step = step
        self._since = self._clock()

    def expire(self) -> bool:
        """Move to EXITING when the controller has certainly timed out its current wait."""
        waiting = self.step in (Step.AWAIT_STOP, Step.AWAIT_GLOBAL, Step.AWAIT_STRATEGY, Step.AWAIT_FINAL)
        if waiting and self._clock() - self._since > self._wait_timeout + 5:
            self._move(Step.EXITING)
            return True
        return False

    # ------------------------------------------------------------------ gate
    def refusal(self, action: str, strategy: str = "", params: str = "") -> str | None:
        """None when the controller expects ``action`` now, else the reason to refuse it."""
        self.expire()
        if action not in _ACCEPTS[self.step]:
            return "unexpected_step"
        if action != "change_strategy":
            return None
        if strategy in CLUSTERD_ONLY_STRATEGIES:
            return "clusterd_only_strategy"
        if strategy not in STRATEGIES:
            return "unknown_strategy"
        if self.step is Step.IDLE:
            # Outside a flow only an upgrade after a downgrade is awaited.
            return None if strategy == "upgrade" and self.downgraded else "unexpected_step"
        if self.step is Step.EXITING:
            return None if strategy == "exit" else "unexpected_step"
        if self.step is Step.AWAIT_FINAL:
            return None if strategy in ("dump", "exit") else "strategy_not_offered"
        if self.step is Step.PAUSED:
            return None if strategy == "continue" else "unexpected_step"
        if strategy not in self.offered:
            # The controller would answer 0, then fail the flow with 499 and exit.
            return "strategy_not_offered"
        return None

    def snapshot(self) -> tuple[Step, str | None, float, int]:
        return (self.step, self.answering, self._since, self.progress)

    def restore(self, snapshot: tuple[Step, str | None, float, int]) -> None:
        """Undo ``notified`` for a notify the controller refused (returned 1), unless a
        callback has moved the flow since."""
        if self.progress == snapshot[3]:
            self.step, self.answering, self._since, _ = snapshot

    def notified(self, action: str, uuid: str, strategy: str = "") -> None:
        """Record that ``action`` is being given to the controller for cycle ``uuid``.

        Called *before* the notify call: the controller may run the next callback on its
        own thread before the notify call even returns here, and that callback must
        already find the flow advanced and tied to this cycle."""
        if uuid:
            self.answering = uuid
        if action == "stop_train":
            self._move(Step.STOP_SENT)
        elif action == "pause_train":
            self._move(Step.PAUSE_SENT)
        elif action == "on_global_rank":
            self._move(Step.GLOBAL_SENT)
        elif action == "save_and_exit":
            self._move(Step.DUMPING)
        elif action == "change_strategy":
            if strategy == "exit":
                self._move(Step.EXITED if self.step is Step.EXITING else Step.EXITING)
            elif strategy == "dump":
                self._move(Step.DUMPING)
            else:
                self._move(Step.REPAIRING)

    # ------------------------------------------------------------------ callbacks
    def on_callback(self, callback: str, code: int | None = None, strategies: tuple[str, ...] = (), strategy: str = "") -> None:
        self.progress += 1
        if callback == "report_fault_ranks":
            # The first of a flow (or the first after a ClusterD-first stop). The second
            # report of a flow arrives after on_global_rank and changes nothing.
            if self.step in (Step.IDLE, Step.PAUSED):
                self._move(Step.AWAIT_STOP)
        elif callback == "report_stop_complete":
            if self.step is Step.PAUSE_SENT:
                self._move(Step.PAUSED if code == 0 else Step.IDLE)
            elif code == 0:
                self._move(Step.AWAIT_GLOBAL)
            else:  # 404: no processor has reported its replica info; the controller exits
                self._move(Step.EXITING)
        elif callback == "report_strategies":
            self.offered = strategies
            self._move(Step.AWAIT_STRATEGY)
        elif callback == "report_result":
            self.rounds += 1
            self._on_result(code, strategy)

    def _on_result(self, code: int | None, strategy: str) -> None:
        if code == 0:
            if strategy == "dump" or self.step is Step.DUMPING:
                self._move(Step.EXITING)
            else:
                self.downgraded = self.downgraded and strategy != "upgrade"
                self._move(Step.IDLE)
        elif code == 201:
            self.downgraded = True
            self._move(Step.IDLE)
        elif code == 405:
            self._move(Step.AWAIT_GLOBAL)
        elif strategy == "" and code == 499:  # invalid strategy: the controller exits
            self._move(Step.EXITING)
        elif self.step is Step.DUMPING:
            self._move(Step.EXITING)
        elif self.step in (Step.PAUSE_SENT, Step.PAUSED):  # a pause that timed out turns into a fault flow
            self._move(Step.IDLE)
        else:  # 406, 499: dump or exit may follow
            self._move(Step.AWAIT_FINAL)
