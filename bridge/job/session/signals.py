"""ClusterD's signals -> the controller's notify calls: screened, de-duplicated, gated, in order.

The session's reader screens each signal once (``screen_signal``: well-formed, fault
ranks decoded) and hands the ``Screened`` record to ``SignalDispatcher.submit``; one task
handles them in arrival order and makes each notify on the event loop, or on
``tft-notify`` once a notify took longer than ``INLINE_NOTIFY_LIMIT`` (figures:
docs/performance.md). The peer facts behind the rules are in docs/architecture.md
("Invariants"), docs/mindio-controller.md (section 2) and docs/clusterd.md (sections 5, 7):

* a notify's arguments are checked and clamped before the flow moves
  (``notify_arguments``); every notify failure, a non-zero return or an exception,
  puts the flow back;
* one signal has a bounded cost: more than ``MAX_ACTIONS`` actions is refused whole
  (``too_many_actions``), an unknown action is counted as ``unknown_action``, and one
  signal's refusals make one log line, within a budget (``bridge/core/log_budget.py``);
* the orphaned globalFault (``is_orphaned_global_fault``: the leftover of a cycle a
  stream reset aborted) is refused, runs no node hook, and asks the cycle state for a
  new subscription (reason ``orphaned_global_fault``), which leaves ClusterD idle;
* ClusterD's ``stop switch`` ends the switch in the flow and is withheld from the
  controller (``STOP_SWITCH``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from bridge import faults as codec
from bridge._proto import recover_pb2 as pb
from bridge.core.config import PAUSE_DEFAULT, PAUSE_MAX
from bridge.job.host.controller import ControllerHost
from bridge.job.reports.controller_flow import ControllerFlow, Step
from bridge.job.session.node_hooks import HookSignal, NodeHooks
from bridge.core.log_budget import LogBudget, suppressed_note
from bridge.job.metrics import SIGNAL_TYPES, BridgeMetrics, signal_type_label
from bridge.job.recorder import NullRecorder
from bridge.job.session.repeated_cycles import RepeatedCycles
from bridge.job.session.resume import RESUMED, CycleResume

log = logging.getLogger(__name__)

NODE_ACTIONS = frozenset({"fault_nodes_exit", "fault_nodes_restart", "pre exit process"})
#: Controller actions that also ask the nodes of ``nodeRankIds`` to act: TaskD's recover
#: plugin exits those nodes' agents on saveAndExit and on a recover that is not in place
#: (for recover-in-place the signal's own ``fault_nodes_restart`` does it).
NODE_HOOKED_ACTIONS = frozenset({"save_and_exit", "change_strategy"})
RECOVER_IN_PLACE = "recover-in-place"  # ClusterD's extraParams of an in-place recover
#: ClusterD's ``stop switch`` ends a hot switch whose backup pod never ran, so the
#: replacement ranks never registered and the controller is still in NORMAL. There its
#: MindXNotifyStopSwitch only latches the one wake-up slot (docs/mindio-controller.md
#: section 5): the next fault flow the controller detects itself then finds the slot
#: set, reads the stop switch as its stop_train and exits, killing the job. Not told, the
#: controller keeps the switch's ranks pending, which changes nothing in NORMAL, and
#: forgets them when it next enters NORMAL (InitializeVariables). So the bridge ends the
#: switch in its flow and withholds the notify (``tft_bridge_controller_notifies_total
#: {action="stop switch",result="withheld"}``). TaskD forwards it.
STOP_SWITCH = "stop switch"
LOG_ONLY_ACTIONS = frozenset({"new pod running", "pause_start_agent", "continue_start_agent"})
NOTIFY_ACTIONS = frozenset({"stop_train", "pause_train", "on_global_rank", "change_strategy", "save_and_exit",
                            "hot switch", "stop switch"})
KEEP_ALIVE = "keep-alive"
KILL_MASTER = "killMaster"
KNOWN_ACTIONS = NODE_ACTIONS | LOG_ONLY_ACTIONS | NOTIFY_ACTIONS
#: ClusterD's signal types (docs/clusterd.md section 5): any other is not a real signal.
KNOWN_SIGNAL_TYPES = frozenset(SIGNAL_TYPES)
#: Real signals carry at most two actions (docs/clusterd.md section 5); a few more are
#: tolerated for actions a newer ClusterD may add, anything beyond is not a real signal.
MAX_ACTIONS = 8
#: The controller's upper bound for on_global_rank's ``time`` (and MINDIO_WAIT_MINDX_TIME).
WAIT_MAX = 3600
#: A pause longer than this is clamped: the controller remembers the last pause timeout
#: as its minimum wait for the next stop_train (docs/mindio-controller.md section 6), so
#: a huge one would leave a later real fault waiting that long. ClusterD sends 0 or 900;
#: the ceiling is TaskD's own for the pause it derives from HCCL_CONNECT_TIMEOUT, so the
#: bridge never cuts short a pause TaskD would have given.
PAUSE_TIMEOUT_MAX = PAUSE_MAX
#: downgrade/upgrade params: 1..1023 bytes, else the controller returns 1.
PARAMS_MAX_BYTES = 1023
PARAMS_STRATEGIES = frozenset({"downgrade", "upgrade"})
#: Actions whose notify takes the signal's fault ranks.
RANK_ACTIONS = frozenset({"stop_train", "on_global_rank", "hot switch", "stop switch"})
#: A notify made on the event loop that takes longer than this sends every later one to
#: the notify thread (module docstring): a few keep-alive-free milliseconds, no more.
INLINE_NOTIFY_LIMIT = 0.02
SHOWN_ACTIONS = 4  # how many actions a log line or a record names


def clamp_wait(timeout: int) -> int:
    """on_global_rank's ``time`` must be 1..3600; ClusterD sends 0 for "no minimum"."""
    return min(max(int(timeout), 1), WAIT_MAX)


