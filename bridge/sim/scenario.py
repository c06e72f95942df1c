"""One simulated training job: the simulated ClusterD, the stub controller with its
ranks, and a real bridge between them, on loopback. The demo, the end-to-end tests and
the benchmarks all start from here, so they exercise the same wiring an operator runs.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

from bridge.core.config import BridgeConfig, build_config
from bridge.job.daemon import Bridge
from bridge.job.metrics import BridgeMetrics
from bridge.core.listen_ports import free_port
from bridge.core.systemd import Notifier
from bridge.sim import mindio_ttp
from bridge.sim.clusterd import SimClusterD, SimJob
from bridge.sim.clusterd_release import MASTER, Release
from bridge.sim.clusterd_timings import FAST, Timings


class SimulatedJob:
    """``async with SimulatedJob(...) as job:`` -- everything started, the bridge READY.

    ``start()`` installs the stub controller (reset, with ``controller_timings``), starts
    the simulated ClusterD (unless ``start_clusterd`` is False), runs the bridge until it
    is READY, then connects ``connected_ranks`` ranks; ``stop()`` stops the bridge (its
    exit code is returned), then ClusterD, then resets the stub and the environment. All
    on the caller's event loop; one job at a time per process (the stub is a module)."""

    def __init__(self, job: SimJob | None = None, *, keepalive_interval: float = 0.5,
                 global_fault_delay: float = 0.05, flush_delay: float = 0.01, dump_exit_repeat: float = 0.5,
                 report_timeout: float = 30.0, wait_time: float = 5.0, enable_arf: bool = True,
                 enable_zit: bool = False, auto_step: bool = True, metrics_port: int | None = None,
                 observer: Callable[[str], None] | None = None, connected_ranks: int | None = None,
                 config_overrides: dict[str, Any] | None = None, start_clusterd: bool = True,
                 controller_timings: Mapping[str, float] = mindio_ttp.REAL_TIMINGS,
                 clusterd_timings: Timings | None = None, release: Release = MASTER,
                 heartbeat_loss: float | None = None) -> None:
        self.job = job or SimJob("job-sim", world_size=16, devices_per_pod=4)
        # ClusterD's delays: clusterd_timings.FAST (the real ones / 100, ratios kept) unless
        # the caller passes a table; the keyword delays override single fields of it.
        self.sim = SimClusterD([self.job], timings=clusterd_timings or FAST,
                               keepalive_interval=keepalive_interval,
                               global_fault_delay=global_fault_delay, flush_delay=flush_delay,
                               dump_exit_repeat=dump_exit_repeat, report_timeout=report_timeout,
                               release=release)
        self.training = mindio_ttp.training
        self.wait_time = wait_time
        # The stub's heartbeat-loss time (real ~8 s) when a test or the demo shortens it.
        self.heartbeat_loss = heartbeat_loss
        # The stub controller's pace: the real one unless the caller shortens it on purpose
        # (tests and benches pass mindio_ttp.FAST_TIMINGS; docs/mindio-controller.md).
        self.controller_timings = dict(controller_timings)
        self._saved_wait_env: tuple[str | None] | None = None  # (previous value,) while exported
        self.auto_step = auto_step
        # Ranks that connect to the controller once it runs (default: the whole world). The
        # stub checks every connected rank in Python under the GIL, where the real
        # controller does it in C++: benchmarks with a huge world connect one node's worth.
        self.connected_ranks = self.job.world_size if connected_ranks is None else connected_ranks
        self.start_clusterd = start_clusterd
        self.metrics = BridgeMetrics()
        self.observer = observer
        self._clusterd_address = f"127.0.0.1:{free_port()}"
        self._state_dir = tempfile.TemporaryDirectory(prefix="tft-bridge-sim-", ignore_cleanup_errors=True)
        raw: dict[str, Any] = {
            "job_id": self.job.job_id,
            "clusterd": {"address": self._clusterd_address, "keepalive_interval": keepalive_interval,
                         "rpc_timeout": 2.0, "reconnect_initial": 0.02, "reconnect_max": 0.5,
                         "startup_wait": 2.0, "recheck_disabled": 0.5,
                         # the simulated fault centre's own times (clusterd_retry.py)
                         "retry_record_hold": self.sim.timings.retry_record_hold,
                         "fault_centre_period": self.sim.timings.fault_centre_period},
            "controller": {"module": "stub", "bind_ip": "127.0.0.1", "port": free_port(),
                           "world_size": self.job.world_size, "enable_arf": enable_arf,
                           "enable_zit": enable_zit, "wait_mindx_time": max(1, int(wait_time)),
                           "destroy_timeout": 10.0,
                           # The orphaned-job marker (bridge/job/session/orphan.py) in a directory of
                           # this job's own, never /var/lib/tft-bridge: a test that stops
                           # mid-job must not make the next one report an orphaned job.
                           "state_directory": self._state_dir.name,
                           # Off: every test stopping mid-training would wait for it;
                           # the orphan tests and the demo set it with a shortened
                           # heartbeat loss (training.heartbeat_loss_time).
                           "rank_loss_wait": 0.0},
            "metrics": {"enabled": metrics_port is not None, "port": metrics_port or 0},
            # Off unless asked for (the demo, tests/test_recorder_e2e.py): its default
            # store is /var/lib/tft-bridge/<job>, no place for a simulation.
            "recorder": {"enabled": False},
        }
        for section, values in (config_overrides or {}).items():
            if isinstance(values, dict):
                raw.setdefault(section, {}).update(values)
            else:
                raw[section] = values
        self.config: BridgeConfig = build_config(raw, env={})
        self.bridge: Bridge | None = None
        self._run: asyncio.Task[int] | None = None

    async def __aenter__(self) -> "SimulatedJob":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        mindio_ttp.install()
        self.training.reset()
        self.training.use_timings(self.controller_timings)
        if self.heartbeat_loss is not None:
            self.training.heartbeat_loss_time = self.heartbeat_loss
        self.training.auto_step = self.auto_step
        # The node agent restarts whole pods (Training.restart_pods): the same pods as
        # the simulated ClusterD's, so a controller told fewer ranks than ClusterD named
        # hangs in repair here as the real one does.
        self.training.devices_per_pod = self.job.devices_per_pod
        # The controller reads MINDIO_WAIT_MINDX_TIME from the environment at init (so does
        # the stub); the bridge exports its configured wait before init.
        # The harness does not, so the tests catch a bridge that forgets; it only puts the
        # variable back as it was once the job stops.
        if self._saved_wait_env is None:
            self._saved_wait_env = (os.environ.get("MINDIO_WAIT_MINDX_TIME"),)
        if self.start_clusterd:
            await self.sim.start(self._clusterd_address)
        self.bridge = Bridge(self.config, metrics=self.metrics, notifier=Notifier({}), observer=self.observer)
        self._run = asyncio.create_task(self.bridge.run())
        ready = asyncio.ensure_future(self.bridge.ready.wait())
        await asyncio.wait({ready, self._run}, timeout=15, return_when=asyncio.FIRST_COMPLETED)
        if not self.bridge.ready.is_set():
            ready.cancel()
            raise RuntimeError(f"the bridge did not become ready (exit code {await self._run if self._run.done() else '?'})")
        self.training.connect_ranks(range(self.connected_ranks))

    async def subscribed(self, timeout: float = 10.0) -> None:
        """Wait for a live subscription (the bridge's session)."""
        assert self.bridge is not None
        await asyncio.wait_for(self.bridge.session.live.wait(), timeout)

    async def stop(self) -> int:
        code = 0
        if self.bridge is not None and self._run is not None:
            self.bridge.request_stop()
            code = await asyncio.wait_for(self._run, 30)
        await self.sim.stop()
        self.training.reset()
        if self._saved_wait_env is not None:
            (previous,), self._saved_wait_env = self._saved_wait_env, None
            if previous is None:
                os.environ.pop("MINDIO_WAIT_MINDX_TIME", None)
            else:
                os.environ["MINDIO_WAIT_MINDX_TIME"] = previous
        return code

    async def wait_exit(self, timeout: float = 10.0) -> int:
        assert self._run is not None
        return await asyncio.wait_for(asyncio.shield(self._run), timeout)


__all__ = ["SimJob", "SimulatedJob", "free_port"]
