"""The bridge's lifecycle: start-up, the running loop, and a graceful stop.

Start-up: metrics endpoint, then ClusterD's Init (waited for at most
``clusterd.startup_wait``: a 403 means process recovery is off and the controller is
not started; an unreachable ClusterD must not keep the ranks from training, so the
controller starts anyway), then the controller, then READY=1. Running: the session,
the relay and the dispatcher tasks, plus a tick that pings the systemd watchdog only
while every task is alive. Stop (SIGTERM, killMaster): STOPPING=1, drain the outbox for
a moment, end the session, destroy the controller off its own thread with a bounded
wait, close everything.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from . import faults as codec
from .clusterd import ClusterDClient, Session, SessionState, run_logged
from .codes import Code
from .config import BridgeConfig
from .controller import ControllerHost, ControllerReport, Handoff, ReportFields, StartupError, load_controller_module
from .flow import STRATEGIES, ControllerFlow, Step
from .hooks import NodeHooks
from .metrics import BridgeMetrics, MetricsServer
from .ranktable import RankTableSubscriber
from .relay import Relay, merge_into
from .signals import SignalDispatcher
from .systemd import Notifier

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1
EXIT_CONFIG = 2
EXIT_RESCHEDULED = 75  # killMaster: the job is rescheduled; systemd restarts the bridge for it (EX_TEMPFAIL)

#: The bridge runs several threads that each have little to do but must do it at once
#: (the controller's callbacks, the hand-off, the notify thread, gRPC's poller). With
#: CPython's default 5 ms switch interval a thread that wants the GIL -- the controller's,
#: before it can even enter a callback -- can wait 5 ms behind the event loop's Python
#: code; 1 ms bounds that wait, at a cost that is negligible here. (It cannot cut a
#: single long C call short: see bench/README.md on 100 000-rank reports.) The benchmark
#: gain first measured for it (callback-to-wire p99 ~12 -> < 10 ms) was mostly a harness
#: artefact fixed since; on the fixed harness 1 ms and 5 ms measure alike within noise.
GIL_SWITCH_INTERVAL = 0.001


def clean_faults(raw: Any, metrics: BridgeMetrics, what: str) -> dict[int, int]:
    """The valid entries of a controller fault map; bad ones are counted and logged,
    never allowed to poison the rest (or reach ClusterD, whose rank parser one bad rank
    empties)."""
    try:
        return codec.merge_faults(raw)
    except (TypeError, ValueError) as error:
        log.error("bad fault map from the controller in %s: %s", what, error)
    clean: dict[int, int] = {}
    items = raw.items() if hasattr(raw, "items") else ()
    for key, value in list(items):
        try:
            clean = codec.merge_faults(clean, {key: value})
        except (TypeError, ValueError):
            metrics.bad_inputs.labels("controller_fault_map").inc()
    if not hasattr(raw, "items"):
        metrics.bad_inputs.labels("controller_fault_map").inc()
    return clean


class RecoveryClock:
    """Phase timings of one controller fault flow, for the duration histograms."""

    def __init__(self, metrics: BridgeMetrics) -> None:
        self.metrics = metrics
        self.started: float | None = None
        self.stopped: float | None = None
        self.offered: float | None = None

    def fault(self, at: float) -> None:
        if self.started is None:
            self.started = at

    def stop_complete(self, at: float) -> None:
        if self.started is not None and self.stopped is None:
            self.metrics.recovery_phase_seconds.labels("fault_to_stop").observe(at - self.started)
            self.stopped = at

    def strategies(self, at: float) -> None:
        if self.stopped is not None and self.offered is None:
            self.metrics.recovery_phase_seconds.labels("stop_to_strategy").observe(at - self.stopped)
            self.offered = at

    def exited(self, at: float) -> None:
        """ClusterD chose exit: the controller goes down and reports no result."""
        self.metrics.recovery_cycles.labels("exit", "exit").inc()
        if self.started is not None:
            self.metrics.recovery_seconds.labels("exit").observe(at - self.started)
        self.started = self.stopped = self.offered = None

    def result(self, at: float, strategy: str, code: int) -> None:
        label = strategy if strategy in STRATEGIES else "other"
        outcome = "success" if code == 0 else "isolated" if code == 201 else "failed"
        self.metrics.recovery_cycles.labels(label, outcome).inc()
        if self.offered is not None:
            self.metrics.recovery_phase_seconds.labels("strategy_to_result").observe(at - self.offered)
        if self.started is not None:
            self.metrics.recovery_seconds.labels(label).observe(at - self.started)
        if code in (0, 201):
            self.started = self.stopped = self.offered = None
        else:  # a failed strategy: the flow goes on with the next one
            self.offered = None


class Bridge:
    def __init__(self, config: BridgeConfig, *, metrics: BridgeMetrics | None = None,
                 notifier: Notifier | None = None, observer: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.metrics = metrics or BridgeMetrics()
        self.notifier = notifier or Notifier()
        self.observer = observer or (lambda line: None)
        self._observed = observer is not None  # formatting a 100 000-rank timeline line costs ms
        self.flow = ControllerFlow(wait_timeout=config.controller.wait_mindx_time,
                                   on_desync=self.metrics.count_desync)
        self.clock = RecoveryClock(self.metrics)
        self.exit_code = EXIT_OK
        self.controller: ControllerHost | None = None
        self.client: ClusterDClient | None = None
        self.session: Session | None = None
        self.relay: Relay | None = None
        self.dispatcher: SignalDispatcher | None = None
        self.metrics_server: MetricsServer | None = None
        self.handoff: Handoff | None = None
        self.ranktable: RankTableSubscriber | None = None
        self._flow_faults: dict[int, int] = {}  # the controller's faults in the running flow
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._status = ""

    # ------------------------------------------------------------------ public
    def request_stop(self, exit_code: int = EXIT_OK) -> None:
        if not self._stop.is_set():
            self.exit_code = exit_code
            self._stop.set()

    async def run(self) -> int:
        """Start, serve until asked to stop, stop; the process exit code."""
        sys.setswitchinterval(GIL_SWITCH_INTERVAL)  # the daemon owns its process
        try:
            await self._start()
        except StartupError as error:
            log.error("start-up failed: %s", error)
            self.notifier.status(f"start-up failed: {error}")
            await self._shutdown()
            return EXIT_STARTUP_FAILED
        try:
            await self._serve()
        finally:
            await self._shutdown()
        return self.exit_code

    # ------------------------------------------------------------------ start-up
    async def _start(self) -> None:
        c = self.config
        if c.metrics.enabled:
            try:
                self.metrics_server = MetricsServer(
                    self.metrics, c.metrics.address, c.metrics.port, certfile=c.metrics.certfile,
                    keyfile=c.metrics.keyfile, client_cafile=c.metrics.client_cafile)
            except OSError as error:
                raise StartupError(f"metrics endpoint {c.metrics.address}:{c.metrics.port}: {error}") from error
            log.info("metrics on http%s://%s:%d/metrics", "s" if c.metrics.certfile else "", c.metrics.address,
                     self.metrics_server.port)
        if c.ranktable.enabled:
            self.ranktable = RankTableSubscriber(c.ranktable, c.clusterd, self.metrics)
            self._spawn("ranktable", self.ranktable.run())
        module = load_controller_module(c.controller.module)
        await self.start_relaying(ControllerHost(module, c.controller))
        assert self.session is not None
        try:
            await asyncio.wait_for(self.session.init_answered.wait(), c.clusterd.startup_wait)
        except asyncio.TimeoutError:
            log.warning("ClusterD %s did not answer Init within %.0f s; starting the controller anyway so "
                        "training can run (reports are queued until ClusterD answers)",
                        c.clusterd.address, c.clusterd.startup_wait)
        if self.session.process_recover is False:
            # Not started for recovery; _serve keeps ticking (and pinging the watchdog) and
            # starts the controller once a slow re-check finds recovery switched on.
            log.warning("not starting the controller: process-level recovery is off for job %s", c.job_id)
            self.notifier.ready("process-level recovery is off for this job (ClusterD Init 403); controller not started")
            self.ready.set()
            return
        await self._start_controller()

    async def start_relaying(self, controller: ControllerHost) -> None:
        """Everything between a controller and ClusterD: the session, the relay, the
        dispatcher and the hand-off. The daemon then starts the controller; the seed API
        (bridge.recover_manager) calls this for a controller its caller runs."""
        c = self.config
        self.controller = controller
        self.metrics.bind_controller_switch(controller.connected)
        self.client = ClusterDClient(c.clusterd, self.metrics)
        await self.client.open()
        hooks = NodeHooks(c.hooks.node_command, c.hooks.timeout, self.metrics)
        self.dispatcher = SignalDispatcher(c.job_id, self.flow, controller, hooks, self.metrics,
                                           on_kill_master=lambda: self.request_stop(EXIT_RESCHEDULED),
                                           pause_timeout=c.controller.pause_timeout)
        self.dispatcher.observer = self.observer
        self.dispatcher.on_exit_decided = lambda: self.clock.exited(time.monotonic())
        self.session = Session(c.job_id, self.client, self.metrics, self.dispatcher.submit, self._session_state)
        self.metrics.bind_keepalive_clock(lambda: self.session.last_message_at if self.session else None)
        self.relay = Relay(c.job_id, self.client, self.session, self.metrics, c.outbox_limit)
        self._make_sink(asyncio.get_running_loop())
        self._spawn("session", self.session.run())
        self._spawn("dispatcher", self.dispatcher.run())
        self._spawn("relay", self.relay.run())

    async def _start_controller(self) -> None:
        c = self.config
        assert self.controller is not None
        sink = self._make_sink(asyncio.get_running_loop())
        await asyncio.to_thread(self.controller.start, sink, self.metrics.callback_errors.inc)
        self.observer(f"controller listening for training ranks on {c.controller.bind_ip}:{c.controller.port}")
        log.info("controller listening on %s:%d (world size %d)", c.controller.bind_ip, c.controller.port,
                 c.controller.world_size)
        if self.ready.is_set():
            self.notifier.status(self._status_line())
        else:
            self.notifier.ready(self._status_line())
            self.ready.set()

    def _make_sink(self, loop: asyncio.AbstractEventLoop) -> Callable[[ReportFields], None]:
        """O(1) hand-off from the controller's thread to the loop (see Handoff)."""
        if self.handoff is None:
            self.handoff = Handoff(loop, self._on_reports)
        return self.handoff.put

    def _on_reports(self, reports: list[ControllerReport]) -> None:
        for report in reports:
            self._on_report(report)

    def _spawn(self, name: str, coroutine: Any) -> None:
        self._tasks[name] = asyncio.create_task(run_logged(name, coroutine), name=f"tft-bridge-{name}")

    # ------------------------------------------------------------------ running
    async def _serve(self) -> None:
        interval = 1.0
        if self.notifier.watchdog_interval:
            interval = min(interval, self.notifier.watchdog_interval / 2)
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), interval)
            except asyncio.TimeoutError:
                pass
            self._tick()
            if self._controller_waits_for_recovery():
                try:
                    await self._start_controller()
                except StartupError as error:
                    log.error("start-up failed: %s", error)
                    self.request_stop(EXIT_STARTUP_FAILED)

    def _controller_waits_for_recovery(self) -> bool:
        """Started with recovery off (403) and a re-check now finds it on."""
        return (self.controller is not None and not self.controller.started and self.session is not None
                and self.session.process_recover is True and not self._stop.is_set())

    def _tick(self) -> None:
        if self.flow.expire():
            log.error("the controller did not hear from ClusterD within %ss; it has gone to EXIT",
                      self.config.controller.wait_mindx_time)
        dead = [name for name, task in self._tasks.items() if task.done()]
        if dead:
            # No watchdog ping: systemd restarts the bridge (its failure is in the log).
            log.error("background task(s) %s ended unexpectedly; withholding the systemd watchdog", ", ".join(dead))
            return
        if self.handoff is not None and not self.handoff.alive:
            log.error("the controller hand-off thread died; withholding the systemd watchdog")
            return
        if self.metrics_server is not None and not self.metrics_server.alive:
            log.error("the metrics endpoint thread died; withholding the systemd watchdog")
            return
        if self.notifier.watchdog_interval:
            self.notifier.watchdog()
        self._publish_status()

    def _session_state(self, state: SessionState) -> None:
        self.observer(f"ClusterD session: {state.value}")
        if state is SessionState.SUBSCRIBED and self.flow.step is Step.AWAIT_STOP and self._flow_faults \
                and self.relay is not None:
            # Every subscription resets ClusterD's job, fault cache included, and a fault
            # reported as a cycle ended may have been lost with code 0. The controller
            # still waits for stop_train: only a fresh report can start the cycle.
            log.warning("re-reporting %d fault rank(s) on the new stream: ClusterD forgot them",
                        len(self._flow_faults))
            self.relay.submit_faults(dict(self._flow_faults))
        self._publish_status()

    def _status_line(self) -> str:
        session = self.session.state.value if self.session else "not started"
        ranks = "yes" if self.controller and self.controller.started and self.controller.connected() else "no"
        return (f"ClusterD: {session}; controller: {self.flow.step.value}, ranks connected: {ranks}; "
                f"outbox: {len(self.relay) if self.relay else 0}")

    def _publish_status(self) -> None:
        line = self._status_line()
        if line != self._status:
            self._status = line
            self.notifier.status(line)

    # ------------------------------------------------------------------ controller reports (event loop)
    def _on_report(self, report: ControllerReport) -> None:
        self.metrics.callbacks.labels(report.callback).inc()
        try:
            handler = _REPORT_HANDLERS[report.callback]
            handler(self, report)
        except (TypeError, ValueError, IndexError) as error:
            self.metrics.bad_inputs.labels(f"controller_{report.callback}").inc()
            log.error("malformed %s from the controller %r: %s", report.callback, report.args[:2], error)
            if report.waiter is not None and not report.waiter.done():
                report.waiter.set_result(Code.ClientError)
        except Exception:
            self.metrics.callback_errors.inc()
            log.exception("failed to handle %s", report.callback)
            if report.waiter is not None and not report.waiter.done():
                report.waiter.set_result(Code.ClientError)

    def _fault_ranks(self, report: ControllerReport) -> None:
        raw = report.args[0] if report.args else {}
        faults = clean_faults(raw, self.metrics, "report_fault_ranks")
        first_of_flow = self.flow.step in (Step.IDLE, Step.PAUSED, Step.STOP_SENT)
        self.flow.on_callback("report_fault_ranks")
        self.metrics.count_faults(faults)
        if first_of_flow:
            self.clock.fault(report.at)
            self._flow_faults = dict(faults)
            self.metrics.faulty_ranks.set(len(faults))
        else:
            self._flow_faults = merge_into(self._flow_faults, faults)
            self.metrics.faulty_ranks.set(len(self._flow_faults))
        if self._observed:
            self.observer(f"controller report_fault_ranks {codec.format_faults(faults) or '(none)'}")
        assert self.relay is not None
        self.relay.submit_faults(faults, report.waiter)

    def _stop_complete(self, report: ControllerReport) -> None:
        code, msg, raw = _code(report.args[0]), str(report.args[1]), report.args[2] if len(report.args) > 2 else {}
        faults = clean_faults(raw, self.metrics, "report_stop_complete")
        cycle = self.flow.answering
        self.flow.on_callback("report_stop_complete", code=code)
        self.clock.stop_complete(report.at)
        self.observer(f"controller report_stop_complete code={code}")
        assert self.relay is not None
        self.relay.submit_cycle_report("stop_complete", cycle,
                                       codec.encode_stop_complete_request(self.config.job_id, code, msg, faults),
                                       report.waiter)

    def _strategies(self, report: ControllerReport) -> None:
        faults = clean_faults(report.args[0], self.metrics, "report_strategies")
        strategies = [str(s) for s in report.args[1]]
        cycle = self.flow.answering
        self.flow.on_callback("report_strategies", strategies=tuple(strategies))
        self.clock.strategies(report.at)
        self.observer(f"controller report_strategies {strategies}")
        assert self.relay is not None
        self.relay.submit_cycle_report("strategy", cycle,
                                       codec.encode_recover_strategy_request(self.config.job_id, faults, strategies),
                                       report.waiter)

    def _result(self, report: ControllerReport) -> None:
        code, msg = _code(report.args[0]), str(report.args[1])
        faults = clean_faults(report.args[2] if len(report.args) > 2 else {}, self.metrics, "report_result")
        strategy = str(report.args[3]) if len(report.args) > 3 else ""
        cycle = self.flow.answering
        self.flow.on_callback("report_result", code=code, strategy=strategy)
        self.clock.result(report.at, strategy, code)
        if code == 0:
            self.metrics.faulty_ranks.set(0)
        isolate = [str(rank) for rank in sorted(faults)] if code == 201 else []
        self.observer(f"controller report_result code={code} strategy={strategy or '(none)'}")
        assert self.relay is not None
        self.relay.submit_cycle_report("result", cycle, codec.encode_recover_status_request(
            self.config.job_id, code, msg, strategy, isolate), report.waiter)

    # ------------------------------------------------------------------ stop
    async def _shutdown(self) -> None:
        self.notifier.stopping("stopping: draining reports, then destroying the controller")
        if self.dispatcher is not None:
            self.dispatcher.stop()  # hand the controller no new action while it is going down
        if self.relay is not None and self.session is not None and self.session.live.is_set():
            await self.relay.drain(timeout=min(5.0, self.config.clusterd.rpc_timeout))
        if self.session is not None:
            self.session.stop()
        if self.relay is not None:
            self.relay.stop()
        if self.ranktable is not None:
            self.ranktable.stop()
        if self.controller is not None and self.controller.started and self.controller.owned:
            await asyncio.to_thread(self.controller.destroy, self.config.controller.destroy_timeout)
        for name, task in self._tasks.items():
            try:
                await asyncio.wait_for(asyncio.shield(task), 2.0)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
            except Exception:  # noqa: BLE001 - already logged by run_logged
                pass
        for task in self._tasks.values():
            if not task.done():
                task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self.handoff is not None:
            await asyncio.to_thread(self.handoff.close)
        if self.dispatcher is not None:
            self.dispatcher.close()
        if self.client is not None:
            await self.client.close()
        if self.metrics_server is not None:
            self.metrics_server.close()


def _code(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"status code must be an int, got {value!r}")
    return value


_REPORT_HANDLERS: dict[str, Callable[[Bridge, ControllerReport], None]] = {
    "report_fault_ranks": Bridge._fault_ranks,
    "report_stop_complete": Bridge._stop_complete,
    "report_strategies": Bridge._strategies,
    "report_result": Bridge._result,
}