def shown_actions(signal: pb.ProcessManageSignal) -> list[str]:
    """The actions as a log line or a record names them: at most ``SHOWN_ACTIONS``,
    then how many more, so a huge signal cannot make a huge line."""
    actions = signal.actions
    if len(actions) <= SHOWN_ACTIONS:
        return list(actions)
    return [*actions[:SHOWN_ACTIONS], f"... {len(actions)} actions in all"]


def asks_nodes_to_exit(action: str, signal: pb.ProcessManageSignal) -> bool:
    """True when a forwarded controller action also asks its nodes to act
    (``NODE_HOOKED_ACTIONS``): saveAndExit, and a recover that is not in place."""
    if action == "save_and_exit":
        return True
    return signal.changeStrategy == "recover" and signal.extraParams != RECOVER_IN_PLACE


def is_orphaned_global_fault(signal: pb.ProcessManageSignal) -> bool:
    """The globalFault ClusterD sends on a new stream for a cycle a reset aborted
    (docs/clusterd.md section 7): on_global_rank with no uuid, no fault ranks and no node
    ranks. Every signal of a real cycle carries its uuid, so this one belongs to none."""
    return (not signal.uuid and "on_global_rank" in signal.actions and not signal.faultRanks
            and not signal.nodeRankIds)


class Screened(NamedTuple):
    """A signal as the session read it, screened once (``screen_signal``); the
    dispatcher acts on this, never on the signal's bytes again."""

    signal: pb.ProcessManageSignal
    token: str  # the cycle it belongs to: its uuid, or the stream's token for uuid-less signals
    faults: dict[int, int]  # its fault ranks, decoded ({} when not decoded or malformed)
    problem: tuple[str, str] | None  # ``signal_problem``: refused whole, before anything else
    fault_error: str  # why its fault ranks do not decode ("" when they do): refused as malformed
    adoptable: bool  # may become the running cycle: well-formed, with a known action

    @property
    def refusal(self) -> tuple[str, str] | None:
        """The first reason the signal must touch neither the controller nor the cycle."""
        if self.problem is not None:
            return self.problem
        if self.fault_error:
            return "malformed", self.fault_error
        if not self.adoptable:
            return "unknown_action", f"none of its {len(self.signal.actions)} action(s) is known"
        return None


