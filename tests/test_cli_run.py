"""The commands as an operator runs them: ``sim-clusterd`` and ``run`` as real processes
(READY/WATCHDOG/STOPPING on a real notify socket, SIGTERM), and ``demo``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from bridge.cli import main
from bridge.sim.clusterd_release import RELEASES
from bridge.sim.scenario import free_port

from .gated_demo import GATE_PROMPT
from .processes import reap, spawn_bridge

pytestmark = pytest.mark.timeout(90)


def wait_for_line(process: subprocess.Popen[str], text: str, timeout: float = 20) -> list[str]:
    assert process.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    os.set_blocking(process.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line:
            seen.append(line)
            if text in line:
                return seen
        else:
            time.sleep(0.02)
    raise AssertionError(f"{text!r} not seen; output:\n{''.join(seen)}")


@pytest.mark.parametrize("release", ["master", "7.3", "7.0"])
def test_run_against_sim_clusterd_as_systemd_would(tmp_path: Path, release: str) -> None:
    port = free_port()
    sim = spawn_bridge("sim-clusterd", "--listen", f"127.0.0.1:{port}", "--job", "job-cli", "--world-size", "8",
                       "--devices-per-pod", "4", "--keepalive", "0.5", "--phase-delay", "0.1", "--release", release)
    notify_path = str(tmp_path / "notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(20)
    config = tmp_path / "job.toml"
    config.write_text(f"""
job_id = "job-cli"
[clusterd]
address = "127.0.0.1:{port}"
keepalive_interval = 0.5
[controller]
module = "stub"
port = {free_port()}
world_size = 8
[metrics]
port = 0
""")
    bridge = None
    try:
        wait_for_line(sim, f"simulated ClusterD {RELEASES[release].version}")
        bridge = spawn_bridge("run", "--config", str(config), env={
            "NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "1000000", "JOURNAL_STREAM": "1:1"})
        messages = []
        while not any(m.startswith(b"READY=1") for m in messages):
            messages.append(listener.recv(4096))
        ready = next(m for m in messages if m.startswith(b"READY=1")).decode()
        assert "STATUS=" in ready
        wait_for_line(sim, "stream-open SubscribeProcessManageSignal")
        while b"WATCHDOG=1" not in messages:
            messages.append(listener.recv(4096))
        bridge.send_signal(signal.SIGTERM)
        while not any(m.startswith(b"STOPPING=1") for m in messages):
            messages.append(listener.recv(4096))
        output, _ = bridge.communicate(timeout=30)
        assert bridge.returncode == 0, output
        assert not any(line[:4].isdigit() for line in output.splitlines())  # no timestamps under journald
    finally:
        listener.close()
        for process in (bridge, sim):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.communicate(timeout=30)
    assert sim.returncode == 0  # the simulated ClusterD saw no protocol violation


def test_run_logs_the_wait_warning_at_start(tmp_path: Path) -> None:
    """The same warning check-config prints, in the daemon's log as it starts (no ClusterD
    needed: the warning comes before the bridge reaches it)."""
    config = tmp_path / "job.toml"
    config.write_text(f"""
job_id = "job-warn"
[clusterd]
address = "127.0.0.1:{free_port()}"
reconnect_max = 2.0
startup_wait = 0.5
[controller]
module = "stub"
port = {free_port()}
wait_mindx_time = 10
[metrics]
enabled = false
""")
    bridge = spawn_bridge("run", "--config", str(config))
    try:
        seen = wait_for_line(bridge, "controller.wait_mindx_time (MINDIO_WAIT_MINDX_TIME) = 10 s is not longer")
        assert "ends in EXIT" in seen[-1]
        bridge.send_signal(signal.SIGTERM)
        bridge.communicate(timeout=30)
        assert bridge.returncode == 0
    finally:
        reap(bridge)


def test_run_with_a_bad_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('job_id = "j"\n[controller]\nworld_size = 0\n')
    assert main(["run", "--config", str(config)]) == 2
    assert "controller.world_size: must be in 1..100000" in capsys.readouterr().err


def test_run_fails_cleanly_when_the_controller_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        config = tmp_path / "job.toml"
        config.write_text(f"""
