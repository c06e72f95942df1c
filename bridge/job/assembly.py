"""One job's bridge between its controller and ClusterD, built in one place.

``Link`` builds the parts in an order where each is given only parts built before it:
the ClusterD client, the report inbox, the cycle state (``bridge/job/cycle_state.py``, the
one owner of what the stream shows and what the controller answers), the report
bookkeeping (``reports/ledger.py``), the report wire (``reports/relay.py``), the signal
dispatcher (``session/signals.py``) and the session (``session/clusterd.py``). Where two
parts must talk both ways they do it through the cycle state, never through each other
or through the link. Two hosts use it: the daemon (``daemon.Bridge``), which owns the
controller, and the seed API (``bridge.recover_manager``), whose caller runs it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from bridge.core.backoff import Backoff
from bridge.core.config import BridgeConfig
from bridge.job.cycle_state import CycleState
from bridge.job.host.controller import ControllerHost
from bridge.job.metrics import BridgeMetrics
from bridge.job.recorder import NullRecorder
from bridge.job.reports.controller_flow import ControllerFlow
from bridge.job.reports.kinds import ReportSink
from bridge.job.reports.ledger import ReportPath
from bridge.job.reports.refault import FaultCentreTimes
from bridge.job.reports.relay import ReportInbox, Wire
from bridge.job.sched import realtime
from bridge.job.sched.affinity import ControllerPin
from bridge.job.sched.realtime import LoopPriority
from bridge.job.session.clusterd import ClusterDClient, SessionState, report_channel, run_logged
from bridge.job.session.node_hooks import NodeHooks
from bridge.job.session.signal_session import Session
from bridge.job.session.signals import SignalDispatcher

log = logging.getLogger(__name__)


class Link:
    """Owns one job's parts between its controller and ClusterD; ``start()`` and
    ``stop()`` are their whole lifecycle (supervising the tasks is the host's business).
    Create it on the running event loop (the wire posts to it); every method runs there.

    ``on_kill_master``: ClusterD reschedules the job. ``on_state``: told of every
    session state. ``observer``: the demo's timeline. ``recorder``: the flight recorder,
    which every part reports to. ``on_wire_ended``: the report wire's thread ended (on
    the loop; at a stop too)."""

    def __init__(self, config: BridgeConfig, metrics: BridgeMetrics, controller: ControllerHost,
                 flow: ControllerFlow, *, on_kill_master: Callable[[], None],
                 on_state: Callable[[SessionState], None] = lambda state: None,
                 observer: Callable[[str], None] | None = None, recorder: NullRecorder | None = None,
                 on_wire_ended: Callable[[], None] = lambda: None) -> None:
        job_id, clusterd = config.job_id, config.clusterd
        self.config = config
        self.metrics = metrics
        self.controller = controller
        self.flow = flow
        self.recorder = recorder = recorder or NullRecorder()
        self.client = ClusterDClient(clusterd, metrics, config.controller.realtime_priority,
                                     on_rpc=recorder.rpc if recorder.enabled else None)
        self.inbox = ReportInbox()
        self.cycles = CycleState(flow, self.inbox.wake)
        self.reports = ReportPath(job_id, flow, self.inbox, self.cycles, metrics, recorder=recorder,
                                  observer=observer,
                                  fault_centre=FaultCentreTimes(clusterd.retry_record_hold,
                                                                clusterd.fault_centre_period))
        self.wire = Wire(job_id, report_channel(clusterd), asyncio.get_running_loop(), self.inbox, self.cycles,
                         self.reports, self.client, metrics, rpc_timeout=clusterd.rpc_timeout,
                         backoff=Backoff(clusterd.reconnect_initial, clusterd.reconnect_max),
                         limit=config.outbox_limit, realtime_priority=config.controller.realtime_priority,
                         pin=ControllerPin(config.controller.pin_cpu), on_ended=on_wire_ended)
        self.dispatcher = SignalDispatcher(
            job_id, flow, controller, NodeHooks(config.hooks.node_command, config.hooks.timeout, metrics), metrics,
            self.cycles, self.reports, on_kill_master=on_kill_master,
            pause_timeout=config.controller.pause_timeout, observer=observer,
            recorder=recorder if recorder.enabled else None)
        self.session = Session(job_id, self.client, metrics, self.cycles, self.dispatcher, self.wire,
                               on_state=(partial(_tell_state, observer, recorder), self.reports.on_session_state,
                                         on_state))
        self.loop_priority = LoopPriority(config.controller.realtime_priority)  # held from start to stop
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        _bind_metrics(metrics, controller, self.session, self.wire, self.loop_priority,
                      config.controller.realtime_priority)

    @property
    def sink(self) -> ReportSink:
        """Where the controller's callbacks put their reports: the wire's inbox."""
        return self.inbox.put

    @property
    def controller_pin(self) -> ControllerPin | None:
        """What pins an owned controller's callback thread to one CPU with the wire
        (bridge/job/sched/affinity.py), for its callbacks; None when off."""
        pin = self.wire.pin
        return pin if pin.enabled else None

    async def start(self) -> None:
        """Hold the loop's priority, open the channel, start the wire's thread, then the
        session and the dispatcher."""
        self.loop_priority.hold()
        await self.client.open()
        self.wire.start()
        for name, body in (("session", self.session.run()), ("dispatcher", self.dispatcher.run())):
            self.tasks[name] = spawn(name, body)

    async def stop(self, before_destroy: Callable[[], None] = lambda: None) -> None:
        """Hand the controller no new action, run ``before_destroy`` (the host stops its
        other work there), destroy an owned controller off its own thread
        (``controller.destroy_timeout``) *while the session and the wire still run*,
        drain the outbox for at most ``clusterd.drain_timeout`` while a stream is
        live, then stop the rest in reverse order of ``start``. The controller still
        calls back while it is destroyed (docs/mindio-controller.md section 7): its last
        reports reach ClusterD. Bounded by ``daemon.stop_budget``."""
        try:
            self.dispatcher.stop()
            before_destroy()
            if self.controller.started and self.controller.owned:
                await asyncio.to_thread(self.controller.destroy, self.config.controller.destroy_timeout)
            if self.session.live.is_set():
                await self.wire.drain(timeout=self.config.clusterd.drain_timeout)
            self.session.stop()
            await finish(self.tasks.values())
            await asyncio.to_thread(self.wire.stop, 2.0 + self.config.clusterd.rpc_timeout)
            self.wire.catch_up()  # every report it took reaches the bookkeeping
            self.dispatcher.close()
            self.reports.follow_up.close()
            await self.client.close()
        finally:
            self.loop_priority.release()


def _tell_state(observer: Callable[[str], None] | None, recorder: NullRecorder, state: SessionState) -> None:
    """A session state, to the timeline and the flight recorder."""
    if observer is not None:
        observer(f"ClusterD session: {state.value}")
    recorder.session(state.value)


def _bind_metrics(metrics: BridgeMetrics, controller: ControllerHost, session: Session, wire: Wire,
                  loop_priority: LoopPriority, realtime_priority: int) -> None:
    """The gauges read from the parts at scrape time."""
    metrics.bind_controller_switch(controller.connected)
    metrics.bind_keepalive_clock(session.last_heard)
    pin = wire.pin
    if pin.enabled:
        metrics.bind_controller_cpu(lambda: pin.handoff_cpu)
    if realtime_priority > 0:  # off: not exported (no alert for a choice)
        metrics.bind_realtime_threads({
            realtime.LOOP: lambda: loop_priority.realtime,
            realtime.REPORT: lambda: wire.realtime,
        })


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