def screen_signal(signal: pb.ProcessManageSignal, raw: bytes, token: str) -> Screened:
    """``signal`` (``raw``: its bytes) checked and its fault ranks decoded, once, on the
    session's reader before the signal may touch cycle tracking (a garbage globalFault
    adopted as the cycle got the real result dropped as no_live_cycle). Keep-alives and
    killMaster carry nothing to decode. Never raises."""
    problem = signal_problem(signal)
    if problem is not None or signal.signalType in (KEEP_ALIVE, KILL_MASTER):
        return Screened(signal, token, {}, problem, "", problem is None)
    try:
        faults = codec.decode_signal_faults(raw)
    except ValueError as error:
        return Screened(signal, token, {}, None, str(error), False)
    known = any(action in KNOWN_ACTIONS for action in signal.actions)
    return Screened(signal, token, faults, None, "", known)


def signal_problem(signal: pb.ProcessManageSignal) -> tuple[str, str] | None:
    """``(refusal reason, detail)`` when ``signal`` must reach neither the controller nor
    cycle tracking, else None. Needs no controller, flow or fault decoding (the fault
    ranks are checked when decoded), so the session may call it on every signal."""
    if signal.signalType in (KEEP_ALIVE, KILL_MASTER):
        return None
    count = len(signal.actions)
    if count > MAX_ACTIONS:
        return "too_many_actions", f"{count} actions; real signals carry at most 2, the bridge takes {MAX_ACTIONS}"
    if count == 0:
        return "no_actions", ""
    if signal.signalType not in KNOWN_SIGNAL_TYPES:
        return "malformed", f"unknown signal type {signal.signalType[:64]!r}"
    if is_orphaned_global_fault(signal):
        return "orphaned_global_fault", ("globalFault with no uuid and no fault ranks: the leftover of a cycle "
                                         "a stream reset aborted; it belongs to no cycle")
    return None


class BadArgument(ValueError):
    """A notify argument the controller would refuse or crash on, and that no clamp fixes."""


@dataclass(frozen=True)
class NotifyArguments:
    """What one notify call gets, checked (``notify_arguments``); ``notes`` says what was
    clamped or dropped, for the log and ``bad_inputs``."""

    faults: dict[int, int]
    timeout: int  # pause: seconds; on_global_rank: the minimum strategy wait
    strategy: str
    params: str
    notes: tuple[str, ...] = ()


def notify_arguments(action: str, faults: dict[int, int], timeout: int, strategy: str, params: str, *,
                     world_size: int | None, pause_default: int) -> NotifyArguments:
    """The arguments of ``action``'s notify call, inside the ranges the controller takes
    (docs/mindio-controller.md section 2), or ``BadArgument``. Runs before the flow moves.

    * fault ranks outside ``[0, world_size)`` are dropped (the controller would return 1
      after merging the entries before them); the others still go through. With
      ``world_size`` None (unknown: a controller the caller started, whose world size
      the real API does not expose) nothing is dropped: a guess drops ranks ClusterD
      named, and a controller told too few ranks repairs a rank from a peer the node
      agent restarted under it and hangs (docs/mindio-controller.md section 4). A rank
      the controller then refuses makes its notify return 1, which is logged and
      counted like any refused notify;
    * pause: negative is refused (no pause length means it), 0 is the configured default
      (the controller has no default: ``None`` raises), above ``PAUSE_TIMEOUT_MAX`` clamped;
    * on_global_rank: 0 means "no minimum" (1); otherwise clamped to 1..3600;
    * downgrade/upgrade: params must be 1..1023 bytes (no clamp: cutting ClusterD's JSON
      would hand the controller a different instruction).
    """
    notes: list[str] = []
    if action in RANK_ACTIONS and world_size is not None:
        # One max() in C: the common all-valid map costs no Python-level loop on the
        # event loop; only a map with bad ranks is walked. The codec yields no negative rank (ASCII digits only); the walk checks both.
        bad = [rank for rank in faults if not 0 <= rank < world_size] \
            if faults and max(faults) >= world_size else []
        if bad:
            faults = {rank: kind for rank, kind in faults.items() if 0 <= rank < world_size}
            notes.append(f"dropped {len(bad)} fault rank(s) outside 0..{world_size - 1} "
                         f"(e.g. {sorted(bad)[:3]})")
    elif action not in RANK_ACTIONS:
        faults = {}
    if action == "pause_train":
        if timeout < 0:
            raise BadArgument(f"pause timeout {timeout} s is negative")
        if timeout == 0:
            timeout = pause_default
        elif timeout > PAUSE_TIMEOUT_MAX:
            notes.append(f"pause timeout {timeout} s clamped to {PAUSE_TIMEOUT_MAX} s")
            timeout = PAUSE_TIMEOUT_MAX
    elif action == "on_global_rank":
        clamped = clamp_wait(timeout)
        if timeout and clamped != timeout:
            notes.append(f"on_global_rank time {timeout} s clamped to {clamped} s (the controller takes 1..{WAIT_MAX})")
        timeout = clamped
    else:
        timeout = 0
    if action == "change_strategy" and strategy in PARAMS_STRATEGIES:
        size = len(params.encode())
        if not 0 < size <= PARAMS_MAX_BYTES:
            raise BadArgument(f"{strategy} needs params of 1..{PARAMS_MAX_BYTES} bytes, got {size}")
    return NotifyArguments(faults, timeout, strategy, params, tuple(notes))


