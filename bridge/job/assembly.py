"""Everything between one controller and ClusterD, built as one object.

A ``Link`` is the ClusterD client, the signal session, the signal dispatcher
(``signals.py``, ClusterD -> controller), the report wire (``wire.py``: the thread that
owns the outbox and the report channel, fed by the controller's callbacks) and the return
path's bookkeeping (``reports.py``). They are built together because none of them works
without the others: the session hands signals to the dispatcher; the dispatcher moves
the flow whose answering cycle the wire binds reports to; the wire hands each report to
the bookkeeping. Built whole, no part is ever missing.

What the wire needs of the loop's state it gets as one immutable snapshot
(``wire.Cycles``), published by ``_publish`` whenever the session's stream or cycle, the
flow's answering cycle or the resume's rebound cycle changed, and before every notify
(the controller answers only after one).

Two hosts use it: the daemon (``bridge.job.daemon.Bridge``), which owns and starts the
controller, and the seed API (``bridge.recover_manager``), whose caller runs the
controller (``ControllerHost(..., external=True)``). ``start()`` and ``stop()`` are the
whole lifecycle of the link; supervising its tasks is the host's business.

Create it inside the running event loop (the wire posts to that loop).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from bridge.job.sched import realtime
from bridge.job.sched.affinity import ControllerPin
from bridge.core.backoff import Backoff
from bridge.job.session.clusterd import ClusterDClient, Session, SessionState, report_channel, run_logged
from bridge.core.config import BridgeConfig
from bridge.job.host.controller import ControllerHost
from bridge.job.reports.controller_flow import ControllerFlow
from bridge.job.session.node_hooks import NodeHooks
from bridge.job.metrics import BridgeMetrics
from bridge.job.sched.realtime import LoopPriority
from bridge.job.recorder import NullRecorder
from bridge.job.reports.refault import FaultCentreTimes
from bridge.job.reports.ledger import ReportPath
from bridge.job.reports.kinds import ReportFields
from bridge.job.session.signals import SignalDispatcher, screen_signal
from bridge.job.reports.relay import Cycles, Taken, Wire

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
        # The session, the wire, the bookkeeping and the dispatcher need each other; each is
        # given the others' parts it calls at construction, the ones built after it as
        # late-bound calls into this link (all of them exist before the loop runs any).
        self.wire = Wire(config.job_id, report_channel(config.clusterd), asyncio.get_running_loop(), self, metrics,
                         rpc_timeout=config.clusterd.rpc_timeout,
                         backoff=Backoff(config.clusterd.reconnect_initial, config.clusterd.reconnect_max),
                         limit=config.outbox_limit, realtime_priority=config.controller.realtime_priority,
                         pin=ControllerPin(config.controller.pin_cpu))
        self.reports = ReportPath(config.job_id, flow, self.wire, metrics, observer, recorder=self.recorder,
                                  fill=self.wire.fill, resubscribe=lambda reason: self.session.request_resubscribe(reason),
                                  publish=self._publish,
                                  fault_centre=FaultCentreTimes(config.clusterd.retry_record_hold,
                                                                config.clusterd.fault_centre_period),
                                  cycle_running=lambda: self.session.current_uuid is not None,
                                  stream_end_reason=lambda: self.session.end_reason)
        self.dispatcher = SignalDispatcher(
            config.job_id, PublishingFlow(flow, lambda: self._publish()), controller, hooks, metrics,  # type: ignore[arg-type]
            on_kill_master=on_kill_master, resume=self.reports.resume, repeats=self.reports.repeats,
            on_exit_decided=self.reports.exit_decided,
            on_orphaned_global_fault=lambda: self.session.request_resubscribe("orphaned_global_fault"),
            pause_timeout=config.controller.pause_timeout, observer=self._observer,
            recorder=self.recorder if self.recorder.enabled else None)
        self.session = Session(config.job_id, self.client, metrics, self.dispatcher.submit, self._session_state,
                               screen=screen_signal, catch_up=self.wire.catch_up,
                               before_subscribe=lambda: self.wire.settle(config.clusterd.rpc_timeout + 1.0),
                               on_cycles=self._publish)
        metrics.bind_keepalive_clock(lambda: self.session.last_message_at)
        if (pin := self.wire.pin).enabled:
            metrics.bind_controller_cpu(lambda: pin.handoff_cpu)
        self.loop_priority = LoopPriority(config.controller.realtime_priority)  # held from start to stop
        if config.controller.realtime_priority > 0:  # off: not exported (no alert for a choice)
            metrics.bind_realtime_threads({
                realtime.LOOP: lambda: self.loop_priority.realtime,
                realtime.REPORT: lambda: self.wire.realtime,
            })
        self.tasks: dict[str, asyncio.Task[Any]] = {}

    @property
    def sink(self) -> Callable[[ReportFields], None]:
        """Where the controller's callbacks put their arguments: the wire's inbox (one C
        call that keeps the GIL)."""
        return self.wire.put

    @property
    def controller_pin(self) -> ControllerPin | None:
        """What pins an owned controller's callback thread to one CPU with the wire
        (bridge/job/sched/affinity.py), for its callbacks; None when off."""
        pin = self.wire.pin
        return pin if pin.enabled else None

    # ------------------------------------------------------------------ the wire's listener (on the loop)
    def taken(self, reports: list[Taken]) -> None:
        self.reports.taken(reports)

    def dropped(self, kind: str, cycle: str | None, reason: str) -> None:
        self.recorder.dropped(kind, cycle, reason)

    def outcome_unknown(self, kind: str) -> None:
        self.reports.resume.outcome_unknown(kind)

    def faults_delivered(self, faults: dict[int, int], at: float) -> None:
        self.reports.faults_delivered(faults, at)

    def resubscribe(self, reason: str) -> None:
        self.session.request_resubscribe(reason)

    def rpc(self, method: str, code: int | str, started: float, seconds: float) -> None:
        """A Report* call's outcome goes to the same observer as the client's own calls
        (``ClusterDClient.on_rpc``: the flight recorder, or a seed-API caller's hook), so
        whoever watches the link's RPCs sees every one of them."""
        on_rpc = self.client.on_rpc
        if on_rpc is not None:
            on_rpc(method, code, started, seconds)

    def _publish(self) -> None:
        """The wire's snapshot of the loop's state, anew (on the loop)."""
        session, live = self.session, self.session.live.is_set()
        self.wire.publish(Cycles(live=live, subscribed=session.subscribe_sent, running=session.current_uuid,
                                 stream=session.stream_token() if live else None, answering=self.flow.answering,
                                 narrowed=self.reports.resume.narrowed()))

    async def start(self) -> None:
        """Open the channel and start the session and the dispatcher (the wire runs from
        its construction)."""
        self.loop_priority.hold()
        await self.client.open()
        self._publish()
        for name, body in (("session", self.session.run()), ("dispatcher", self.dispatcher.run())):
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
        # Every report the controller put so far is in the wire's outbox before the drain
        # looks at it, and the loop has taken them.
        if self.session.live.is_set():
            await self.wire.drain(timeout=self.config.clusterd.drain_timeout)
        self.session.stop()
        await asyncio.to_thread(self.wire.stop, 2.0 + self.config.clusterd.rpc_timeout)
        self.wire.catch_up()
        await finish(self.tasks.values())
        self.dispatcher.close()
        self.reports.follow_up.close()
        await self.client.close()

    def _session_state(self, state: SessionState) -> None:
        self._observer(f"ClusterD session: {state.value}")
        self.recorder.session(state.value)
        self.reports.on_session_state(state)
        self._on_state(state)


class PublishingFlow:
    """The flow as the dispatcher sees it: ``notified`` and ``restore`` change the cycle
    the controller answers, so each publishes the wire's snapshot right after, before the
    notify is made (the controller answers only after a notify) and after a refused one
    is undone. Everything else is the flow's own."""

    def __init__(self, flow: ControllerFlow, publish: Callable[[], None]) -> None:
        object.__setattr__(self, "_flow", flow)
        object.__setattr__(self, "_publish", publish)

    def notified(self, *args: Any, **kwargs: Any) -> None:
        self._flow.notified(*args, **kwargs)
        self._publish()

    def restore(self, snapshot: Any) -> None:
        self._flow.restore(snapshot)
        self._publish()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._flow, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._flow, name, value)


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
