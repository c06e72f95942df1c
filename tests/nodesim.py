"""The node service on the stand-in API server, for its tests and the chaos runner.

A ``NodeRig`` is one simulated node: the service in a thread of the test process (or,
with :meth:`NodeRig.spawn`, as a real ``tft-bridge node`` process that a test can
SIGKILL), its bridges as real ``tft-bridge run`` processes with the stub controller, and
the helpers to read what the service did (bridge records, generated configurations,
Events on the pods). Every bridge a rig started is killed at teardown, pass or fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bridge.core.config import read_toml
from bridge.node import bridge_argv_for, child_env
from bridge.node.config import NodeConfig, build_node_config
from bridge.node.kube import PodApi
from bridge.node.launcher import SessionLauncher, records
from bridge.node.metrics import BridgeSeries, NodeMetrics
from bridge.node.procs import alive
from bridge.node.service import NodeService
from bridge.core import kube
from bridge.sim.kube.apiserver import StandInApiServer
from bridge.sim.kube.ascendjob import SimJob, SimJobs

from .conftest import eventually_sync
from .processes import ROOT


def node_toml(state_root: Path, server_url: str, clusterd: str, *, host_ip: str = "", node: str = "node-1",
              module: str = "stub", keepalive: float = 0.5, extra: str = "") -> str:
    return f"""
