"""The two in-process entry points a chaos schedule runs on, behind one interface.

* ``DaemonHarness``: the daemon, as :class:`bridge.sim.scenario.SimulatedJob` wires it
  (tests/simjobs.py's harness), with the flight recorder on, behind the TCP proxy of
  tests/test_clusterd_restart.py so ClusterD can be frozen as SIGSTOP freezes it.
* ``SeedHarness``: a launcher written against the seed API (``DLRecoverManager`` and the
  ``report_*`` functions) hosting the stub controller itself, as MindCluster's launchers
  and tests/test_recover_manager.py do.

The real ``tft-bridge run`` process is ``tests.chaos.process.ProcessHarness``. Every
harness has the simulated ClusterD (``sim``) on the runner's loop, the proxy in front of
it, and a way to read the stub controller's observation log (``records()``).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Any

from bridge.sim import mindio_ttp
from bridge.sim.clusterd import SimClusterD, SimJob
from bridge.sim.clusterd_timings import REAL
from bridge.sim.scenario import SimulatedJob, free_port

from ..test_clusterd_restart import FreezableProxy
from .schedule import CONTROLLER_TIMINGS, DEVICES_PER_POD, RPC_TIMEOUT, TIME_SCALE, WAIT, WORLD_SIZE

JOB = "job-chaos"
#: ClusterD's real delays, scaled: keep-alives every 0.1 s, 11 s stop-complete ->
#: globalFault becomes 0.22 s, the 15-minute report wait 18 s. Every ratio is kept.
CLUSTERD_SCALE = TIME_SCALE
CLUSTERD_TIMINGS = REAL.scaled(CLUSTERD_SCALE)
#: The bridge declares a silent stream dead after this many keep-alive intervals.
WATCHDOG_INTERVALS = 10.0
#: The controller's notify functions a slow-notify event can slow down.
NOTIFIES = ("stop_train", "on_global_rank", "change_strategy", "dump", "prepare_action")


def job_spec() -> SimJob:
    return SimJob(JOB, world_size=WORLD_SIZE, devices_per_pod=DEVICES_PER_POD)



def recorded_successes(state_dir: str) -> int:
    """The successful retry/recover cycles the flight recorder under ``state_dir`` holds
    (0 when it has no store yet): what ``tft-bridge history`` would show an operator."""
    from bridge.job.recorder.history import find_store
    from bridge.job.recorder.store import last_cycles, open_reader

    try:
        db = open_reader(find_store(state_dir, None))
    except FileNotFoundError:
        return 0
    try:
        return sum(1 for row in last_cycles(db, 10_000)
                   if row.outcome == "success" and row.strategy in ("retry", "recover"))
    finally:
        db.close()

class SlowNotifies:
    """Wraps the stub's ``tft_notify_controller_*`` functions (the bridge looks them up on
    the module at each call, so does the seed API): the next ``count`` notifies block
    ``delay`` s first, a controller busy in its own lock. Undone by ``remove``."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.count = 0
        self._saved: dict[str, Any] = {}

    def install(self) -> None:
        module = mindio_ttp.controller_ttp
        for name in NOTIFIES:
            attr = f"tft_notify_controller_{name}"
            original = getattr(module, attr, None)
            if original is None or attr in self._saved:
                continue
            self._saved[attr] = original

            def slowed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if self.count > 0:
                    self.count -= 1
                    time.sleep(self.delay)  # the delay is the behaviour injected: a notify that takes this long
                return _original(*args, **kwargs)

            setattr(module, attr, slowed)

    def remove(self) -> None:
        for attr, original in self._saved.items():
            setattr(mindio_ttp.controller_ttp, attr, original)
        self._saved.clear()


class Harness:
    """What the runner needs of an entry point."""

    entry = ""
    sim: SimClusterD
    proxy: FreezableProxy
    #: seconds a requested stop may take (the daemon's stop budget; the seed API's close bound)
    stop_budget: float = 0.0

    async def start(self) -> None: ...
    def records(self) -> list[mindio_ttp.Record]: ...
    def stub_violations(self) -> list[str]: ...
    def stub_state(self) -> str: ...
    def inject(self, faults: dict[int, int]) -> None: ...
    def connected(self, rank: int) -> bool: ...
    def set_destroy_delay(self, seconds: float) -> None: ...
    def slow_notifies(self, delay: float, count: int) -> None: ...
    async def request_stop(self) -> tuple[int | None, float]: ...
    async def close(self) -> None: ...
    def subscribed(self) -> bool: ...
    def success_counts(self) -> dict[str, float | None]: ...
    async def sigkill_restart(self) -> None:
        raise NotImplementedError(f"{self.entry}: SIGKILL needs the process entry point")


