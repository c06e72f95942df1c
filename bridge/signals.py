"""ClusterD signals -> controller notify calls, in order, de-duplicated, gated.

Signals arrive on the session's stream and are queued here, so reading the stream (and
feeding the keep-alive watchdog) never waits for the controller. One task then handles
them in arrival order and runs each notify call on one dedicated thread: notify calls
release the GIL in C++ but may take a moment, and the event loop must stay free.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import faults as codec
from ._proto import recover_pb2 as pb
from .controller import ControllerHost
from .flow import ControllerFlow
from .hooks import NodeHooks
from .metrics import BridgeMetrics, signal_type_label
from .recorder import NullRecorder

log = logging.getLogger(__name__)

NODE_ACTIONS = frozenset({"fault_nodes_exit", "fault_nodes_restart", "pre exit process"})
LOG_ONLY_ACTIONS = frozenset({"new pod running", "pause_start_agent", "continue_start_agent"})
NOTIFY_ACTIONS = frozenset({"stop_train", "pause_train", "on_global_rank", "change_strategy", "save_and_exit",
                            "hot switch", "stop switch"})
KEEP_ALIVE = "keep-alive"
KILL_MASTER = "killMaster"


def clamp_wait(timeout: int) -> int:
    """on_global_rank's ``time`` must be 1..3600; ClusterD sends 0 for "no minimum"."""
    return min(max(int(timeout), 1), 3600)


class SignalDispatcher:
    def __init__(self, job_id: str, flow: ControllerFlow, controller: ControllerHost, hooks: NodeHooks,
                 metrics: BridgeMetrics, on_kill_master: Callable[[], None], pause_timeout: int = 600) -> None:
        self.job_id = job_id
        self.flow = flow
        self.controller = controller
        self.hooks = hooks
        self.metrics = metrics
        self.on_kill_master = on_kill_master
        self.pause_timeout = pause_timeout
        self._queue: asyncio.Queue[tuple[pb.ProcessManageSignal, bytes, str] | None] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tft-notify")
        self._seen: set[tuple[Any, ...]] = set()
        self._seen_round = -1
        self._stopped = False
        self.observer: Callable[[str], None] = lambda line: None  # the demo's timeline
        self.on_exit_decided: Callable[[], None] = lambda: None  # ClusterD chose exit (no result follows)
        self.recorder: NullRecorder = NullRecorder()  # the flight recorder (bridge/recorder.py): O(1) hooks

    # ------------------------------------------------------------------ intake (session's reader)
    def submit(self, signal: pb.ProcessManageSignal, raw: bytes, token: str) -> None:
        """Filter what needs no controller (other jobs, keep-alives) and queue the rest."""
        self.metrics.signals_received.labels(signal_type_label(signal.signalType)).inc()
        if signal.jobId != self.job_id:
            self._refuse("foreign_job", signal, f"signal for job {signal.jobId!r}")
            return
        if signal.signalType == KEEP_ALIVE:
            return
        self._queue.put_nowait((signal, raw, token))

    def stop(self) -> None:
        """Forward nothing more, not even signals already queued."""
        self._stopped = True
        self._queue.put_nowait(None)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _refuse(self, reason: str, signal: pb.ProcessManageSignal, detail: str = "") -> None:
        self.metrics.signals_refused.labels(reason).inc()
        self.recorder.refused(reason, signal.signalType, signal.uuid, list(signal.actions), detail)
        self.observer(f"ClusterD {signal.signalType} {list(signal.actions)} refused: {reason}")
        log.warning("not forwarding %s %s (uuid %s): %s%s", signal.signalType, list(signal.actions),
                    signal.uuid, reason, f" ({detail})" if detail else "")

    # ------------------------------------------------------------------ dispatch task
    async def run(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None or self._stopped:
                return
            signal, raw, token = item
            try:
                await self._dispatch(signal, raw, token)
            except Exception:  # one bad signal must not end dispatching
                log.exception("failed to dispatch %s", signal.signalType)
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

    async def _dispatch(self, signal: pb.ProcessManageSignal, raw: bytes, token: str) -> None:
        self.recorder.signal(signal.signalType, signal.uuid, list(signal.actions), signal.changeStrategy,
                             signal.extraParams, len(signal.faultRanks))
        if signal.signalType == KILL_MASTER:
            log.warning("ClusterD sent killMaster for job %s: the job is being rescheduled; stopping", self.job_id)
            self.on_kill_master()
            return
        if self._is_duplicate(signal):
            self._refuse("duplicate", signal)
            return
        try:
            faults = codec.decode_signal_faults(raw)
        except ValueError as error:
            self.metrics.bad_inputs.labels("signal_fault_ranks").inc()
            self._refuse("malformed", signal, str(error))
            return
        if not signal.actions:
            self._refuse("no_actions", signal)
            return
        for action in signal.actions:  # in order: never a set
            await self._act(action, signal, faults, token)

    async def _act(self, action: str, signal: pb.ProcessManageSignal, faults: dict[int, int], token: str) -> None:
        if action in NODE_ACTIONS:
            self.recorder.hook(action, await self.hooks.run(action, list(signal.nodeRankIds)))
            return
        if action in LOG_ONLY_ACTIONS:
            log.info("ClusterD action %r (signal %s): nothing for the controller to do", action, signal.signalType)
            return
        strategy, params = signal.changeStrategy, signal.extraParams
        exit_decision = action == "change_strategy" and strategy == "exit" and params != "dump_exit"
        if action == "change_strategy" and strategy == "exit":
            params = ""  # "dump_exit" marks an exit notice; the controller takes no params for exit
        reason = self.flow.refusal(action, strategy, params)
        if reason is None and action in ("hot switch", "stop switch") and not self.controller.has_prepare_action:
            reason = "unsupported_by_controller"
        if reason is None and action not in NOTIFY_ACTIONS:
            reason = "unknown_action"
        if reason is not None:
            self._refuse(reason, signal, f"action {action!r}, controller at {self.flow.step.value}")
            return
        before = self.flow.snapshot()
        self.flow.notified(action, token, strategy)
        started = time.monotonic()
        rc = await asyncio.get_running_loop().run_in_executor(
            self._executor, self._notify, action, faults, int(signal.timeout), strategy, params)
        self.metrics.notifies.labels(action, "ok" if rc == 0 else "refused").inc()
        if rc == 0:
            if exit_decision:
                self.on_exit_decided()
            detail = f" {strategy}" if action == "change_strategy" else f" ({len(faults)} ranks)" if faults else ""
            self.observer(f"ClusterD {signal.signalType} -> controller {action}{detail}")
        else:
            self.flow.restore(before)
            log.error("the controller refused %s (returned %s) for cycle %s", action, rc, signal.uuid)
        self.recorder.notify(action, rc, started, time.monotonic() - started,
                             strategy if action == "change_strategy" else "")

    def _notify(self, action: str, faults: dict[int, int], timeout: int, strategy: str, params: str) -> int:
        """The controller call for one action (spec: mindio-tft-controller.md section 5)."""
        c = self.controller
        if action == "stop_train":
            return c.stop_train(faults, "stop")
        if action == "pause_train":
            return c.stop_train(faults, "pause", timeout or self.pause_timeout)
        if action == "on_global_rank":
            return c.on_global_rank(faults, clamp_wait(timeout))
        if action == "change_strategy":
            return c.change_strategy(strategy, params)
        if action == "save_and_exit":
            return c.dump()
        return c.prepare_action(action, faults)  # hot switch / stop switch