class CycleControl(Protocol):
    """What the dispatcher tells the owner of the cycle state (``CycleState``)."""

    def answering_changed(self) -> None: ...

    def request_resubscribe(self, reason: str) -> None: ...


class ReportSide(Protocol):
    """What the dispatcher uses of the report side's bookkeeping (``ledger.ReportPath``)."""

    resume: CycleResume  # answers a restarted ClusterD's new cycle (resume.py)
    repeats: RepeatedCycles  # tells a repeat of a succeeded retry cycle (repeated_cycles.py)

    def exit_decided(self) -> None: ...


class SignalDispatcher:
    """ClusterD's signals -> the controller's notify calls, on the event loop: ``submit``
    on the session's reader, the rest in the ``run`` task, one signal at a time in
    arrival order. Before each notify it moves the flow and tells ``cycles``
    (``answering_changed``), after a refused or failed one it undoes the move and tells
    it again; a refused orphaned globalFault asks ``cycles`` for a new subscription."""

    def __init__(self, job_id: str, flow: ControllerFlow, controller: ControllerHost, hooks: NodeHooks,
                 metrics: BridgeMetrics, cycles: CycleControl, reports: ReportSide | None, *,
                 on_kill_master: Callable[[], None], pause_timeout: int = PAUSE_DEFAULT,
                 observer: Callable[[str], None] | None = None, recorder: NullRecorder | None = None) -> None:
        """``reports`` None: no report path (a test's). ``on_kill_master``: ClusterD
        reschedules the job (the daemon stops). ``pause_timeout``: a pause's default
        length. ``observer``: the demo's timeline; ``recorder``: the flight recorder."""
        self.job_id = job_id
        self.flow = flow
        self.controller = controller
        self.hooks = hooks
        self.metrics = metrics
        self._cycles = cycles
        self.on_kill_master = on_kill_master
        self.pause_timeout = pause_timeout
        self._queue: asyncio.Queue[Screened | None] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tft-notify")
        self.notify_inline = True  # False: on the tft-notify thread (after a slow notify, or the A/B bench)
        self._seen: set[tuple[Any, ...]] = set()
        self._seen_round = -1
        self._stopped = False
        self._log_budget = LogBudget(burst=5, window=60.0)  # refusal lines, per reason
        self.observer: Callable[[str], None] = observer or (lambda line: None)  # the demo's timeline
        self.recorder: NullRecorder = recorder or NullRecorder()  # the flight recorder (bridge/job/recorder/): O(1) hooks
        self.resume = reports.resume if reports is not None else None
        self.repeats = reports.repeats if reports is not None else None
        self._reports = reports
        self._exit_decided_in = ""  # the cycle token whose exit decision was counted

    # ------------------------------------------------------------------ intake (session's reader)
    def submit(self, screened: Screened) -> None:
        """Filter what needs no controller (other jobs, keep-alives) and queue the rest."""
        signal = screened.signal
        self.metrics.signals_received.labels(signal_type_label(signal.signalType)).inc()
        if signal.jobId != self.job_id:
            self._refuse("foreign_job", signal, f"signal for job {signal.jobId!r}")
            return
        if signal.signalType == KEEP_ALIVE:
            return
        self._queue.put_nowait(screened)

    def stop(self) -> None:
        """Forward nothing more, not even signals already queued."""
        self._stopped = True
        self._queue.put_nowait(None)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _refuse(self, reason: str, signal: pb.ProcessManageSignal, detail: str = "") -> None:
        """A whole signal not forwarded: counted each time, logged within the budget."""
        self.metrics.signals_refused.labels(reason).inc()
        actions = shown_actions(signal)
        self.recorder.refused(reason, signal.signalType, signal.uuid, actions, detail)
        self.observer(f"ClusterD {signal.signalType} {actions} refused: {reason}")
        suppressed = self._log_budget.allow(reason)
        if suppressed is not None:
            log.warning("not forwarding %s %s (uuid %s): %s%s%s", signal.signalType, actions,
                        signal.uuid, reason, f" ({detail})" if detail else "", suppressed_note(suppressed))

    def _refuse_actions(self, signal: pb.ProcessManageSignal, refused: list[tuple[str, str]], step: str) -> None:
        """Some actions of one signal not forwarded: each counted, one line for the signal."""
        for action, reason in refused:
            self.metrics.signals_refused.labels(reason).inc()
            self.recorder.refused(reason, signal.signalType, signal.uuid, [action], f"controller at {step}")
            self.observer(f"ClusterD {signal.signalType} [{action!r}] refused: {reason}")
        reasons = sorted({reason for _, reason in refused})
        suppressed = self._log_budget.allow(tuple(reasons))
        if suppressed is not None:
            listed = ", ".join(f"{action!r}: {reason}" for action, reason in refused[:SHOWN_ACTIONS])
            more = f", and {len(refused) - SHOWN_ACTIONS} more" if len(refused) > SHOWN_ACTIONS else ""
            log.warning("not forwarding %d of %d action(s) of %s (uuid %s), controller at %s: %s%s%s",
                        len(refused), len(signal.actions), signal.signalType, signal.uuid, step, listed, more,
                        suppressed_note(suppressed))

    # ------------------------------------------------------------------ dispatch task
    async def run(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None or self._stopped:
                return
            try:
                await self._dispatch(item)
            except Exception:  # one bad signal must not end dispatching
                log.exception("failed to dispatch %s", item.signal.signalType)
                self.metrics.bad_inputs.labels("signal_dispatch").inc()

    def _fingerprint(self, signal: pb.ProcessManageSignal) -> tuple[Any, ...]:
        return (signal.uuid, signal.signalType, tuple(signal.actions), signal.changeStrategy, signal.extraParams,
                signal.timeout, tuple(signal.nodeRankIds), tuple((f.rankId, f.faultType) for f in signal.faultRanks))

    def _is_duplicate(self, signal: pb.ProcessManageSignal) -> bool:
        """True for a repeat of a signal already handled in this round of the flow.

        After the controller reports a result, an identical signal can be legitimate
        (ClusterD sends globalFault again after a failed retry), so the memory starts
        afresh; anything the controller does not expect then is refused by the flow gate.
        """
        if self.flow.rounds != self._seen_round or len(self._seen) > 1024:
            self._seen.clear()
            self._seen_round = self.flow.rounds
        key = self._fingerprint(signal)
        if key in self._seen:
            return True
        self._seen.add(key)
        return False

    async def _dispatch(self, screened: Screened) -> None:
        signal, token = screened.signal, screened.token
        self.recorder.signal(signal.signalType, signal.uuid, shown_actions(signal), signal.changeStrategy,
                             signal.extraParams, len(signal.faultRanks))
        if signal.signalType == KILL_MASTER:
            log.warning("ClusterD sent killMaster for job %s: the job is being rescheduled; stopping", self.job_id)
            self.on_kill_master()
            return
        problem = screened.problem
        if problem is not None:
            self._refuse(problem[0], signal, problem[1])
            if problem[0] == "orphaned_global_fault":
                # ClusterD now waits in a cycle nobody answers: a reset leaves it idle (module docstring)
                self._cycles.request_resubscribe("orphaned_global_fault")
            return
        if self._is_duplicate(signal):
            self._refuse("duplicate", signal)
            return
        if screened.fault_error:
            self.metrics.bad_inputs.labels("signal_fault_ranks").inc()
            self._refuse("malformed", signal, screened.fault_error)
            return
        faults = screened.faults
        refused: list[tuple[str, str]] = []
        for action in signal.actions:  # in order: never a set
            reason = await self._act(action, signal, faults, token)
            if reason is not None:
                refused.append((action, reason))
            elif action in NODE_HOOKED_ACTIONS and asks_nodes_to_exit(action, signal):
                await self._run_hook(action, signal, faults)
        if refused:
            self._refuse_actions(signal, refused, self.flow.step.value)

    async def _act(self, action: str, signal: pb.ProcessManageSignal, faults: dict[int, int],
                   token: str) -> str | None:
        """Carry out one action; the reason when it was refused (the caller counts and logs)."""
        if action in NODE_ACTIONS:
            await self._run_hook(action, signal, faults)
            return None
        if action in LOG_ONLY_ACTIONS:
            log.info("ClusterD action %r (signal %s): nothing for the controller to do", action, signal.signalType)
            return None
        if action not in NOTIFY_ACTIONS:
            return "unknown_action"
        if self.resume is not None:  # a restarted ClusterD's new cycle, for a controller already stopped
            resumed = self.resume.intercept(action, faults, token)
            if resumed == RESUMED:
                self.observer(f"ClusterD {signal.signalType} [{action}] -> answered by the bridge (resumed cycle)")
                return None
            if resumed is not None:
                return resumed
        strategy, params = signal.changeStrategy, signal.extraParams
        # The exit notice after a dump/exit is marked with extraParams "dump_exit"; ClusterD
        # v7.0.RC1 has no extraParams, so there a second exit of the same cycle is the notice.
        exit_decision = action == "change_strategy" and strategy == "exit" and params != "dump_exit" \
            and token != self._exit_decided_in
        if action == "change_strategy" and strategy == "exit":
            params = ""  # "dump_exit" marks an exit notice; the controller takes no params for exit
        reason = self.flow.refusal(action, strategy, params)
        if reason is None and action in ("hot switch", "stop switch") and not self.controller.has_prepare_action:
            reason = "unsupported_by_controller"
        if reason is not None:
            return reason
        if action == STOP_SWITCH:
            self._withhold_stop_switch(signal, token)
            return None
        try:
            args = notify_arguments(action, faults, int(signal.timeout), strategy, params,
                                    world_size=self.controller.world_size, pause_default=self.pause_timeout)
        except BadArgument as error:
            self.metrics.bad_inputs.labels("signal_argument").inc()
            suppressed = self._log_budget.allow("bad_argument: detail")
            if suppressed is not None:
                log.warning("not forwarding %s of %s (uuid %s): %s%s", action, signal.signalType, signal.uuid, error,
                            suppressed_note(suppressed))
            return "bad_argument"
        if args.notes:
            self.metrics.bad_inputs.labels("signal_argument").inc()
            suppressed = self._log_budget.allow("corrected_arguments")
            if suppressed is not None:
                log.warning("%s of %s (uuid %s) forwarded with corrected arguments: %s%s", action, signal.signalType,
                            signal.uuid, "; ".join(args.notes), suppressed_note(suppressed))
        if action == "stop_train" and self.repeats is not None and self.flow.step is Step.IDLE:
            self.repeats.clusterd_stop(args.faults)  # ClusterD starts the cycle: a repeat of a success?
        before = self.flow.snapshot()
        self.flow.notified(action, token, strategy, seconds=args.timeout)
        self._cycles.answering_changed()  # before the notify: the controller answers only after it
        started = time.monotonic()
        try:
            if self.notify_inline:
                rc = self._notify(action, args)
                self._check_inline_cost(action, time.monotonic() - started)
            else:
                rc = await asyncio.get_running_loop().run_in_executor(self._executor, self._notify, action, args)
        except Exception as error:  # a notify that raised changed nothing in the controller: undo the move
            self.flow.restore(before)
            self._cycles.answering_changed()
            self.metrics.notifies.labels(action, "error").inc()
            log.error("the controller's %s notify raised %s: %s (cycle %s); the flow is back at %s",
                      action, type(error).__name__, error, signal.uuid, self.flow.step.value)
            self.recorder.notify(action, -1, started, time.monotonic() - started,
                                 strategy if action == "change_strategy" else "")
            return None
        self.metrics.notifies.labels(action, "ok" if rc == 0 else "refused").inc()
        if rc == 0:
            if exit_decision:
                self._exit_decided_in = token
                if self._reports is not None:
                    self._reports.exit_decided()  # ClusterD chose exit: no result follows
            detail = f" {strategy}" if action == "change_strategy" else \
                f" ({len(args.faults)} ranks)" if args.faults else ""
            self.observer(f"ClusterD {signal.signalType} -> controller {action}{detail}")
        else:
            self.flow.restore(before)
            self._cycles.answering_changed()
            log.error("the controller refused %s (returned %s) for cycle %s", action, rc, signal.uuid)
        self.recorder.notify(action, rc, started, time.monotonic() - started,
                             strategy if action == "change_strategy" else "")
        return None

    def _withhold_stop_switch(self, signal: pb.ProcessManageSignal, token: str) -> None:
        """ClusterD gave up its hot switch (``STOP_SWITCH``): the switch is over
        for the flow, and the controller is not told."""
        self.flow.notified(STOP_SWITCH, token)
        self._cycles.answering_changed()
        self.metrics.notifies.labels(STOP_SWITCH, "withheld").inc()  # the signal itself is in the recorder
        self.observer(f"ClusterD {signal.signalType} [stop switch] -> withheld from the controller")
        log.info("ClusterD stopped its hot switch (the backup pod did not start); not telling the controller, "
                 "which would keep the notice in its wake-up slot and end the next fault flow it detects: "
                 "it forgets the switch itself at its next fault flow")

    async def _run_hook(self, action: str, signal: pb.ProcessManageSignal, faults: dict[int, int]) -> None:
        """The node hook for ``action``, given the whole signal (bridge/job/session/node_hooks.py)."""
        context = HookSignal(self.job_id, signal.uuid, signal.signalType, tuple(signal.actions),
                             signal.changeStrategy, signal.extraParams, faults)
        self.recorder.hook(action, await self.hooks.run(action, list(signal.nodeRankIds), context))

    def _check_inline_cost(self, action: str, seconds: float) -> None:
        """A notify that held the loop too long moves every later one to the notify thread."""
        if seconds > INLINE_NOTIFY_LIMIT:
            self.notify_inline = False
            log.warning("the controller's %s notify took %.0f ms on the event loop: later notify calls run on "
                        "a thread of their own", action, seconds * 1e3)

    def _notify(self, action: str, args: NotifyArguments) -> int:
        """The controller call for one action (docs/mindio-controller.md section 10)."""
        c = self.controller
        if action == "stop_train":
            return c.stop_train(args.faults, "stop")
        if action == "pause_train":
            return c.stop_train(args.faults, "pause", args.timeout)
        if action == "on_global_rank":
            return c.on_global_rank(args.faults, args.timeout)
        if action == "change_strategy":
            return c.change_strategy(args.strategy, args.params)
        if action == "save_and_exit":
            return c.dump()
        return c.prepare_action(action, args.faults)  # hot switch / stop switch
