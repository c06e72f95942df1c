"""A stop is bounded whatever the controller does.

The real controller package registers ``tft_destroy_controller`` with ``atexit``, and its
destroy can block for minutes mid-flow. Seen: SIGTERM during a repair; the bridge gave
up on the destroy after its bound, then the main thread blocked in that exit handler on
the lock the abandoned destroy still held, and was still running 48 s later (systemd
SIGKILLs at 60 s, skipping the log flush). These run ``tft-bridge run`` as a real
process against a stub controller whose destroy never returns and holds the lock its
atexit handler takes (tests/hanging_controller.py).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from bridge.core.config import load_config
from bridge.job.daemon import EXIT_OK, stop_budget
from bridge.sim.scenario import free_port

from .conftest import eventually_sync
from .processes import reap, spawn_bridge

pytestmark = pytest.mark.timeout(120)
DESTROY_TIMEOUT = 2.0

RUN_WITH_HANGING_DESTROY = ("import sys, tests.hanging_controller; from bridge.cli import main; "
                            "sys.exit(main(sys.argv[1:]))")


def write_config(tmp_path: Path, clusterd: str = "") -> Path:
    """``clusterd``: its address; by default one where nothing listens."""
    config = tmp_path / "job.toml"
    config.write_text(f"""
job_id = "job-stop"
[clusterd]
address = "{clusterd or f'127.0.0.1:{free_port()}'}"
rpc_timeout = 1.0
startup_wait = 0.2
[controller]
module = "stub"
bind_ip = "127.0.0.1"
port = {free_port()}
world_size = 4
destroy_timeout = {DESTROY_TIMEOUT}
state_directory = "{tmp_path / 'state'}"
[metrics]
enabled = false
[recorder]
enabled = false
""")
    return config


def test_sigterm_exits_within_the_stop_budget_although_destroy_never_returns(tmp_path: Path) -> None:
    config_path = write_config(tmp_path)
    config = load_config(config_path, env={})
    marker = tmp_path / "state" / "controller.json"
    process = spawn_bridge("run", "--config", str(config_path), code=RUN_WITH_HANGING_DESTROY)
    try:
        # The controller has started once its marker exists.
        eventually_sync(lambda: marker.exists() or process.poll() is not None, 30, what="the controller started")
        assert process.poll() is None, process.communicate()[0]
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        budget = stop_budget(config)
        output, _ = process.communicate(timeout=budget + 30)  # generous only so that a hang fails, not blocks
        took = time.monotonic() - sent
    finally:
        reap(process)
    assert process.returncode == EXIT_OK, output
    # Before the fix: still running an hour later (the atexit destroy waits for the lock).
    assert took <= budget, f"the stop took {took:.1f} s, more than its {budget:.0f} s budget:\n{output}"
    assert DESTROY_TIMEOUT <= took, "the bridge did not even wait for the destroy"
    assert "tft_destroy_controller did not return within 2 s" in output
    assert "exits without running the controller's atexit destroy" in output


def test_sigterm_during_a_process_level_repair_exits_within_the_stop_budget(tmp_path: Path) -> None:
    """The case that hung: ClusterD (simulated, a real process) chose retry and the
    controller is repairing when SIGTERM arrives; its destroy never returns."""
    port = free_port()
    sim = spawn_bridge("sim-clusterd", "--listen", f"127.0.0.1:{port}", "--job", "job-stop", "--world-size", "4",
                       "--devices-per-pod", "4", "--keepalive", "0.5", "--phase-delay", "0.1", quiet=True)
    config_path = write_config(tmp_path, clusterd=f"127.0.0.1:{port}")
    config = load_config(config_path, env={})
    repairing = tmp_path / "repairing"
    process = spawn_bridge("run", "--config", str(config_path), code=RUN_WITH_HANGING_DESTROY,
                           env={"HANGING_CONTROLLER_REPAIR": str(repairing)})
    try:
        eventually_sync(lambda: repairing.exists() or process.poll() is not None, 60,
                        what="the controller repairing after ClusterD chose retry")
        assert process.poll() is None, process.communicate()[0]
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        budget = stop_budget(config)
        output, _ = process.communicate(timeout=budget + 30)
        took = time.monotonic() - sent
    finally:
        reap(process, sim)
    assert process.returncode == EXIT_OK, output
    assert took <= budget, f"the stop took {took:.1f} s, more than its {budget:.0f} s budget:\n{output}"
    assert "tft_destroy_controller did not return within 2 s" in output
    # Ranks were connected when the stop began: they outlive the controller, the marker stays.
    assert (tmp_path / "state" / "controller.json").exists()


def test_the_exit_deadline_ends_a_stuck_process_with_the_decided_code() -> None:
    """The last resort, armed when a stop begins: whatever step of the stop hangs (a
    notify call stuck in the controller keeps asyncio.run from returning), the process
    ends once the budget is spent, with the exit code the bridge had decided."""
    process = spawn_bridge(code="import threading; from bridge.job.daemon import arm_exit_deadline; "
                                "arm_exit_deadline(0.5, lambda: 76); threading.Event().wait()")
    try:
        output, _ = process.communicate(timeout=30)
    finally:
        reap(process)
    assert process.returncode == 76, output
    assert "the stop did not finish within" in output