job_id = "j"
[clusterd]
address = "127.0.0.1:{free_port()}"
startup_wait = 0.2
[controller]
module = "stub"
port = {taken}
[metrics]
enabled = false
""")
        process = spawn_bridge("run", "--config", str(config))
        output, _ = process.communicate(timeout=60)
    assert process.returncode == 1, output
    assert "tft_start_controller(127.0.0.1:" in output and "SystemExit" in output


@pytest.mark.parametrize("release", ["master", "7.3", "7.0"])
@pytest.mark.parametrize("scenario", ["retry", "exit"])
def test_demo(scenario: str, release: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--scenario", scenario, "--release", release]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "outcome:   as expected" in out
    assert "protocol violations 0" in out
    assert "ClusterD  sends stopTrain" in out
    # The demo ends as a job does (ranks killed, then the bridge stopped): no orphan marker.
    assert "keeping the controller marker" not in captured.err
    if scenario == "retry":
        assert "writes ProcessRecoverStatus=retry-success" in out
        assert "metrics were served at http://127.0.0.1:" in out
        if release == "7.3":  # the repeated cycle, shown for what it is
            assert "writes ProcessRecoverStatus=retry-failed" in out
            assert "repeated cycles: 1" in out


def rest_of_output(process: subprocess.Popen[str], timeout: float) -> str:
    """What ``process`` writes until it exits (within ``timeout``), after ``wait_for_line``."""
    process.wait(timeout=timeout)
    assert process.stdout is not None
    os.set_blocking(process.stdout.fileno(), True)
    return process.stdout.read()


ORPHAN_WARNING = "keeping the controller marker"  # bridge.job.session.orphan: a controller stopped under connected ranks


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_the_hold_and_then_the_job_as_usual(signum: signal.Signals) -> None:
    """``--hold`` is ended early the way every long-running command is stopped (the
    first SIGTERM/SIGINT asks, bridge/core/interrupts.py); the job still ends as jobs do, its
    ranks first, so no orphan marker is left and the summary is printed. SIGINT counts
    even where the demo was started with it ignored (a background job of a script)."""
    demo = spawn_bridge("demo", "--scenario", "retry", "--hold", "600")
    try:
        wait_for_line(demo, "holding for", timeout=40)
        demo.send_signal(signum)
        rest = rest_of_output(demo, timeout=30)
        assert demo.returncode == 0, rest
        assert "outcome:   as expected" in rest
        assert "flight record:" in rest
        assert ORPHAN_WARNING not in rest
    finally:
        reap(demo)


def test_a_stop_signal_before_the_scenario_ends_cuts_it_short_and_ends_the_job() -> None:
    """Stopped while the scenario still runs (held at its gate: the fault not injected
    yet), the demo says so, skips the hold and still ends the job cleanly."""
    demo = spawn_bridge("demo", "--scenario", "retry", "--hold", "600", stdin=subprocess.PIPE,
                        code="import sys; from tests.gated_demo import main; sys.exit(main(sys.argv[1:]))")
    try:
        wait_for_line(demo, GATE_PROMPT, timeout=40)
        demo.send_signal(signal.SIGTERM)
        rest = rest_of_output(demo, timeout=30)
        assert demo.returncode == 1, rest
        assert "interrupted before the scenario ended" in rest
        assert "holding for" not in rest
        assert ORPHAN_WARNING not in rest
    finally:
        reap(demo)


def test_demo_hold_serves_non_zero_recovery_metrics() -> None:
    import urllib.request

    port = free_port()
    demo = spawn_bridge("demo", "--scenario", "retry", "--hold", "10", "--metrics-port", str(port))
    try:
        wait_for_line(demo, "holding for", timeout=40)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'tft_bridge_recovery_cycles_total{outcome="success",strategy="retry"} 1.0' in body
        assert 'tft_bridge_reports_sent_total{kind="result"} 1.0' in body
        assert "tft_bridge_recovery_duration_seconds_count" in body
    finally:
        demo.send_signal(signal.SIGINT)
        demo.communicate(timeout=30)
