"""Which notify the controller is waiting for right now, derived from its callbacks.

``ControllerFlow``, on the event loop: a ClusterD action is forwarded only when the
controller's flow is at the step that expects it (``ACCEPTS``; ``refusal`` names why
not), since an unexpected notify kills the job (docs/mindio-controller.md section 5). It
also holds the cycle (uuid) the controller answers: the uuid of the signal whose notify
it last accepted, the only tie from a report to its cycle. The step moves by three
tables (the flows and waits of docs/mindio-controller.md sections 4 and 6):

``EXPECTED`` -- (step, callback, outcome) -> next step: every callback the controller
gives at a step where the bridge expects it. ``outcome`` is what the callback says
(``outcome()``): ``-`` for report_fault_ranks and report_strategies; ``ok``/``failed``
for report_stop_complete; for report_result ``ok``, ``dump_ok`` (0 after a dump),
``downgrade_ok`` (0 after a downgrade), ``downgraded`` (201), ``retry_failed`` (405),
``invalid_strategy`` (499 with no strategy) or ``failed`` (406, 499, anything else).

=============== ===================== ================= ==============================
step            callback              outcome           next step
=============== ===================== ================= ==============================
IDLE            report_fault_ranks    -                 AWAIT_STOP (a fault flow starts)
SWITCHING       report_fault_ranks    -                 AWAIT_STOP (a fault before the switch)
PAUSED          report_fault_ranks    -                 AWAIT_STOP (the pause turns into a fault)
STOP_SENT       report_fault_ranks    -                 (stays: a ClusterD-first stop)
GLOBAL_SENT     report_fault_ranks    -                 (stays: the flow's second report)
STOP_SENT       report_stop_complete  ok / failed       AWAIT_GLOBAL / EXITING (404)
PAUSE_SENT      report_stop_complete  ok / failed       PAUSED / IDLE
GLOBAL_SENT     report_strategies     -                 AWAIT_STRATEGY
SWITCHING       report_strategies     -                 AWAIT_STRATEGY (migration, or exit)
REPAIRING       report_result         ok / downgraded   IDLE / IDLE (and downgraded)
IDLE            report_result         downgrade_ok      (stays: the reduced job trained a step)
REPAIRING       report_result         retry_failed      AWAIT_GLOBAL (405)
REPAIRING       report_result         invalid_strategy  EXITING
REPAIRING       report_result         failed            AWAIT_FINAL (406, 499)
DUMPING         report_result         ok / dump_ok      EXITING
DUMPING         report_result         failed            EXITING
DUMPING         report_result         invalid_strategy  EXITING
PAUSE_SENT      report_result         failed            IDLE (the pause timed out)
PAUSED          report_result         failed            IDLE (the pause timed out)
=============== ===================== ================= ==============================

``FOLLOW`` -- (callback, outcome) -> next step: a callback the current step does not
expect is a *desync* (a lost or reordered callback, a notify the bridge did not see
through, a wait the controller timed out). The controller is the ground truth, so the
tracker still follows it to where that callback puts the controller (``-`` means it
stays), and reports the desync through ``on_desync(callback, step)`` (counted in
``tft_bridge_flow_desync_total`` by the caller) with a log line. report_fault_ranks
stays, because a first and a second report cannot be told apart; report_stop_complete
goes to AWAIT_GLOBAL (ok) or EXITING; report_strategies to AWAIT_STRATEGY;
report_result to IDLE (ok, downgrade_ok, downgraded), EXITING (dump_ok, invalid_strategy),
AWAIT_GLOBAL (retry_failed) or AWAIT_FINAL (failed).

``NOTIFIED`` -- (action, strategy) -> next step: where a notify the bridge gives moves
the flow (``notified``): stop_train STOP_SENT, pause_train PAUSE_SENT, on_global_rank
GLOBAL_SENT, save_and_exit DUMPING, change_strategy exit EXITING (EXITED when already
EXITING: the one exit notice), dump DUMPING, any other strategy REPAIRING (``migration``
included), hot switch SWITCHING, stop switch IDLE. The gate (``refusal``) already
guarantees the step expects the action, so this table has no desync column.

**The hot switch** (uuid "", outside any fault flow): ``hot switch`` -> SWITCHING until
the controller offers ``["migration"]`` (or ``["exit"]`` when its pause failed);
``migration`` is then repaired like any strategy. ``stop switch`` ends SWITCHING and is
never given to the controller (``signals.STOP_SWITCH``; docs/mindio-controller.md
section 5).

**How long each wait lasts** (``wait_limit``): exactly the controller's own wait plus
``EXPIRY_MARGIN``; past it the controller has gone to EXIT and the gate refuses
(``expire``). AWAIT_STOP: max(last pause timeout, ``MINDIO_WAIT_MINDX_TIME``) (the
controller never resets its last pause timeout); AWAIT_STRATEGY: max(last on_global_rank
time, the wait) after an on_global_rank, else the wait; AWAIT_GLOBAL, AWAIT_FINAL: the
wait. The pause timeout and on_global_rank time are those the dispatcher passed to the
notify (``notified``), kept even when the controller refused the notify
(docs/mindio-controller.md section 6).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable

from bridge.core.log_budget import LogBudget, suppressed_note
from bridge.job.reports.kinds import CALLBACKS

log = logging.getLogger(__name__)

STRATEGIES = frozenset({"retry", "recover", "dump", "exit", "downgrade", "upgrade", "migration", "continue"})
CLUSTERD_ONLY_STRATEGIES = frozenset({"elastic-training", "recover-in-place", "job-rescheduling", "pod-rescheduling"})


class Step(enum.Enum):
    """Where the controller's flow is, as far as its callbacks and the notifies given tell."""
    IDLE = "idle"  # training normally; a ClusterD-first stop, a pause or a dump may start a flow
    SWITCHING = "switching"  # hot switch forwarded; waiting for the replacement ranks and the offer
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
ACCEPTS: dict[Step, frozenset[str]] = {
    Step.IDLE: frozenset({"stop_train", "pause_train", "save_and_exit", "hot switch", "change_strategy"}),
    # still NORMAL for the controller: what IDLE takes, but no second switch and no upgrade
    Step.SWITCHING: frozenset({"stop_train", "pause_train", "save_and_exit", "stop switch"}),
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

#: Added to every wait limit: the controller's wait starts only once the callback before it
#: has returned and the bridge's clock started a moment earlier (``_move``), so a notify at
#: the very end of the wait must not be refused while the controller may still take it.
EXPIRY_MARGIN = 5.0

ANY = "-"  # the outcome of a callback whose arguments do not steer the flow
STAY = None  # as a next step: the callback leaves the step as it is

#: (step, callback, outcome) -> next step, for every callback a step expects.
EXPECTED: dict[tuple[Step, str, str], Step | None] = {
    (Step.IDLE, "report_fault_ranks", ANY): Step.AWAIT_STOP,
    (Step.SWITCHING, "report_fault_ranks", ANY): Step.AWAIT_STOP,
    (Step.PAUSED, "report_fault_ranks", ANY): Step.AWAIT_STOP,
    (Step.STOP_SENT, "report_fault_ranks", ANY): STAY,
    (Step.GLOBAL_SENT, "report_fault_ranks", ANY): STAY,
    (Step.STOP_SENT, "report_stop_complete", "ok"): Step.AWAIT_GLOBAL,
    (Step.STOP_SENT, "report_stop_complete", "failed"): Step.EXITING,
    (Step.PAUSE_SENT, "report_stop_complete", "ok"): Step.PAUSED,
    (Step.PAUSE_SENT, "report_stop_complete", "failed"): Step.IDLE,
    (Step.GLOBAL_SENT, "report_strategies", ANY): Step.AWAIT_STRATEGY,
    (Step.SWITCHING, "report_strategies", ANY): Step.AWAIT_STRATEGY,
    (Step.REPAIRING, "report_result", "ok"): Step.IDLE,
    (Step.REPAIRING, "report_result", "downgraded"): Step.IDLE,
    (Step.IDLE, "report_result", "downgrade_ok"): STAY,
    (Step.REPAIRING, "report_result", "retry_failed"): Step.AWAIT_GLOBAL,
    (Step.REPAIRING, "report_result", "invalid_strategy"): Step.EXITING,
    (Step.REPAIRING, "report_result", "failed"): Step.AWAIT_FINAL,
    (Step.DUMPING, "report_result", "ok"): Step.EXITING,
    (Step.DUMPING, "report_result", "dump_ok"): Step.EXITING,
    (Step.DUMPING, "report_result", "invalid_strategy"): Step.EXITING,
    (Step.DUMPING, "report_result", "failed"): Step.EXITING,
    (Step.PAUSE_SENT, "report_result", "failed"): Step.IDLE,
    (Step.PAUSED, "report_result", "failed"): Step.IDLE,
}

#: (callback, outcome) -> next step, for a callback the current step does not expect.
FOLLOW: dict[tuple[str, str], Step | None] = {
    ("report_fault_ranks", ANY): STAY,
    ("report_stop_complete", "ok"): Step.AWAIT_GLOBAL,
    ("report_stop_complete", "failed"): Step.EXITING,
    ("report_strategies", ANY): Step.AWAIT_STRATEGY,
    ("report_result", "ok"): Step.IDLE,
    ("report_result", "dump_ok"): Step.EXITING,
    ("report_result", "downgrade_ok"): Step.IDLE,
    ("report_result", "downgraded"): Step.IDLE,
    ("report_result", "retry_failed"): Step.AWAIT_GLOBAL,
    ("report_result", "invalid_strategy"): Step.EXITING,
    ("report_result", "failed"): Step.AWAIT_FINAL,
}

#: (action, strategy) -> next step for a notify given to the controller; "" = any other.
NOTIFIED: dict[tuple[str, str], Step] = {
    ("stop_train", ""): Step.STOP_SENT,
    ("pause_train", ""): Step.PAUSE_SENT,
    ("on_global_rank", ""): Step.GLOBAL_SENT,
    ("save_and_exit", ""): Step.DUMPING,
    ("change_strategy", "exit"): Step.EXITING,
    ("change_strategy", "dump"): Step.DUMPING,
    ("change_strategy", ""): Step.REPAIRING,
    ("hot switch", ""): Step.SWITCHING,
    ("stop switch", ""): Step.IDLE,
}


def outcome(callback: str, code: int | None = None, strategy: str = "") -> str:
    """The part of a callback's arguments that steers the flow (a key of the tables)."""
    if callback == "report_stop_complete":
        return "ok" if code == 0 else "failed"
    if callback != "report_result":
        return ANY
    if code == 0:
        if strategy in ("dump", "downgrade"):
            return f"{strategy}_ok"
        return "ok"
    if code == 201:
        return "downgraded"
    if code == 405:
        return "retry_failed"
    if code == 499 and strategy == "":  # the controller refused a strategy it had not offered
        return "invalid_strategy"
    return "failed"


class ControllerFlow:
    """The controller's position in its fault flow, as the bridge can know it."""

    def __init__(self, wait_timeout: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 on_desync: Callable[[str, Step], None] | None = None) -> None:
        self.step = Step.IDLE
        self.offered: tuple[str, ...] = ()
        self.answering: str | None = None  # uuid of the cycle the controller is answering
        self.progress = 0  # bumped on every callback
        self.rounds = 0  # bumped on every result: ClusterD may legitimately repeat a signal after one
        self.downgraded = False
        self._since = clock()
        self._clock = clock
        # MINDIO_WAIT_MINDX_TIME as the controller read it at init: its shortest wait.
        self._wait_timeout = wait_timeout
        # Remembered like the controller remembers them (never reset): see wait_limit.
        self.pause_timeout = 0  # the last pause_train timeout given
        self.global_time = 0  # the last on_global_rank time given
        self._strategy_wait_is_plain = False  # the offered list is ZIT's or a hot switch's
        self.expired_wait: float | None = None  # the wait the controller last timed out (for the log)
        # Told (callback, step it arrived at) for every callback the step did not expect.
        self._on_desync = on_desync
        self._desyncs: dict[tuple[str, Step], int] = {}  # how often, for the log line
        self._log_budget = LogBudget(burst=4, window=60.0)

    def _move(self, step: Step) -> None:
        self.step = step
        self._since = self._clock()

    def wait_limit(self) -> float | None:
        """How long the controller waits for ClusterD at the current step (seconds, without
        the margin), or None when it is not waiting for ClusterD (see the module docstring)."""
        wait = self._wait_timeout
        if self.step is Step.AWAIT_STOP:
            return max(self.pause_timeout, wait)
        if self.step is Step.AWAIT_STRATEGY:
            return wait if self._strategy_wait_is_plain else max(self.global_time, wait)
        if self.step in (Step.AWAIT_GLOBAL, Step.AWAIT_FINAL):
            return wait
        return None

    def expire(self) -> bool:
        """Move to EXITING when the controller has certainly timed out its current wait."""
        limit = self.wait_limit()
        if limit is not None and self._clock() - self._since > limit + EXPIRY_MARGIN:
            self.expired_wait = limit
            self._move(Step.EXITING)
            return True
        return False

    # ------------------------------------------------------------------ gate
    def refusal(self, action: str, strategy: str = "", params: str = "") -> str | None:
        """None when the controller expects ``action`` now, else the reason to refuse it."""
        self.expire()
        if action not in ACCEPTS[self.step]:
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

    def notified(self, action: str, uuid: str, strategy: str = "", seconds: int = 0) -> None:
        """Record that ``action`` is being given to the controller for cycle ``uuid``;
        ``seconds`` is the pause timeout or on_global_rank time passed with it (the
        controller's later waits depend on them: ``wait_limit``).

        Called *before* the notify call: the controller may run the next callback on its
        own thread before the notify call even returns here, and that callback must
        already find the flow advanced and tied to this cycle."""
        if uuid:
            self.answering = uuid
        if action == "pause_train":
            self.pause_timeout = seconds
        elif action == "on_global_rank":
            self.global_time = seconds
        step = NOTIFIED.get((action, strategy)) or NOTIFIED.get((action, ""))
        if step is Step.EXITING and self.step is Step.EXITING:
            step = Step.EXITED  # the one exit notice a going-down controller still takes
        if step is not None:
            self._move(step)

    # ------------------------------------------------------------------ callbacks
    def on_callback(self, callback: str, code: int | None = None, strategies: tuple[str, ...] = (),
                    strategy: str = "") -> None:
        """Follow the controller through one of its callbacks (see the tables above).

        Runs on the controller's callback path, so it never raises: a failing
        ``on_desync`` is logged and ignored."""
        self.progress += 1
        if callback not in CALLBACKS:
            return
        how = outcome(callback, code, strategy)
        before = self.step
        key = (before, callback, how)
        expected = key in EXPECTED
        step = EXPECTED[key] if expected else FOLLOW[(callback, how)]
        if callback == "report_strategies":
            self.offered = strategies
            # ZitHandleStrategy (a new fault while downgraded) and a hot switch's
            # StepFinishCallback (its list comes outside a fault flow: "migration", or
            # "exit" alone when its pause failed) wait just MINDIO_WAIT_MINDX_TIME;
            # MindXConfirmStrategy waits at least the global time.
            self._strategy_wait_is_plain = (self.downgraded or before in (Step.IDLE, Step.SWITCHING)
                                            or tuple(strategies) == ("migration",))
        elif callback == "report_result":
            self.rounds += 1  # ClusterD may legitimately repeat a signal after a result
            if how == "downgraded":
                self.downgraded = True
            elif how == "ok" and strategy == "upgrade":
                self.downgraded = False
        if step is not STAY:
            self._move(step)
        if not expected:
            self._desync(callback, before, how)

    def _desync(self, callback: str, step: Step, how: str) -> None:
        # Logged within a budget per (callback, step) (bridge/core/log_budget.py, shared with the
        # signal refusals): a storm of unexpected callbacks must not flood the log from
        # the controller's thread. Every one is still counted through on_desync.
        seen = self._desyncs[(callback, step)] = self._desyncs.get((callback, step), 0) + 1
        suppressed = self._log_budget.allow((callback, step))
        if suppressed is not None:
            log.warning("controller flow desync: %s (%s) arrived at step %s, which does not expect it; "
                        "following the controller to %s (%d time(s) so far)%s",
                        callback, how, step.value, self.step.value, seen, suppressed_note(suppressed))
        if self._on_desync is None:
            return
        try:
            self._on_desync(callback, step)
        except Exception:  # the controller's callback thread must never see an exception
            log.exception("the flow-desync hook failed")
