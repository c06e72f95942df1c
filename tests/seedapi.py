"""The seed API's entry point in a test: the simulated ClusterD on a thread of its own
(the seed API is synchronous), the stub controller as a launcher's, and a launcher that
hosts it through ``DLRecoverManager``.

Shared because every behaviour of the bridge is tested on both entry points, the daemon
(``simjobs.py``) and the seed API (this module), with the same assertions; the
``server`` and ``training`` fixtures are imported by the test files that use them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from bridge.recover_manager import DLRecoverManager, pb, report_process_fault, report_recover_status, report_recover_strategy, report_stop_complete
from bridge.sim import mindio_ttp
from bridge.sim.clusterd import SimClusterD, SimJob
from bridge.sim.scenario import free_port

JOB = "seed-job"


class ServerThread:
    """The simulated ClusterD on a loop of its own: the seed API is synchronous."""

    def __init__(self, jobs: list[SimJob], credentials: grpc.ServerCredentials | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sim = self.run(self._make(jobs))
        self.sim.server_credentials = credentials
        self.address = self.run(self.sim.start("127.0.0.1:0"))

    async def _make(self, jobs: list[SimJob]) -> SimClusterD:
        return SimClusterD(jobs, keepalive_interval=0.2, global_fault_delay=0.05, flush_delay=0.01)

    def run(self, coroutine):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(30)

    def call(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` on the server's loop, which owns the simulation's state."""
        async def on_loop() -> Any:
            return function(*args)
        return self.run(on_loop())

    def wait_for(self, predicate, timeout: float = 10):  # type: ignore[no-untyped-def]
        return self.run(self.sim.wait_for(predicate, timeout))

    def close(self) -> None:
        self.run(self.sim.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def server() -> Iterator[ServerThread]:
    srv = ServerThread([SimJob(JOB, world_size=16, devices_per_pod=4)])
    yield srv
    violations = list(srv.sim.violations)
    srv.close()
    assert violations == []


@pytest.fixture
def training(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    mindio_ttp.install()
    mindio_ttp.training.reset()
    mindio_ttp.training.auto_step = True
    mindio_ttp.training.use_timings(mindio_ttp.FAST_TIMINGS)
    # The node agent restarts whole pods, the simulated ClusterD's (4 ranks each): a
    # controller told fewer ranks than ClusterD named hangs in repair, as the real one.
    mindio_ttp.training.devices_per_pod = 4
    monkeypatch.setenv("MINDIO_WAIT_MINDX_TIME", "5")  # read by tft_init_controller, like the real one
    yield mindio_ttp.training
    mindio_ttp.training.reset()


def hosting_the_controller(server: ServerThread, training) -> DLRecoverManager:  # type: ignore[no-untyped-def]
    """A launcher that hosts the stub controller itself through the seed API: manager
    subscribed, the four callbacks registered, the controller started, the 16 ranks
    connected and the stream live. The caller closes the manager."""
    import mindio_ttp.controller_ttp as ttp

    info = pb.ClientInfo(taskId=JOB, role="master agent")
    manager = DLRecoverManager(info, server.address, secure_conn=False)
    manager.init_clusterd()
    assert manager.register(info).code == 0
    manager.start_subscribe()
    for action, callback in (("report_fault_ranks", report_process_fault), ("report_stop_complete", report_stop_complete),
                             ("report_strategies", report_recover_strategy), ("report_result", report_recover_status)):
        assert ttp.tft_register_mindx_callback(action, callback) == 0
    ttp.tft_init_controller(-1, 16, False, True, False)
    ttp.tft_start_controller("127.0.0.1", free_port(), False, "")
    training.connect_ranks(range(16))
    server.wait_for(lambda e: e.kind == "signal" and e.name == "keep-alive")
    return manager
