"""The bridge's lifecycle: start-up, supervision while running, and a graceful stop.

What crosses the bridge is elsewhere (``link.py`` builds it: ``signals.py`` one way,
``reports.py`` the other, ``relay.py`` the outbox); this module only decides when things
start and stop, and with which exit code.

Start-up: metrics endpoint, rank table subscriber, then the link and ClusterD's Init
(waited for at most ``clusterd.startup_wait``: a 403 means process recovery is off and
the controller is not started until a slow re-check finds it on; an unreachable ClusterD
must not keep the ranks from training, so the controller starts anyway), then the
controller, then READY=1.

Running: the session, the dispatcher, the outbox, the rank table subscriber, the tick,
and two threads (the controller hand-off and the metrics endpoint) are supervised: the
first of them to end, unless the bridge is stopping, stops the bridge cleanly with exit
code 1 and a log line naming it and why. Under systemd a dead part would otherwise only
show as a missed watchdog ping, and the SIGABRT that follows skips the drain and the
controller's destroy; outside systemd nothing would ever end the half-dead process. The
tick pings the systemd watchdog from the event loop, so a *stuck* loop (which supervision
cannot see) still gets the service restarted.

Stop (SIGTERM, killMaster, a dead task): STOPPING=1, no new action to the controller,
drain the outbox for a moment, end the session, destroy the controller off its own
thread with a bounded wait, close everything.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .clusterd import Session
from .config import BridgeConfig
from .controller import ControllerHost, StartupError, load_controller_module
from .flow import ControllerFlow
from .link import Link, finish, spawn
from .metrics import BridgeMetrics, MetricsServer
from .recorder import NullRecorder, Recording
from .ranktable import RankTableSubscriber
from .relay import Relay
from .systemd import Notifier

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1  # start-up failed, or a part of the running bridge died
EXIT_STARTUP_FAILED = EXIT_FAILED
EXIT_CONFIG = 2
EXIT_RESCHEDULED = 75  # killMaster: the job is rescheduled; systemd restarts the bridge for it (EX_TEMPFAIL)

#: How often a supervised thread is looked at (a thread cannot be awaited).
THREAD_POLL_INTERVAL = 0.5


class Bridge:
    """One job's bridge process, from ``run()`` to its exit code. ``run()`` builds the
    link (``link.py``) whole once the controller module is loaded; until then ``link``
    raises."""

    def __init__(self, config: BridgeConfig, *, metrics: BridgeMetrics | None = None,
                 notifier: Notifier | None = None, observer: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.metrics = metrics or BridgeMetrics()
        self.notifier = notifier or Notifier()
        self.observer = observer
        self.flow = ControllerFlow(wait_timeout=config.controller.wait_mindx_time,
                                   on_desync=self.metrics.count_desync)
        self.exit_code = EXIT_OK
        self.metrics_server: MetricsServer | None = None  # None: metrics.enabled = false
        self.ranktable: RankTableSubscriber | None = None  # None: ranktable.enabled = false
        self.recording = Recording(NullRecorder())  # the flight recorder, started with the link ([recorder])
        self.ready = asyncio.Event()
        self._link: Link | None = None  # built by run(), whole (see link.py)
        self._stop = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[Any]] = {}  # supervised: its end stops the bridge
        self._thread_watches: dict[str, asyncio.Task[None]] = {}  # supervised threads, polled
        self._status = ""

    # ------------------------------------------------------------------ public
    def request_stop(self, exit_code: int = EXIT_OK) -> None:
        """Stop with ``exit_code``; the first request decides the code."""
        if not self._stop.is_set():
            self.exit_code = exit_code
            self._stop.set()

    async def run(self) -> int:
        """Start, serve until asked to stop or a part dies, stop; the process exit code."""
        try:
            await self._start()
        except StartupError as error:
            log.error("start-up failed: %s", error)
            self.notifier.status(f"start-up failed: {error}")
            self.exit_code = EXIT_STARTUP_FAILED
            await self._shutdown()
            return EXIT_STARTUP_FAILED
        try:
            await self._serve()
        finally:
            await self._shutdown()
        return self.exit_code

    @property
    def link(self) -> Link:
        """The running link (client, session, outbox, dispatcher, return path, hand-off)."""
        if self._link is None:
            raise RuntimeError("the bridge has not started")
        return self._link

    # The parts tests, benchmarks and the demo look at.
    @property
    def session(self) -> Session:
        return self.link.session

    @property
    def controller(self) -> ControllerHost:
        return self.link.controller

    @property
    def relay(self) -> Relay:
        return self.link.relay

    # ------------------------------------------------------------------ start-up
    async def _start(self) -> None:
        c = self.config
        if c.metrics.enabled:
            try:
                server = MetricsServer(self.metrics, c.metrics.address, c.metrics.port, certfile=c.metrics.certfile,
                                       keyfile=c.metrics.keyfile, client_cafile=c.metrics.client_cafile)
            except OSError as error:
                raise StartupError(f"metrics endpoint {c.metrics.address}:{c.metrics.port}: {error}") from error
            self.metrics_server = server
            self._watch_thread("metrics endpoint thread", lambda: server.alive)
            log.info("metrics on http%s://%s:%d/metrics", "s" if c.metrics.certfile else "", c.metrics.address,
                     server.port)
        if c.ranktable.enabled:
            self.ranktable = RankTableSubscriber(c.ranktable, c.clusterd, self.metrics, hook_timeout=c.hooks.timeout)
            self._tasks["ranktable"] = spawn("ranktable", self.ranktable.run())
        module = load_controller_module(c.controller.module)
        # Never fails the start: a store that cannot be written is counted and logged.
        self.recording = Recording.start(c, self.flow, self.metrics)
        self._link = link = Link(c, self.metrics, ControllerHost(module, c.controller), self.flow,
                                 on_kill_master=lambda: self.request_stop(EXIT_RESCHEDULED),
                                 on_state=lambda state: self._publish_status(), observer=self.observer,
                                 recorder=self.recording.recorder)
        await link.start()
        self._tasks.update(link.tasks)
        self._watch_thread("controller hand-off thread", lambda: link.handoff.alive)
        try:
            await asyncio.wait_for(link.session.init_answered.wait(), c.clusterd.startup_wait)
        except asyncio.TimeoutError:
            log.warning("ClusterD %s did not answer Init within %.0f s; starting the controller anyway so "
                        "training can run (reports are queued until ClusterD answers)",
                        c.clusterd.address, c.clusterd.startup_wait)
        if link.session.process_recover is False:
            # Not started for recovery; the tick keeps pinging the watchdog and starts the
            # controller once a slow re-check finds recovery switched on.
            log.warning("not starting the controller: process-level recovery is off for job %s", c.job_id)
            self.notifier.ready("process-level recovery is off for this job (ClusterD Init 403); controller not started")
            self.ready.set()
            return
        await self._start_controller()

    async def _start_controller(self) -> None:
        c, link = self.config, self.link
        await asyncio.to_thread(link.controller.start, link.sink, self.metrics.callback_errors.inc)
        self._observe(f"controller listening for training ranks on {c.controller.bind_ip}:{c.controller.port}")
        log.info("controller listening on %s:%d (world size %d)", c.controller.bind_ip, c.controller.port,
                 c.controller.world_size)
        if self.ready.is_set():
            self.notifier.status(self._status_line())
        else:
            self.notifier.ready(self._status_line())
            self.ready.set()

    def _watch_thread(self, name: str, alive: Callable[[], bool]) -> None:
        self._thread_watches[name] = asyncio.create_task(_until_dead(alive), name=f"tft-bridge-watch-{name}")

    # ------------------------------------------------------------------ running
    async def _serve(self) -> None:
        """Wait for a stop request or for the first supervised part to end."""
        self._tasks["tick"] = spawn("tick", self._tick_until_stopped())
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({stop, *self._tasks.values(), *self._thread_watches.values()},
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not self._stop.is_set():
            self._report_dead()
            self.request_stop(EXIT_FAILED)
        await finish([self._tasks.pop("tick")])  # lets a controller start in progress complete

    def _report_dead(self) -> None:
        for name, task in self._tasks.items():
            if task.done():
                why = "cancelled" if task.cancelled() else repr(task.exception()) if task.exception() \
                    else "returned although the bridge was not stopping"
                log.error("background task %s ended: %s; stopping the bridge (exit code %d)", name, why, EXIT_FAILED)
                self.notifier.status(f"stopping: background task {name} ended: {why}")
        for name, watch in self._thread_watches.items():
            if watch.done():
                log.error("the %s ended; stopping the bridge (exit code %d)", name, EXIT_FAILED)
                self.notifier.status(f"stopping: the {name} ended")

    async def _tick_until_stopped(self) -> None:
        interval = 1.0
        if self.notifier.watchdog_interval:
            interval = min(interval, self.notifier.watchdog_interval / 2)
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), interval)
                return
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
        link = self.link
        return not link.controller.started and link.session.process_recover is True and not self._stop.is_set()

    def _tick(self) -> None:
        if self.flow.expire():
            log.error("the controller did not hear from ClusterD within %ss; it has gone to EXIT",
                      self.config.controller.wait_mindx_time)
        if self.notifier.watchdog_interval:
            self.notifier.watchdog()  # from the loop: a stuck loop withholds it
        self.recording.recorder.tick()
        self._publish_status()

    def _observe(self, line: str) -> None:
        if self.observer is not None:
            self.observer(line)

    def _status_line(self) -> str:
        link = self.link
        ranks = "yes" if link.controller.started and link.controller.connected() else "no"
        return (f"ClusterD: {link.session.state.value}; controller: {self.flow.step.value}, "
                f"ranks connected: {ranks}; outbox: {len(link.relay)}")

    def _publish_status(self) -> None:
        line = self._status_line()
        if line != self._status:
            self._status = line
            self.notifier.status(line)

    # ------------------------------------------------------------------ stop
    async def _shutdown(self) -> None:
        self._stop.set()  # from here on a part that ends is stopping, not dying
        self.notifier.stopping("stopping: draining reports, then destroying the controller")
        for watch in self._thread_watches.values():
            watch.cancel()
        if self._link is not None:
            await self._link.stop(before_destroy=self._stop_ranktable)
        else:
            self._stop_ranktable()
        await finish([*self._tasks.values(), *self._thread_watches.values()])
        self.recording.recorder.close()  # an open cycle ends as it stands
        await asyncio.to_thread(self.recording.close)  # bounded: the writer flushes, the exporter sends
        if self.metrics_server is not None:
            self.metrics_server.close()

    def _stop_ranktable(self) -> None:
        if self.ranktable is not None:
            self.ranktable.stop()


async def _until_dead(alive: Callable[[], bool]) -> None:
    """Return once a thread has ended (polled: threads cannot be awaited)."""
    while alive():
        await asyncio.sleep(THREAD_POLL_INTERVAL)