[node]
name = "{node}"
host_ip = "{host_ip}"
state_root = "{state_root}"
launcher = "session"
restart_delay = 0.5
ranks_leave_wait = 20.0
tick = 0.1
[kubernetes]
server = "{server_url}"
request_timeout = 2.0
connect_timeout = 1.0
watch_timeout = 30
[metrics]
port = 0
[bridge]
log_level = "INFO"
[bridge.clusterd]
{f'address = "{clusterd}"' if clusterd else ""}
keepalive_interval = {keepalive}
startup_wait = 1.0
reconnect_max = 2.0
[bridge.controller]
module = "{module}"
destroy_timeout = 10.0
{extra}
"""


class NodeRig:
    """One node: its configuration, its service (thread or process), its bridges."""

    def __init__(self, server: StandInApiServer, state_root: Path, clusterd: str, *, node: str = "node-1",
                 host_ip: str = "", module: str = "stub", keepalive: float = 0.5, extra: str = "",
                 env: dict[str, str] | None = None) -> None:
        self.server = server
        self.env = {"PYTHONPATH": str(ROOT), **(env or {})}
        self.state_root = state_root
        self.node = node
        state_root.mkdir(parents=True, exist_ok=True)
        self.config_path = state_root.parent / f"{node}.toml"
        self.config_path.write_text(node_toml(state_root, server.url, clusterd, host_ip=host_ip, node=node,
                                              module=module, keepalive=keepalive, extra=extra))
        self.reload()
        self.service: NodeService | None = None
        self.metrics: NodeMetrics | None = None
        self._thread: threading.Thread | None = None
        self.process: subprocess.Popen[str] | None = None

    def reload(self) -> None:
        """Read ``config_path`` again (after a test changed it)."""
        self.config: NodeConfig = build_node_config(read_toml(self.config_path))

    # ------------------------------------------------------------------ in-process service

    def start(self) -> NodeService:
        k = self.config.kubernetes
        api = PodApi(kube.api_client(server=k.server), self.node, request_timeout=k.request_timeout,
                     connect_timeout=k.connect_timeout)
        self.metrics = NodeMetrics()
        env = {**child_env(), **self.env}
        self.service = NodeService(self.config, api, SessionLauncher(env), self.metrics,
                                   bridge_argv=bridge_argv_for(self.config.node.bridge_command), env=env)
        service = self.service
        self.series = BridgeSeries(lambda: service.targets, timeout=self.config.metrics.scrape_timeout,
                                   served=lambda: service.served)
        self.metrics.registry.register(self.series)  # type: ignore[arg-type]
        self._thread = threading.Thread(target=self.service.run, name=f"node-service-{self.node}", daemon=True)
        self._thread.start()
        return self.service

    def stop(self) -> None:
        """The service only: its bridges keep running."""
        if self.service is not None and self._thread is not None:
            self.service.request_stop()
            self._thread.join(timeout=15)
            assert not self._thread.is_alive(), "the node service did not stop"
            self.service.api.close()
            self.series.close()
        self.service = None

    def scrape(self) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        """The node endpoint's samples: name -> {sorted labels: value}."""
        assert self.metrics is not None
        found: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in self.metrics.registry.collect():
            for sample in family.samples:
                found.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
        return found

    # ------------------------------------------------------------------ as a process

    def spawn(self) -> subprocess.Popen[str]:
        """``tft-bridge node`` as a process, its output appended to ``<node>.log`` beside the state."""
        with open(self.state_root.parent / f"{self.node}.log", "a") as output:
            self.process = subprocess.Popen([sys.executable, "-m", "bridge.cli", "node", "--config",
                                             str(self.config_path)], cwd=ROOT, stdin=subprocess.DEVNULL,
                                            stdout=output, stderr=subprocess.STDOUT, text=True,
                                            env={**os.environ, **self.env})
        return self.process

    def kill_process(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    # ------------------------------------------------------------------ what it did

    def records(self) -> dict[str, dict[str, Any]]:
        return {record.job_id: vars(record) for _, record in records(self.state_root)}

    def running(self) -> dict[str, int]:
        """job id -> keeper pid, for every recorded bridge whose keeper runs."""
        return {job: data["pid"] for job, data in self.records().items() if alive(data["pid"], data["start"])}

    def bridge_config(self, job: SimJob) -> dict[str, Any]:
        return read_toml(self.job_dir(job) / "bridge.toml")

    def job_dir(self, job: SimJob) -> Path:
        return self.state_root / job.uid

    def wait_running(self, job: SimJob, timeout: float = 30.0, pod_uid: str | None = None) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            data = self.records().get(job.uid)
            if data and alive(data["pid"], data["start"]) and (pod_uid is None or data["pod_uid"] == pod_uid):
                return data
            return None

        return eventually_sync(check, timeout, f"a running bridge for {job.name}")

    def wait_stopped(self, job: SimJob, timeout: float = 40.0) -> None:
        eventually_sync(lambda: job.uid not in self.running(), timeout, f"the bridge of {job.name} stopped")

    def log(self, job: SimJob) -> str:
        path = self.job_dir(job) / "bridge.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill_bridges(self) -> None:
        for _, record in records(self.state_root):
            if alive(record.pid, record.start):
                try:
                    os.killpg(record.pid, signal.SIGKILL)  # the keeper leads its session
                except OSError:
                    pass
        for directory in self.state_root.iterdir() if self.state_root.is_dir() else []:
            child = directory / "child.json"
            if child.exists():
                data = json.loads(child.read_text())
                if alive(data["pid"], data.get("start")):
                    try:
                        os.kill(data["pid"], signal.SIGKILL)
                    except OSError:
                        pass


class LoggedProcess:
    """A process whose output goes to a file (never a pipe nobody drains), and a wait for a line."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self._output = open(log, "w")
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=self._output, stderr=subprocess.STDOUT,
                                        stdin=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})

    def wait_for(self, text: str, timeout: float = 20.0, count: int = 1) -> None:
        eventually_sync(lambda: self.log.read_text(errors="replace").count(text) >= count, timeout,
                        f"{text!r} in {self.log.name}")

    def command(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._output.close()


def events(server: StandInApiServer, pod: dict[str, Any], reason: str | None = None) -> list[dict[str, Any]]:
    found = server.store.events_for(pod["metadata"]["uid"])
    return [e for e in found if reason is None or e["reason"] == reason]


@contextmanager
def rigs(*made: NodeRig) -> Iterator[tuple[NodeRig, ...]]:
    """Stop every rig's service and kill its bridges at the end, pass or fail."""
    try:
        yield made
    finally:
        for rig in made:
            try:
                rig.stop()
            finally:
                rig.kill_process()
                rig.kill_bridges()


__all__ = ["NodeRig", "SimJob", "SimJobs", "events", "rigs"]