class InProcessStub:
    """The stub controller of this process (daemon and seed entry points)."""

    def __init__(self) -> None:
        self.training = mindio_ttp.training
        self.slow = SlowNotifies()

    def records(self) -> list[mindio_ttp.Record]:
        with self.training.cond:
            return list(self.training.events)

    def stub_violations(self) -> list[str]:
        with self.training.cond:
            return list(self.training.violations)

    def stub_state(self) -> str:
        return str(self.training.state)

    def inject(self, faults: dict[int, int]) -> None:
        self.training.inject_fault(faults)

    def connected(self, rank: int) -> bool:
        with self.training.cond:
            info = self.training.ranks.get(rank)
            return info is not None and info.connected and info.fault is None

    def set_destroy_delay(self, seconds: float) -> None:
        self.training.destroy_delay = seconds

    def slow_notifies(self, delay: float, count: int) -> None:
        self.slow.delay, self.slow.count = delay, count


async def start_proxied_sim() -> tuple[SimClusterD, FreezableProxy, str]:
    """The simulated ClusterD on a port of its own and the freezable proxy the client
    dials; returns both and the address the client must use."""
    sim = SimClusterD([job_spec()], timings=CLUSTERD_TIMINGS)
    upstream = await sim.start("127.0.0.1:0")
    address = f"127.0.0.1:{free_port()}"
    proxy = FreezableProxy(address, upstream)
    await proxy.start()
    return sim, proxy, address


class DaemonHarness(InProcessStub, Harness):
    entry = "daemon"

    def __init__(self) -> None:
        super().__init__()
        self.store = tempfile.TemporaryDirectory(prefix="tft-chaos-recorder-", ignore_cleanup_errors=True)
        t = CLUSTERD_TIMINGS
        self.job = SimulatedJob(
            job_spec(), keepalive_interval=t.keepalive_interval, global_fault_delay=t.global_fault_delay,
            flush_delay=t.flush_delay, dump_exit_repeat=t.dump_exit_repeat, report_timeout=t.report_timeout,
            wait_time=WAIT, controller_timings=CONTROLLER_TIMINGS, start_clusterd=False,
            clusterd_timings=CLUSTERD_TIMINGS,
            config_overrides={"clusterd": {"watchdog_intervals": WATCHDOG_INTERVALS, "rpc_timeout": RPC_TIMEOUT},
                              "recorder": {"enabled": True, "directory": self.store.name}})
        self.sim = self.job.sim
        self.stop_requested_at: float | None = None
        self._stopped: tuple[int | None, float] | None = None

    async def start(self) -> None:
        from bridge.job.daemon import stop_budget

        upstream = await self.sim.start("127.0.0.1:0")
        self.proxy = FreezableProxy(self.job.config.clusterd.address, upstream)
        await self.proxy.start()
        self.stop_budget = stop_budget(self.job.config)
        # the job exports the controller's wait itself (the bridge does, from its config)
        await self.job.start()
        self.slow.install()
        await self.job.subscribed(15)

    def subscribed(self) -> bool:
        bridge = self.job.bridge
        return bridge is not None and bridge.session is not None and bridge.session.live.is_set()

    async def request_stop(self) -> tuple[int | None, float]:
        """What the bridge does on SIGTERM (``interrupts.py`` calls ``request_stop``)."""
        if self._stopped is not None:
            return self._stopped
        started = time.monotonic()
        self.stop_requested_at = started
        assert self.job.bridge is not None and self.job._run is not None
        self.job.bridge.request_stop()
        try:
            code: int | None = await asyncio.wait_for(asyncio.shield(self.job._run), self.stop_budget + 5)
        except TimeoutError:
            code = None
        self._stopped = (code, time.monotonic() - started)
        return self._stopped

    def exited_on_its_own(self) -> int | None:
        run = self.job._run
        return run.result() if run is not None and run.done() and not run.cancelled() else None

    def success_counts(self) -> dict[str, float | None]:
        metric = sum(self.job.metrics.sample("tft_bridge_recovery_cycles_total", {"strategy": s, "outcome": "success"})
                     for s in ("retry", "recover"))
        return {"metrics": metric, "recorder": float(recorded_successes(self.store.name))}

    async def close(self) -> None:
        self.slow.remove()
        try:
            if self._stopped is None and self.job.bridge is not None:
                await self.request_stop()
            self.job.bridge = None  # stopped above: job.stop() only stops ClusterD and resets the stub
            await self.job.stop()
        finally:
            await self.proxy.close()
            self.store.cleanup()


