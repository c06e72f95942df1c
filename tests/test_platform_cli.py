"""``tft-bridge platform`` as an operator runs it: a real process against the stand-in
API server, scraped over HTTP, reloaded with SIGHUP and stopped with SIGTERM."""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bridge.platform import add_platform_parser, cmd_platform
from bridge.platform.annotations import ENABLE_LABEL, RESULT, STRATEGY
from bridge.sim.kube.apiserver import StandInApiServer
from bridge.sim.kube.podgroup_clusterd import SimPlatformClusterD

from .conftest import eventually_sync

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parent.parent


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tft-bridge")
    add_platform_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["platform", *argv])


def test_parser_defaults() -> None:
    args = parse([])
    assert args.func is cmd_platform
    assert (args.namespace, args.selector, args.metrics_address, args.metrics_port) == (None, None, "127.0.0.1", 9466)
    assert parse(["-n", "a", "-l", "x=y"]).selector == "x=y"


def test_check_prints_the_effective_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert cmd_platform(parse(["--check", "--policy", str(ROOT / "contrib/platform-policy.example.toml")])) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["namespaces"]["research"]["prefer"] == ["retry", "dump"]


def test_bad_policy_and_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text('[defaults]\nrank_table = "sometimes"\n')
    assert cmd_platform(parse(["--policy", str(bad)])) == 2
    assert "defaults.rank_table" in capsys.readouterr().err
    assert cmd_platform(parse(["--fault-source", "no.such.module:x"])) == 2
    assert cmd_platform(parse(["--resync", "0"])) == 2


def test_no_kubernetes_configuration_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("kubernetes")
    assert cmd_platform(parse(["--kubeconfig", str(tmp_path / "missing"), "--no-metrics"])) == 1
    assert "no Kubernetes configuration" in capsys.readouterr().err


def test_the_platform_package_does_not_import_the_client() -> None:
    code = "import sys, bridge.platform, bridge.cli; print('kubernetes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture
def server() -> Iterator[StandInApiServer]:
    with StandInApiServer() as srv:
        yield srv


def test_the_agent_process_end_to_end(server: StandInApiServer, tmp_path: Path) -> None:
    pytest.importorskip("kubernetes")
    policy = tmp_path / "policy.toml"
    policy.write_text('[defaults]\nstanding_strategy = "dump"\n')
    server.store.create("ml", "job", {STRATEGY: ""}, {ENABLE_LABEL: "on"})
    process = subprocess.Popen(
        [sys.executable, "-m", "bridge.platform", "--server", server.url, "--policy", str(policy),
         "--metrics-port", "0", "--resync", "0.2", "--log-level", "INFO"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def read_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.put(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()

    def wait_for_line(pattern: str, timeout: float = 10.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                continue
            log.append(line)
            found = re.search(pattern, line)
            if found:
                return found
        raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(log)}")

    try:
        port = int(wait_for_line(r"metrics on http://127\.0\.0\.1:(\d+)/metrics").group(1))
        eventually_sync(lambda: server.store.annotations("ml", "job").get(STRATEGY) == "dump", 10,
                        what="the standing strategy written")
        report = SimPlatformClusterD(server.store, "ml", "job").fault({0: 0, 1: 0})
        assert report.violations == [] and report.statuses == ["retry-success"]
        eventually_sync(lambda: RESULT not in server.store.annotations("ml", "job"), 5, what="the result cleared")

        policy.write_text('[defaults]\nstanding_strategy = "retry"\n')
        process.send_signal(signal.SIGHUP)
        wait_for_line(r"policy reloaded")
        eventually_sync(lambda: server.store.annotations("ml", "job").get(STRATEGY) == "retry", 5,
                        what="the reloaded policy's standing strategy written")

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        assert "tft_bridge_platform_cycles_total 1.0" in text
        assert 'tft_bridge_platform_answers_total{strategy="retry"} 1.0' in text
        assert 'tft_bridge_platform_policy_reloads_total{result="ok"} 1.0' in text
        assert "tft_bridge_platform_watch_up 1.0" in text

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        wait_for_line(r"platform agent stopped", timeout=5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)
        reader.join(timeout=5)  # EOF once the process is gone
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()
        process.stderr.close()
    assert not any("Traceback" in line for line in log), "".join(log)
