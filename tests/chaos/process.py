"""The third entry point: a real ``tft-bridge run`` process (tests/processes.py's
``spawn_bridge``), SIGTERMed, or SIGKILLed and started again as systemd's
``Restart=on-failure`` would, with ClusterD simulated in the runner's process.

Its stub controller runs inside the bridge process (``tests.chaos.bridge_process``), so
faults go to it over stdin and its observation log comes back through a file; the
stub's records carry CLOCK_MONOTONIC, shared by every process of the machine, so they
order against ClusterD's journal as the in-process ones do.
"""

from __future__ import annotations

import ast
import asyncio
import json
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bridge.sim.mindio_ttp import Record
from bridge.sim.scenario import free_port

from ..processes import reap, spawn_bridge
from .harness import CLUSTERD_TIMINGS, JOB, WATCHDOG_INTERVALS, Harness, recorded_successes, start_proxied_sim
from .schedule import RPC_TIMEOUT, WAIT, WORLD_SIZE

#: The bridge's controller.destroy_timeout here: a slow destroy past it must still end
#: within the stop budget.
DESTROY_TIMEOUT = 3.0


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


class ProcessHarness(Harness):
    entry = "process"

    def __init__(self) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="tft-chaos-process-", ignore_cleanup_errors=True)
        self.records_path = Path(self.dir.name) / "records.jsonl"
        self.records_path.touch()
        self.process: subprocess.Popen[str] | None = None
        self.stop_requested_at: float | None = None
        self._stopped: tuple[int | None, float] | None = None
        self.metrics_port = free_port()
        self.metric_successes = 0.0
        #: the bridge ended on its own (76, the controller ended): its metrics went with it
        self.metrics_lost = False
        self.incarnations = 0
        self._spawned_at = 0.0

    def _config(self, address: str) -> Path:
        from bridge.core.config import load_config
        from bridge.job.daemon import stop_budget

        path = Path(self.dir.name) / "bridge.toml"
        path.write_text(f"""
job_id = "{JOB}"
[clusterd]
address = "{address}"
keepalive_interval = {CLUSTERD_TIMINGS.keepalive_interval}
watchdog_intervals = {WATCHDOG_INTERVALS}
rpc_timeout = {RPC_TIMEOUT}
reconnect_initial = 0.02
reconnect_max = 0.5
startup_wait = 2.0
retry_record_hold = {CLUSTERD_TIMINGS.retry_record_hold}
fault_centre_period = {CLUSTERD_TIMINGS.fault_centre_period}
[controller]
module = "stub"
bind_ip = "127.0.0.1"
port = {free_port()}
world_size = {WORLD_SIZE}
wait_mindx_time = {WAIT}
enable_arf = true
destroy_timeout = {DESTROY_TIMEOUT}
# the ranks of a schedule stay connected to the end: no wait for their loss, as SimulatedJob
rank_loss_wait = 0
state_directory = "{self.dir.name}/state"
[metrics]
enabled = true
port = {self.metrics_port}
[recorder]
enabled = true
directory = "{self.dir.name}/recorder"
""")
        self.stop_budget = stop_budget(load_config(str(path)))
        return path

    async def start(self) -> None:
        self.sim, self.proxy, address = await start_proxied_sim()
        self.config_path = self._config(address)
        await self._spawn()

    async def _spawn(self) -> None:
        self.incarnations += 1
        spawned_at = self._spawned_at = time.monotonic()
        self.process = spawn_bridge(str(self.config_path), str(self.records_path),
                                    code="import sys; from tests.chaos.bridge_process import main; "
                                         "sys.exit(main(sys.argv[1:]))",
                                    quiet=True, stdin=subprocess.PIPE)
        await self.sim.wait_for(lambda e: e.kind == "stream-open" and e.job_id == JOB and e.at >= spawned_at, 30)
        await self._until(lambda: any(r.kind == "training" and r.name == "connect" for r in self._fresh_records()),
                          30, "the ranks connected to the new controller")

    def _fresh_records(self) -> list[Record]:
        return [r for r in self.records() if r.t >= self._spawned_at]

    async def _until(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline or (self.process is not None and self.process.poll() is not None):
                raise RuntimeError(f"process entry point: {what} did not happen within {timeout} s "
                                   f"(bridge exit code {self.process.poll() if self.process else None})")
            await asyncio.sleep(0.02)  # the poll of a bounded wait (deadline above), as eventually() polls

    def _send(self, command: dict[str, Any]) -> None:
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(command) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def records(self) -> list[Record]:
        out = []
        for line in self.records_path.read_text(encoding="utf-8").splitlines():
            try:
                raw = json.loads(line)
            except ValueError:
                continue  # the last line of a SIGKILLed writer
            result = _literal(raw["result"])
            out.append(Record(raw["t"], raw["kind"], raw["name"], tuple(_literal(raw["args"]) or ()), result))
        return out

    def stub_violations(self) -> list[str]:
        return [r.name for r in self.records() if r.kind == "violation"]

    def stub_state(self) -> str:
        states = [r.name for r in self.records() if r.kind == "state"]
        return states[-1] if states else "UNINIT"

    def inject(self, faults: dict[int, int]) -> None:
        self._send({"fault": {str(r): t for r, t in faults.items()}})

    def connected(self, rank: int) -> bool:
        return self.process is not None and self.process.poll() is None

    def set_destroy_delay(self, seconds: float) -> None:
        self._send({"destroy_delay": seconds})

    def slow_notifies(self, delay: float, count: int) -> None:
        pass  # the notify functions live in the bridge process: in-process entry points only

    def subscribed(self) -> bool:
        try:
            body = self._scrape()
        except OSError:
            return False
        return "tft_bridge_subscription_up 1.0" in body

    def _scrape(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as answer:
            return answer.read().decode()

    def _successes_now(self) -> float:
        """The bridge's successful retry and recover cycles, read from its endpoint while
        it runs; a bridge that already exited on its own took them with it."""
        total = 0.0
        try:
            body = self._scrape()
        except OSError:
            self.metrics_lost = True
            return 0.0
        for line in body.splitlines():
            if line.startswith("tft_bridge_recovery_cycles_total{") and 'outcome="success"' in line \
                    and ('strategy="retry"' in line or 'strategy="recover"' in line):
                total += float(line.rsplit(" ", 1)[1])
        return total

    async def request_stop(self) -> tuple[int | None, float]:
        if self._stopped is not None:
            return self._stopped
        assert self.process is not None
        self.metric_successes += await asyncio.to_thread(self._successes_now)
        started = time.monotonic()
        self.stop_requested_at = started
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code: int | None = await asyncio.to_thread(self.process.wait, self.stop_budget + 5)
        except subprocess.TimeoutExpired:
            code = None
        self._stopped = (code, time.monotonic() - started)
        return self._stopped

    async def sigkill_restart(self) -> None:
        """kill -9 (an OOM kill), then systemd's restart: a new bridge, a new controller;
        the job's ranks restart with it (they cannot join the new controller otherwise)."""
        assert self.process is not None
        self.metric_successes += await asyncio.to_thread(self._successes_now)
        self.process.kill()
        await asyncio.to_thread(self.process.wait)
        reap(self.process)
        await self._spawn()

    def success_counts(self) -> dict[str, float | None]:
        recorded = recorded_successes(f"{self.dir.name}/recorder")
        return {"metrics": None if self.metrics_lost else self.metric_successes, "recorder": float(recorded)}

    async def close(self) -> None:
        try:
            if self._stopped is None and self.process is not None:
                await self.request_stop()
        finally:
            reap(self.process)
            await self.sim.stop()
            await self.proxy.close()
            self.dir.cleanup()