def scaled_seed_config(config: Any) -> Any:
    """The seed API's own clock, scaled like everything else in a schedule.

    A launcher cannot tune the seed API: its keep-alive watchdog and its retry backoff
    keep the real defaults (seconds), sized for ClusterD's real 5 s keep-alives and a
    controller waiting 30 s or more. Against a ClusterD and a controller wait scaled down
    50 times, those unscaled waits alone would outlast the controller's wait (a report
    refused with ``qps exceeded`` retried 1.5 s, then 2.8 s later), so the harness
    scales them the way the daemon's config is scaled, before the subscription starts."""
    from dataclasses import replace

    clusterd = replace(config.clusterd, keepalive_interval=CLUSTERD_TIMINGS.keepalive_interval,
                       watchdog_intervals=WATCHDOG_INTERVALS, reconnect_initial=0.02, reconnect_max=0.5,
                       rpc_timeout=RPC_TIMEOUT, retry_record_hold=CLUSTERD_TIMINGS.retry_record_hold,
                       fault_centre_period=CLUSTERD_TIMINGS.fault_centre_period)
    return replace(config, clusterd=clusterd)


class SeedHarness(InProcessStub, Harness):
    entry = "seed"
    stop_budget = 15.0  # DLRecoverManager.close's own bound (10 s) plus the destroy

    def __init__(self) -> None:
        super().__init__()
        self.manager: Any = None
        self.stop_requested_at: float | None = None
        self._stopped: tuple[int | None, float] | None = None
        self._saved_wait = os.environ.get("MINDIO_WAIT_MINDX_TIME")

    async def start(self) -> None:
        self.sim, self.proxy, address = await start_proxied_sim()
        mindio_ttp.install()
        self.training.reset()
        self.training.auto_step = True
        self.training.use_timings(CONTROLLER_TIMINGS)
        os.environ["MINDIO_WAIT_MINDX_TIME"] = str(WAIT)  # read by tft_init_controller, like the real one
        await asyncio.to_thread(self._launch, address)
        self.slow.install()
        await self.sim.wait_for(lambda e: e.kind == "stream-open" and e.job_id == JOB, 15)

    def _launch(self, address: str) -> None:
        """As a launcher following the seed documentation writes it."""
        from bridge.recover_manager import DLRecoverManager, pb, report_process_fault, report_recover_status, report_recover_strategy, report_stop_complete

        import mindio_ttp.controller_ttp as ttp  # the stub, installed above

        info = pb.ClientInfo(ip="", port="", taskId=JOB, role="master agent")
        self.manager = DLRecoverManager(info, address, secure_conn=False)
        self.manager.config = scaled_seed_config(self.manager.config)
        self.manager.init_clusterd()
        if self.manager.register(info).code != 0:
            raise RuntimeError("the simulated ClusterD refused Register")
        self.manager.start_subscribe()
        ttp.tft_register_mindx_callback("report_fault_ranks", report_process_fault)
        ttp.tft_register_mindx_callback("report_stop_complete", report_stop_complete)
        ttp.tft_register_mindx_callback("report_strategies", report_recover_strategy)
        ttp.tft_register_mindx_callback("report_result", report_recover_status)
        ttp.tft_init_controller(-1, WORLD_SIZE, False, True, False)
        ttp.tft_start_controller("127.0.0.1", free_port(), False, "")
        self.training.connect_ranks(range(WORLD_SIZE))

    def subscribed(self) -> bool:
        link = getattr(self.manager, "link", None)
        session = getattr(link, "session", None)
        live = getattr(session, "live", None)
        return bool(live is not None and live.is_set())

    async def request_stop(self) -> tuple[int | None, float]:
        if self._stopped is not None:
            return self._stopped
        started = time.monotonic()
        self.stop_requested_at = started
        if self.manager is not None:
            await asyncio.to_thread(self.manager.close)
        self._stopped = (None, time.monotonic() - started)
        return self._stopped

    def success_counts(self) -> dict[str, float | None]:
        if self.manager is None:
            return {}
        metric = sum(self.manager.metrics.sample("tft_bridge_recovery_cycles_total",
                                                 {"strategy": s, "outcome": "success"})
                     for s in ("retry", "recover"))
        return {"metrics": metric}

    async def close(self) -> None:
        self.slow.remove()
        try:
            await self.request_stop()
            import mindio_ttp.controller_ttp as ttp

            self.training.destroy_delay = 0.0
            await asyncio.to_thread(ttp.tft_destroy_controller)
        finally:
            self.training.reset()
            await self.sim.stop()
            await self.proxy.close()
            if self._saved_wait is None:
                os.environ.pop("MINDIO_WAIT_MINDX_TIME", None)
            else:
                os.environ["MINDIO_WAIT_MINDX_TIME"] = self._saved_wait
