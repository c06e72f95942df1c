"""The daemon's lifecycle: a part of the running bridge that dies stops the bridge cleanly
with exit code 1 (not a half-dead process kept alive, nor a watchdog SIGABRT that skips
the destroy); the signal helper every long-running command uses forces the exit on a
second SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator

import pytest

from bridge.job.daemon import EXIT_FAILED
from bridge.job.session.signal_session import Session
from bridge.sim.clusterd import SimJob
from bridge.sim.mindio_ttp import FAST_TIMINGS
from bridge.sim.scenario import SimulatedJob

from .conftest import eventually, eventually_sync
from .processes import reap

pytestmark = pytest.mark.timeout(90)
JOB = "job-life"


@pytest.fixture
async def job() -> AsyncIterator[SimulatedJob]:
    simulated = SimulatedJob(SimJob(JOB, world_size=8, devices_per_pod=4), keepalive_interval=0.1,
                             controller_timings=FAST_TIMINGS)  # the controller's 5 s destroy is not under test
    try:
        yield simulated
    finally:
        await simulated.stop()


def destroyed(job: SimulatedJob) -> bool:
    return any(e.kind == "api" and e.name == "destroy" for e in job.training.events)


async def assert_stopped_cleanly(job: SimulatedJob) -> None:
    """Exit 1, and the graceful stop ran: the controller destroyed, the stream ended by the bridge."""
    assert await job.wait_exit(30) == EXIT_FAILED
    assert destroyed(job)
    assert job.training.controller is None
    await eventually(lambda: not job.sim.controllers[JOB].live, what="ClusterD seeing the stream end")


async def test_a_background_task_that_fails_stops_the_bridge_with_exit_1(
        job: SimulatedJob, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    fail = asyncio.Event()
    subscribe = Session.run

    async def failing_run(session: Session) -> None:
        running = asyncio.ensure_future(subscribe(session))
        try:
            await fail.wait()
        finally:
            running.cancel()
        raise RuntimeError("session broke")

    monkeypatch.setattr(Session, "run", failing_run)
    caplog.set_level(logging.ERROR, logger="bridge.job.daemon")
    await job.start()
    await job.subscribed()
    fail.set()
    await assert_stopped_cleanly(job)
    assert "background task session ended: RuntimeError('session broke')" in caplog.text


async def test_a_background_task_that_returns_stops_the_bridge_too(
        job: SimulatedJob, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A loop that simply returns while the bridge is not stopping is just as dead."""
    caplog.set_level(logging.ERROR, logger="bridge.job.daemon")
    await job.start()
    await job.subscribed()
    assert job.bridge is not None
    job.bridge.link.dispatcher.stop()  # its loop returns; nothing else asked the bridge to stop
    await assert_stopped_cleanly(job)
    assert "background task dispatcher ended: returned although the bridge was not stopping" in caplog.text


async def test_a_dead_report_wire_stops_the_bridge(job: SimulatedJob, caplog: pytest.LogCaptureFixture) -> None:
    """The wire owns every report of the controller: without it none would leave."""
    caplog.set_level(logging.ERROR, logger="bridge.job.daemon")
    await job.start()
    await job.subscribed()
    assert job.bridge is not None and job.bridge.link.wire.alive
    await asyncio.to_thread(job.bridge.link.wire.stop, 5.0)  # the thread ends as if it had died
    await assert_stopped_cleanly(job)
    assert "the report wire thread ended; stopping the bridge" in caplog.text


async def test_a_dead_metrics_endpoint_stops_the_bridge(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="bridge.job.daemon")
    job = SimulatedJob(SimJob(JOB, world_size=8, devices_per_pod=4), keepalive_interval=0.1, metrics_port=0)
    try:
        await job.start()
        await job.subscribed()
        assert job.bridge is not None and job.bridge.metrics_server is not None
        server = job.bridge.metrics_server

        def broken(client: socket.socket) -> bool:
            raise RuntimeError("a bug in the accept path")

        server._has_request = broken  # type: ignore[method-assign]  # the next connection kills its thread
        await asyncio.to_thread(lambda: socket.create_connection(("127.0.0.1", server.port), timeout=20).close())
        await assert_stopped_cleanly(job)
        assert "the metrics endpoint thread ended; stopping the bridge" in caplog.text
    finally:
        await job.stop()


async def test_a_requested_stop_is_not_a_death(job: SimulatedJob, caplog: pytest.LogCaptureFixture) -> None:
    """Every task ends during a normal stop: none of that may be reported or change the code."""
    caplog.set_level(logging.ERROR, logger="bridge.job.daemon")
    await job.start()
    await job.subscribed()
    assert job.bridge is not None
    job.bridge.request_stop()
    assert await job.wait_exit(30) == 0
    assert destroyed(job)
    assert "ended" not in caplog.text


HELPER = textwrap.dedent("""
    import asyncio, logging, sys
    from bridge.core.interrupts import capture_signals

    async def main() -> int:
        stop = asyncio.Event()
        with capture_signals(stop.set):
            print("ready", flush=True)
            await stop.wait()
            print("stopping slowly", flush=True)
            await asyncio.sleep(600)  # a graceful stop that takes too long: the behaviour under test
        return 0

    logging.basicConfig(level="INFO", stream=sys.stdout)
    sys.exit(asyncio.run(main()))
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_forces_the_exit(signum: signal.Signals) -> None:
    process = subprocess.Popen([sys.executable, "-c", HELPER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signum)
        seen: list[str] = []
        eventually_sync(lambda: seen.append(process.stdout.readline()) or "stopping slowly" in seen[-1],
                        20, "the first signal starting the graceful stop")
        assert process.poll() is None  # the first signal did not end it
        process.send_signal(signum)
        assert process.wait(20) == 128 + signum
        rest = process.stdout.read()
        assert f"second {signum.name}: exiting now" in rest
    finally:
        reap(process)
