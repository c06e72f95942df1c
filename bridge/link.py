"""Everything between one controller and ClusterD, built as one object.

A ``Link`` is the ClusterD client, the signal session, the outbox (``relay.py``), the
signal dispatcher (``signals.py``, ClusterD -> controller), the return path
(``reports.py``, controller -> ClusterD) and the hand-off thread between the
controller's callbacks and the event loop. They are built together because none of
them works without the others: the session hands signals to the dispatcher and tells
the outbox when a cycle died; the dispatcher moves the flow the return path binds
reports to; the hand-off feeds the return path. Built whole, no part is ever missing.

Two hosts use it: the daemon (``bridge.daemon.Bridge``), which owns and starts the
controller, and the seed API (``bridge.recover_manager``), whose caller runs the
controller (``ControllerHost(..., external=True)``). ``start()`` and ``stop()`` are the
whole lifecycle of the link; supervising its tasks is the host's business.

Create it inside the running event loop (the hand-off wakes that loop).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from . import realtime
from .affinity import ControllerPin
from .clusterd import ClusterDClient, Session, SessionState, run_logged
from .config import BridgeConfig
from .controller import ControllerHost
from .fastlane import ReportLane
from .flow import ControllerFlow
from .hooks import NodeHooks
from .metrics import BridgeMetrics
from .realtime import LoopPriority
from .recorder import NullRecorder
from .relay import Relay
from .reports import Handoff, ReportFields, ReportPath
from .signals import SignalDispatcher, screen_signal

log = logging.getLogger(__name__)


class Link:
    def __init__(self, config: BridgeConfig, metrics: BridgeMetrics, controller: ControllerHost,
                 flow: ControllerFlow, *, on_kill_master: Callable[[], None],
                 on_state: Callable[[SessionState], None] = lambda state: None,
                 observer: Callable[[str], None] | None = None, recorder: NullRecorder | None = None) -> None:
        self.config = config
        self.recorder = recorder or NullRecorder()  # the flight recorder: every part below reports to it
        self.metrics = metrics
        self.controller = controller
        self.flow = flow
        self._on_state = on_state
        self._observer: Callable[[str], None] = observer or (lambda line: None)
        metrics.bind_controller_switch(controller.connected)
        self.client = ClusterDClient(config.clusterd, metrics, config.controller.realtime_priority,
                                     on_rpc=self.recorder.rpc if self.recorder.enabled else None)
        hooks = NodeHooks(config.hooks.node_command, config.hooks.timeout, metrics)
        self.dispatcher = SignalDispatcher(config.job_id, flow, controller, hooks, metrics,
                                           on_kill_master=on_kill_master,
                                           pause_timeout=config.controller.pause_timeout)
        self.dispatcher.observer = self._observer
        # The session, the outbox, the return path, the report lane and the hand-off need
        # each other; each is given the others' parts it calls at construction, as late-bound
        # calls into this link (all of them exist before the loop runs any of them).
        self.session = Session(config.job_id, self.client, metrics, self.dispatcher.submit, self._session_state,
                               screen=screen_signal, catch_up=lambda: self.lane.flush(),
                               before_subscribe=lambda: self.relay.settle(config.clusterd.rpc_timeout + 1.0))
        metrics.bind_keepalive_clock(lambda: self.session.last_message_at)
        self.relay = Relay(config.job_id, self.client, self.session, metrics, config.outbox_limit,
                           on_drop=self.recorder.dropped,
                           on_outcome_unknown=lambda kind: self.reports.resume.outcome_unknown(kind))
        self.reports = ReportPath(config.job_id, flow, self.relay, metrics, observer, recorder=self.recorder)
        self.dispatcher.on_exit_decided = self.reports.exit_decided
        self.dispatcher.resume = self.reports.resume
        self.dispatcher.repeats = self.reports.repeats
        self.dispatcher.on_orphaned_global_fault = lambda: self.session.request_resubscribe("orphaned_global_fault")
        loop = asyncio.get_running_loop()
        self.lane = ReportLane(config.job_id, self.relay, self.session, self.client, loop, flow,
                               deliver=lambda reports: self.handoff.handle_posted(reports),
                               loop_only_strategies=lambda cycle: self.reports.resume.sends_itself(cycle))
        self.handoff = Handoff(loop, self.reports.handle, config.controller.handoff,
                               pin_cpu=config.controller.pin_cpu, lane=self.lane)
        if (pin := self.handoff.pin) is not None:
            metrics.bind_controller_cpu(lambda: pin.handoff_cpu)
        self.loop_priority = LoopPriority(config.controller.realtime_priority)  # held from start to stop
        if config.controller.realtime_priority > 0:  # off: not exported (no alert for a choice)
            metrics.bind_realtime_threads({
                realtime.LOOP: lambda: self.loop_priority.realtime,
                realtime.REPORT: lambda: self.client.rpc_thread is not None and self.client.rpc_thread.realtime,
            })
        if self.recorder.enabled:
            self.dispatcher.recorder = self.recorder
        self.tasks: dict[str, asyncio.Task[Any]] = {}

    @property
    def sink(self) -> Callable[[ReportFields], None]:
        """Where the controller's callbacks put their arguments (O(1), see Handoff)."""
        return self.handoff.put

    @property
    def controller_pin(self) -> ControllerPin | None:
        """What pins an owned controller's callback thread to one CPU with the hand-off
        thread (bridge/affinity.py), for its callbacks; None when off."""
        pin = self.handoff.pin
        return pin if pin is not None and pin.enabled else None

    async def start(self) -> None:
        """Open the channel and start the session, the dispatcher and the outbox."""
        self.loop_priority.hold()
        await self.client.open()
        for name, body in (("session", self.session.run()), ("dispatcher", self.dispatcher.run()),
                           ("relay", self.relay.run())):
            self.tasks[name] = spawn(name, body)

    async def stop(self, before_destroy: Callable[[], None] = lambda: None) -> None:
        """Hand the controller no new action, destroy an owned controller off its own
        thread (``controller.destroy_timeout``) *while the session and the outbox still
        run*, hand every report it gave on to the outbox, drain the outbox for a moment
        (at most one RPC deadline, 5 s) while a stream is live, then end the session and
        close everything. ``before_destroy`` runs right before the destroy (the daemon
        stops its other work there).

        Why the destroy comes before the session ends: the controller still calls back
        while it is being destroyed (docs/mindio-controller.md section 7) -- destroyed
        during the recover wait, the real one reports ``report_result`` 406 while its
        destroy blocks. With the outbox stopped first that report was dropped at
        shutdown and ClusterD waited out its own timeout for a result the controller had
        given. Reports queued before the stop go out during the destroy just the same
        (the destroy runs on a thread; the loop keeps delivering). The whole stays within
        ``daemon.stop_budget``: the destroy, then one drain."""
        try:
            await self._stop(before_destroy)
        finally:
            self.loop_priority.release()

    async def _stop(self, before_destroy: Callable[[], None]) -> None:
        self.dispatcher.stop()
        before_destroy()
        if self.controller.started and self.controller.owned:
            await asyncio.to_thread(self.controller.destroy, self.config.controller.destroy_timeout)
        # Every report the controller put so far reaches the outbox before the drain looks
        # at it (a callback during the destroy may still be waiting in the hand-off, behind
        # a report lane call the hand-off thread makes: that call's deadline bounds it).
        await asyncio.to_thread(self.handoff.close, 2.0 + self.config.clusterd.rpc_timeout)
        self.lane.flush()  # and those the report lane still holds
        if self.session.live.is_set() and len(self.relay):
            await self.relay.drain(timeout=min(5.0, self.config.clusterd.rpc_timeout))
        self.session.stop()
        self.relay.stop()
        await finish(self.tasks.values())
        self.dispatcher.close()
        await self.client.close()

    def _session_state(self, state: SessionState) -> None:
        self._observer(f"ClusterD session: {state.value}")
        self.recorder.session(state.value)
        self.reports.on_session_state(state)
        self._on_state(state)


def spawn(name: str, body: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """A background task whose failure is logged when it happens."""
    return asyncio.create_task(run_logged(name, body), name=f"tft-bridge-{name}")


async def finish(tasks: Any, grace: float = 2.0) -> None:
    """Give each task (already told to stop) ``grace`` seconds to end, then cancel it."""
    tasks = list(tasks)
    for task in tasks:
        try:
            await asyncio.wait_for(asyncio.shield(task), grace)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            task.cancel()
        except Exception:  # noqa: BLE001 - already logged by run_logged
            pass
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
