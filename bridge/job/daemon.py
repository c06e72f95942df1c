"""One job's bridge process, from start-up to its exit code: when parts start and stop.

What crosses the bridge is built by ``assembly.Link``; this module decides when it
starts and stops, and with which exit code. Everything here runs on the event loop but
``exit_now`` and ``arm_exit_deadline``.

* **Start-up**: the metrics endpoint, the rank table subscriber, the controller module,
  the flight recorder, the link and its side services, ClusterD's Init (waited for at
  most ``clusterd.startup_wait``: an unreachable ClusterD must not keep the ranks from
  training; a 403 leaves the controller unstarted until a re-check finds recovery on),
  the controller, READY=1.
* **Running**: the first supervised part to end while the bridge is not stopping (a
  task, or a thread that tells it ended: the report wire; or one the tick finds ended)
  stops it with ``EXIT_FAILED`` and a log line naming it. The tick pings the systemd
  watchdog from the loop (a stuck loop withholds it) and stops the bridge with
  ``EXIT_CONTROLLER_ENDED`` once the flow says the controller ended on its own: it
  cannot be restarted in place (docs/architecture.md, "Invariants").
* **Stop** (SIGTERM, killMaster -> ``EXIT_RESCHEDULED``, a dead part, the controller
  ended): STOPPING=1, ``Link.stop`` (no new action, the controller destroyed while the
  reports still flow, a bounded drain), the orphan marker (``session/orphan.py``), the
  recorder, the metrics endpoint; the whole within ``stop_budget``. ``tft-bridge run``
  then ends the process with ``exit_now``: the real controller's ``atexit`` destroy may
  never return (docs/mindio-controller.md section 7).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from bridge.job.session.signal_session import Session
from bridge.core.config import BridgeConfig, config_warnings
from bridge.job.host.controller import ControllerHost, StartupError, load_controller_module
from bridge.job.side_services import SideServices
from bridge.job.reports.controller_flow import ControllerFlow, Step
from bridge.job.assembly import Link, finish, spawn
from bridge.core.metrics_http import MetricsServer
from bridge.job.metrics import BridgeMetrics
from bridge.job.session.orphan import ControllerMarker, OrphanWatch, sweep_stale_markers
from bridge.job.session.rank_table import RankTableSubscriber
from bridge.job.recorder import NullRecorder, Recording
from bridge.job.reports.relay import Wire
from bridge.core.state_dir import state_directory
from bridge.core.systemd import Notifier

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1  # start-up failed, or a part of the running bridge died
EXIT_STARTUP_FAILED = EXIT_FAILED
EXIT_CONFIG = 2
EXIT_RESCHEDULED = 75  # killMaster: the job is rescheduled; systemd restarts the bridge for it (EX_TEMPFAIL)
#: The controller ended on its own (EXIT/FINAL) and cannot be restarted in place; systemd
#: restarts the bridge (RestartForceExitStatus=) so a fresh controller awaits the job's
#: next incarnation.
EXIT_CONTROLLER_ENDED = 76
#: Exit codes after which the job's ranks are gone or going: the orphan marker is removed.
JOB_ENDING_CODES = frozenset({EXIT_RESCHEDULED, EXIT_CONTROLLER_ENDED})

#: After the controller's own EXIT wait (``wait_mindx_time``) it tells every rank to exit
#: and stops; this much longer and the bridge counts it as ended (the flow's own margin).
ENDED_GRACE = 5.0
#: Seconds a stop may take beyond the drain and the bounded destroy: the tasks' grace,
#: closing the channel, the recorder and the metrics endpoint.
STOP_SLACK = 10.0

#: How often the HA switch is asked again while a stop waits for the ranks' loss.
RANK_LOSS_POLL = 0.1


class Bridge:
    """One job's bridge process, from ``run()`` to its exit code. ``run()`` builds the
    link (``assembly.Link``) once the controller module is loaded; until then ``link``
    raises."""

    def __init__(self, config: BridgeConfig, *, metrics: BridgeMetrics | None = None,
                 notifier: Notifier | None = None, observer: Callable[[str], None] | None = None,
                 on_stopping: Callable[[], None] | None = None) -> None:
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
        self._link: Link | None = None  # built by run()
        self._stop = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[Any]] = {}  # supervised: its end stops the bridge
        self._thread_died = asyncio.Event()  # a supervised thread told it ended (``_thread_ended``)
        self._ended_threads: list[str] = []  # the threads that told they ended (``_thread_ended``)
        self._status = ""
        self.side: SideServices | None = None  # built with the link (side_services.py)
        self._on_stopping = on_stopping  # told once when the stop begins (the CLI arms its exit deadline)
        directory = state_directory(config.controller.state_directory, config.job_id)
        self.orphan = OrphanWatch(ControllerMarker(directory, self.metrics), self.metrics, config.job_id)
        self.ended_reason: str | None = None  # why the controller counts as ended (EXIT_CONTROLLER_ENDED)
        self.abandoned: list[str] = []  # what the stop had to leave running (a destroy that did not return)
        self._marked = False  # this bridge's controller started and wrote the marker

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
        """The running link (client, session, dispatcher, wire, bookkeeping)."""
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
    def wire(self) -> Wire:
        return self.link.wire

    # ------------------------------------------------------------------ start-up
    async def _start(self) -> None:
        c = self.config
        for line in config_warnings(c):  # the same lines check-config prints
            log.warning("configuration: %s", line)
        if c.metrics.enabled:
            try:
                loop = asyncio.get_running_loop()
                server = MetricsServer(self.metrics, c.metrics.address, c.metrics.port, certfile=c.metrics.certfile,
                                       keyfile=c.metrics.keyfile, client_cafile=c.metrics.client_cafile,
                                       on_died=partial(loop.call_soon_threadsafe, self._thread_ended,
                                                       "metrics endpoint thread"))
                server.start()
            except OSError as error:
                raise StartupError(f"metrics endpoint {c.metrics.address}:{c.metrics.port}: {error}") from error
            self.metrics_server = server
            log.info("metrics on http%s://%s:%d/metrics", "s" if c.metrics.certfile else "", c.metrics.address,
                     server.port)
        if c.ranktable.enabled:
            self.ranktable = RankTableSubscriber(c.ranktable, c.clusterd, self.metrics, hook_timeout=c.hooks.timeout)
            self._tasks["ranktable"] = spawn("ranktable", self.ranktable.run())
        module = load_controller_module(c.controller.module)
        self.orphan.check_leftover()  # before this controller overwrites the marker
        if not c.controller.state_directory:  # the default layout: one directory per job under a root
            sweep_stale_markers(self.orphan.marker.path.parent, self.metrics)
        # Never fails the start: a store that cannot be written is counted and logged.
        self.recording = Recording.from_config(c, self.flow, self.metrics)
        self.recording.start()
        self._link = link = Link(c, self.metrics, ControllerHost(module, c.controller), self.flow,
                                 on_kill_master=lambda: self.request_stop(EXIT_RESCHEDULED),
                                 on_state=lambda state: self._publish_status(), observer=self.observer,
                                 recorder=self.recording.recorder,
                                 on_wire_ended=partial(self._thread_ended, "report wire thread"))
        await link.start()
        self._tasks.update(link.tasks)
        self.side = SideServices(c, link, self.metrics)
        self.side.start()
        self._tasks.update(self.side.tasks)
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
        await asyncio.to_thread(link.controller.start, link.sink, self.metrics.callback_errors.inc,
                                link.controller_pin)
        self.orphan.controller_started(f"{c.controller.bind_ip}:{c.controller.port}")
        self._marked = True
        self._observe(f"controller listening for training ranks on {c.controller.bind_ip}:{c.controller.port}")
        log.info("controller listening on %s:%d (world size %d)", c.controller.bind_ip, c.controller.port,
                 c.controller.world_size)
        if self.ready.is_set():
            self.notifier.status(self._status_line())
        else:
            self.notifier.ready(self._status_line())
            self.ready.set()

    def _thread_ended(self, name: str) -> None:
        """A supervised thread's end (the report wire, the metrics endpoint), told on the
        loop by the thread's ``on_died``/``on_ended``: the bridge stops (``_serve``)."""
        self._ended_threads.append(name)
        self._thread_died.set()

    # ------------------------------------------------------------------ running
    async def _serve(self) -> None:
        """Wait for a stop request or for the first supervised part to end."""
        self._tasks["tick"] = spawn("tick", self._tick_until_stopped())
        stop = asyncio.ensure_future(self._stop.wait())
        died = asyncio.ensure_future(self._thread_died.wait())
        try:
            await asyncio.wait({stop, died, *self._tasks.values()}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            died.cancel()
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
        for name in dict.fromkeys(self._ended_threads):
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

    def _controller_ended(self) -> bool:
        """True (and the stop requested, once) when the controller has ended on its own."""
        if self._stop.is_set() or not self.link.controller.started:
            return False
        step, _, since, _ = self.flow.snapshot()
        wait = self.config.controller.wait_mindx_time
        if step is Step.EXITED:
            why = "it was given ClusterD's exit notice in EXIT and has gone to FINAL"
        elif step is Step.EXITING and time.monotonic() - since > wait + ENDED_GRACE:
            why = (f"it went to EXIT and its {wait} s wait there ran out: it has told every rank to exit "
                   "and stopped serving")
        else:
            return False
        self.ended_reason = why
        log.error("the controller has ended on its own (%s). A controller that has ended cannot be restarted in "
                  "place (the real one rejects the heartbeats of ranks it did not start), so the bridge delivers "
                  "the last reports and exits with code %d for systemd to restart it with a fresh controller",
                  why, EXIT_CONTROLLER_ENDED)
        self.notifier.status(f"stopping: the controller ended ({why}); exit code {EXIT_CONTROLLER_ENDED}")
        self._observe(f"controller ended: {why}")
        self.request_stop(EXIT_CONTROLLER_ENDED)
        return True

    def _controller_waits_for_recovery(self) -> bool:
        """Started with recovery off (403) and a re-check now finds it on."""
        link = self.link
        return not link.controller.started and link.session.process_recover is True and not self._stop.is_set()

    def _tick(self) -> None:
        if self.flow.expire():
            log.error("the controller did not hear from ClusterD within its %.0f s wait; it has gone to EXIT",
                      self.flow.expired_wait)
        if self._controller_ended():
            return  # no watchdog ping after the decision: the bridge is stopping
        link = self.link
        if link.controller.started:
            self.orphan.poll(link.controller.connected())
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
        return (f"{self.orphan.status_prefix()}ClusterD: {link.session.state.value}; controller: {self.flow.step.value}, "
                f"ranks connected: {ranks}; outbox: {len(link.wire)}")

    def _publish_status(self) -> None:
        line = self._status_line()
        if line != self._status:
            self._status = line
            self.notifier.status(line)

    # ------------------------------------------------------------------ stop
    async def _shutdown(self) -> None:
        self._stop.set()  # from here on a part that ends is stopping, not dying
        if self._on_stopping is not None:
            self._on_stopping()
        self.notifier.stopping("stopping: destroying the controller, then draining reports")
        ranks_connected = False
        if self._link is not None:
            link = self._link
            ranks_connected = self._ranks_connected()
            if ranks_connected and self._marked and self.exit_code not in JOB_ENDING_CODES \
                    and not self.orphan.suspected:
                ranks_connected = await self._await_rank_loss()
            if self.exit_code == EXIT_CONTROLLER_ENDED:
                await self._await_stream_for_last_reports()
            await link.stop(before_destroy=self._stop_side)
            if link.controller.destroy_abandoned:
                self.abandoned.append("tft_destroy_controller")
                log.warning("the controller's destroy is left running; the process exits without running the "
                            "controller's atexit destroy, which would wait for it (exit code %d)", self.exit_code)
        else:
            self._stop_ranktable()
        if self._marked:
            self.orphan.controller_stopped(job_ending=self.exit_code in JOB_ENDING_CODES,
                                           ranks_connected=ranks_connected)
        await finish(list(self._tasks.values()))
        self.recording.recorder.close()  # an open cycle ends as it stands
        await asyncio.to_thread(self.recording.stop)  # bounded: the writer flushes, the exporter sends
        if self.metrics_server is not None:
            self.metrics_server.stop()

    async def _await_rank_loss(self) -> bool:
        """The HA switch at a stop that would keep the orphan marker, after giving the
        controller ``controller.rank_loss_wait`` seconds to notice its ranks are gone.

        The usual teardown kills the job's ranks and then stops the bridge; the controller
        counts a killed rank as connected until its heartbeats have been missing for the
        heartbeat-loss time (~8-10 s, docs/mindio-controller.md section 6), so a stop within
        that time would keep the marker of a job that ended, and the next bridge would
        report it as orphaned. Only the controller knows whether a rank is still there, so
        the bridge asks it again until it says no or the wait is over; a job that really
        trains on keeps the switch on and its marker (orphan.py)."""
        wait = self.config.controller.rank_loss_wait
        if wait <= 0:
            return True
        log.info("training ranks are still counted connected: waiting up to %.0f s for the controller to notice "
                 "whether they are gone (the ranks of a job being torn down have just been killed)", wait)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            await asyncio.sleep(RANK_LOSS_POLL)
            if not self._ranks_connected():
                log.info("the controller lost every training rank: the job's ranks are gone")
                return False
        return True

    def _ranks_connected(self) -> bool:
        try:
            return self.link.controller.started and self.link.controller.connected()
        except Exception:  # noqa: BLE001 - a failing query must not break the stop; assume the worst
            log.exception("tft_query_high_availability_switch failed during the stop")
            return True

    async def _await_stream_for_last_reports(self) -> None:
        """The controller ended: its last report must reach ClusterD before the exit. When
        the stream is down right now, give it one RPC deadline (at most 5 s) to come back;
        the drain itself is bounded the same way (``Link.stop``)."""
        link = self.link
        if len(link.wire) and not link.session.live.is_set():
            wait = self.config.clusterd.drain_timeout
            try:
                await asyncio.wait_for(link.session.live.wait(), wait)
            except asyncio.TimeoutError:
                log.warning("ClusterD's stream is down; %d report(s) of the ended controller may not be delivered",
                            len(link.wire))

    def _stop_ranktable(self) -> None:
        if self.ranktable is not None:
            self.ranktable.stop()

    def _stop_side(self) -> None:
        """Right before the destroy: the side services end while the channel is open."""
        self._stop_ranktable()
        if self.side is not None:
            self.side.stop()


def stop_budget(config: BridgeConfig) -> float:
    """How long a whole stop may take: the drain (at most 5 s, one RPC deadline), the
    bounded destroy and ``STOP_SLACK``. Also the wait for ClusterD's stream when the
    controller ended. The unit's TimeoutStopSec must stay above it."""
    drain = config.clusterd.drain_timeout
    return 2 * drain + config.controller.destroy_timeout + config.controller.rank_loss_wait + STOP_SLACK


#: How long ``exit_now`` waits for the logs to flush (a stuck journald pipe must not keep
#: the process alive either).
FLUSH_TIMEOUT = 2.0


def exit_now(code: int) -> None:
    """End the process with ``code`` now: logs flushed (for at most ``FLUSH_TIMEOUT``), no
    interpreter clean-up.

    Python's own exit would run the controller module's ``atexit`` destroy (which waits on
    the lock of a destroy the stop abandoned: forever), join every non-daemon thread and
    run native destructors; none of those is bounded, and all the bridge needs at exit
    (reports drained, controller destroyed or abandoned, recorder closed) the bounded stop
    has done."""

    def flush() -> None:
        try:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001 - nothing may keep the process from ending
            pass

    try:
        flusher = threading.Thread(target=flush, name="tft-bridge-flush", daemon=True)
        flusher.start()
        flusher.join(FLUSH_TIMEOUT)
    finally:
        os._exit(code)


def arm_exit_deadline(budget: float, code: Callable[[], int]) -> threading.Thread:
    """Start a daemon thread that ends the process with ``code()`` if it is still alive
    ``budget`` seconds from now (a stop step stuck in the controller)."""

    def expire() -> None:
        time.sleep(budget)  # the delay is the deadline itself
        log.critical("the stop did not finish within %.0f s (controller.destroy_timeout + drain + %.0f s); "
                     "exiting now with code %d", budget, STOP_SLACK, code())
        exit_now(code())

    thread = threading.Thread(target=expire, name="tft-bridge-exit-deadline", daemon=True)
    thread.start()
    return thread
