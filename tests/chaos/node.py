"""The ``node`` entry point: the node service under chaos on the stand-in API server.

A schedule here is two simulated nodes (``node-1`` on 127.0.0.1, ``node-2`` on
127.0.0.2), each running a real ``tft-bridge node`` process, up to three AscendJobs
whose pods come and go, and the events of ``NODE_KINDS``: pods added, deleted, pod 0
rescheduled to the other node, a job restarted under its UID (a new incarnation), the API
server down, slow, or answering 410, and a node service SIGKILLed and restarted. Bridges
are real ``tft-bridge run`` processes (the stub controller at its fast timings, through
``tests/node_stub_bridge.py`` without simulated ranks, so a stop waits for none).

A monitor samples, every ``SAMPLE`` s, the API server's store (what runs where) and the
processes of the machine (``/proc``: each ``bridge.cli run`` and the job directory it
serves), and the verdict checks (``check``):

* ``one-bridge-per-job``: never two bridge processes for one job on one node;
* ``no-stop-while-running``: no bridge process ends while the pod 0 it was started for
  still exists, bound to its node, not terminal and not being deleted (the service
  stops a bridge only on positive evidence that its job left);
* ``bridge-while-served``: once the events are over and every node service and the API
  server are back, every job's pod 0 has exactly one bridge, on its node, started for its
  UID, within ``SETTLE`` s.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.core.listen_ports import SLICE_ENV, child_slice

log = logging.getLogger("tests.chaos.node")

NODES = {"node-1": "127.0.0.1", "node-2": "127.0.0.2"}
JOBS = 3
#: Event kinds of the node entry point.
NODE_KINDS = ("pods_added", "pods_deleted", "pod_rescheduled", "job_restarted", "apiserver_down",
              "apiserver_slow", "apiserver_expired", "node_sigkill_restart")
SAMPLE = 0.1
SETTLE = 60.0


def draw(rng: random.Random) -> list[tuple[str, float, dict[str, Any]]]:
    """(kind, at, args) of one node schedule: every job added first, then 2-6 events."""
    jobs = rng.randint(1, JOBS)
    events: list[tuple[str, float, dict[str, Any]]] = [
        ("pods_added", round(rng.uniform(0, 1.0), 3), {"job": j, "node": rng.choice(list(NODES))}) for j in range(jobs)]
    for _ in range(rng.randint(2, 6)):
        kind = rng.choice(NODE_KINDS[1:])
        at = round(rng.uniform(1.0, 12.0), 3)
        args: dict[str, Any] = {}
        if kind in ("pods_deleted", "pod_rescheduled", "job_restarted"):
            args = {"job": rng.randrange(jobs)}
        if kind == "pods_deleted" and rng.random() < 0.5:
            args["again"] = round(rng.uniform(0.5, 4.0), 3)  # the job comes back (a new UID) this much later
        if kind == "apiserver_down":
            args = {"seconds": round(rng.uniform(0.5, 6.0), 3)}
        elif kind == "apiserver_slow":
            args = {"seconds": round(rng.uniform(1.0, 6.0), 3), "delay": round(rng.uniform(0.5, 4.0), 3)}
        elif kind == "node_sigkill_restart":
            args = {"node": rng.choice(list(NODES)), "down": round(rng.uniform(0.0, 3.0), 3)}
        events.append((kind, at, args))
    return events


@dataclass
class Sample:
    at: float
    pods: dict[str, tuple[str, str, bool]]  # job uid -> (pod 0 uid, node, live: bound, not terminal or deleting)
    bridges: dict[int, tuple[str, str]]  # bridge pid -> (node, job uid)
    served_for: dict[int, str] = field(default_factory=dict)  # bridge pid -> the pod uid of its record


def bridge_processes(roots: dict[str, Path]) -> dict[int, tuple[str, str]]:
    """Every bridge process (``... run --config <root>/<job>/bridge.toml``, not its keeper):
    pid -> (node, job)."""
    found: dict[int, tuple[str, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state == "Z" or b"run" not in argv or b"--config" not in argv or b"bridge.node.keeper" in argv:
            continue  # the keeper's own command line holds the bridge's: only the bridge counts
        config = Path(argv[argv.index(b"--config") + 1].decode(errors="replace"))
        for node, root in roots.items():
            if config.parent.parent == root and config.name == "bridge.toml":
                found[int(entry.name)] = (node, config.parent.name)
    return found


class NodeChaos:
    """One node schedule: the API server, two node services, the jobs, the monitor."""

    def __init__(self, events: list[tuple[str, float, dict[str, Any]]]) -> None:
        from bridge.sim.kube.apiserver import StandInApiServer
        from bridge.sim.kube.ascendjob import SimJob, SimJobs

        from ..nodesim import NodeRig
        from ..processes import ROOT

        self.events = events
        self._tmp = Path(tempfile.mkdtemp(prefix="tft-node-chaos-"))
        tmp = self._tmp
        # outside the ephemeral range: while it is down, no client's connection can take its port
        self.server = StandInApiServer(port=_port()).start()
        self.cluster = SimJobs(self.server.store, NODES)
        command = f'bridge_command = ["{sys.executable}", "{ROOT / "tests" / "node_stub_bridge.py"}"]'
        # Each node service picks its bridges' ports from a part of this process's slice of
        # its own, and this process from the first (``_port``): processes that cannot see
        # each other's picks never draw the same port.
        self.rigs = {node: NodeRig(self.server, tmp / node, "127.0.0.1:1", node=node, host_ip=ip,
                                   env={"NODE_STUB_RANKS": "0", SLICE_ENV: child_slice(2 + i, 1 + len(NODES))})
                     for i, (node, ip) in enumerate(NODES.items())}
        for rig in self.rigs.values():
            text = rig.config_path.read_text().replace("[kubernetes]", f"{command}\n[kubernetes]", 1)
            rig.config_path.write_text(text.replace("ranks_leave_wait = 20.0", "ranks_leave_wait = 5.0"))
            rig.reload()
        self.jobs = [SimJob(f"job-{j}", pods=2, devices_per_pod=2, ttp_port=_port()) for j in range(JOBS)]
        self.added: set[int] = set()
        self.samples: list[Sample] = []
        self.violations: dict[str, list[str]] = {}
        self.injected: dict[str, int] = {}
        self._monitor: asyncio.Task[None] | None = None
        self._api_lock = asyncio.Lock()
        self._node_locks = {node: asyncio.Lock() for node in NODES}
        self.ended: dict[int, str] = {}  # bridge pid -> its exit record and last log lines
        self.started_for: dict[int, str] = {}  # bridge pid -> the pod UID it was started for

    # ------------------------------------------------------------------ the run

    async def run(self) -> dict[str, list[str]]:
        try:
            for rig in self.rigs.values():
                rig.spawn()
            self._monitor = asyncio.ensure_future(self.monitor())
            await asyncio.gather(*(self.fire(kind, at, args) for kind, at, args in self.events))
            await self.restore()
            await self.settle()
        finally:
            if self._monitor is not None:
                self._monitor.cancel()
                await asyncio.gather(self._monitor, return_exceptions=True)
            self.check()
            self.close()
        return self.violations

    async def fire(self, kind: str, at: float, args: dict[str, Any]) -> None:
        await asyncio.sleep(at)  # the event's moment is the schedule's: the behaviour injected
        job = self.jobs[args["job"]] if "job" in args else None
        if kind == "pods_added" and job is not None:
            placement = {0: args["node"], 1: "node-2" if args["node"] == "node-1" else "node-1"}
            await asyncio.to_thread(self.cluster.create, job, placement)
            self.added.add(args["job"])
        elif kind in ("pods_deleted", "pod_rescheduled", "job_restarted") and job is not None:
            if args["job"] not in self.added:
                return
            if kind == "pods_deleted":
                await asyncio.to_thread(self.cluster.delete, job)
                self.added.discard(args["job"])
                if "again" in args:
                    await asyncio.sleep(args["again"])  # the job comes back later: the behaviour injected
                    job.uid = str(uuid.uuid4())
                    await asyncio.to_thread(self.cluster.create, job, {0: "node-1", 1: "node-2"})
                    self.added.add(args["job"])
            elif kind == "pod_rescheduled":
                current = self.cluster.pod(job)["spec"]["nodeName"]
                await asyncio.to_thread(self.cluster.reschedule, job, "node-2" if current == "node-1" else "node-1")
            else:
                await asyncio.to_thread(self.cluster.restart, job)
        elif kind == "apiserver_down":
            async with self._api_lock:  # two downs that overlap are one longer down, not two servers
                await asyncio.to_thread(self.server.stop)
                await asyncio.sleep(args["seconds"])  # down this long: the behaviour injected
                await asyncio.to_thread(self.server.start)
        elif kind == "apiserver_slow":
            self.server.delay = args["delay"]
            await asyncio.sleep(args["seconds"])  # slow this long: the behaviour injected
            self.server.delay = 0.0
        elif kind == "apiserver_expired":
            self.server.store.compact()
            self.server.store.expire_watches()
        elif kind == "node_sigkill_restart":
            rig = self.rigs[args["node"]]
            async with self._node_locks[args["node"]]:  # overlapping restarts: one service at a time
                rig.kill_process()
                await asyncio.sleep(args["down"])  # the service stays down this long: the behaviour injected
                rig.spawn()
        else:
            return
        self.injected[kind] = self.injected.get(kind, 0) + 1

    async def restore(self) -> None:
        self.server.delay = 0.0
        if self.server._server is None:
            await asyncio.to_thread(self.server.start)
        for rig in self.rigs.values():
            if rig.process is None or rig.process.poll() is not None:
                rig.spawn()

    # ------------------------------------------------------------------ observing

    def sample(self) -> Sample:
        from bridge.node.launcher import Record

        pods: dict[str, tuple[str, str, bool]] = {}
        for job in self.jobs:
            try:
                pod = self.cluster.pod(job)
            except Exception:  # no pod 0 now
                continue
            live = pod["status"].get("phase") not in ("Succeeded", "Failed") and \
                not pod["metadata"].get("deletionTimestamp")
            pods[job.uid] = (pod["metadata"]["uid"], pod["spec"]["nodeName"], live)
        roots = {node: rig.state_root for node, rig in self.rigs.items()}
        bridges = bridge_processes(roots)
        for pid, (node, job_dir) in bridges.items():
            if pid not in self.started_for:
                # Read once, at the process's first sighting: the record is written as its keeper
                # starts, before the keeper starts it, and rewritten only for the next bridge,
                # after this one ended. Read again later it may already be the next bridge's.
                record = Record.load(roots[node] / job_dir / "node.json")
                self.started_for[pid] = record.pod_uid if record is not None else ""
        return Sample(time.monotonic(), pods, bridges, {pid: self.started_for[pid] for pid in bridges})

    async def monitor(self) -> None:
        while True:
            sample = await asyncio.to_thread(self.sample)
            if self.samples:
                for pid, (node, job) in self.samples[-1].bridges.items():
                    if pid not in sample.bridges:  # how it ended, read before a restart rewrites the files
                        self.ended[pid] = self.how_it_ended(node, job)
            self.samples.append(sample)
            await asyncio.sleep(SAMPLE)  # the monitor's sampling period

    def how_it_ended(self, node: str, job: str) -> str:
        directory = self.rigs[node].state_root / job
        try:
            exit_text = (directory / "exit.json").read_text()
        except OSError:
            exit_text = "no exit.json"
        try:
            tail = (directory / "bridge.log").read_text(errors="replace").splitlines()[-3:]
        except OSError:
            tail = []
        return f"{exit_text}; log: {' | '.join(line[-160:] for line in tail)}"

    def settled(self, sample: Sample) -> bool:
        for job_uid, (pod_uid, node, live) in sample.pods.items():
            if not live:
                continue
            mine = [pid for pid, (n, j) in sample.bridges.items() if j == job_uid]
            if len(mine) != 1 or sample.bridges[mine[0]][0] != node or sample.served_for.get(mine[0]) != pod_uid:
                return False
        return all(j in sample.pods for _, j in sample.bridges.values())

    async def settle(self) -> None:
        deadline = time.monotonic() + SETTLE
        while time.monotonic() < deadline:
            if self.samples and self.settled(self.samples[-1]) and len(self.samples) > 2 and \
                    self.settled(self.samples[-2]):
                return
            await asyncio.sleep(SAMPLE)  # waiting for the monitor's next sample
        last = self.samples[-1] if self.samples else None
        self.add("bridge-while-served", f"not settled within {SETTLE:.0f} s: pods {last and last.pods}, "
                                        f"bridges {last and last.bridges}, records {last and last.served_for}; "
                                        f"{self.node_log_tails()}")

    def node_log_tails(self, lines: int = 8) -> str:
        """The last warnings and errors of each node service (``<node>.log``): why a job
        has no bridge."""
        tails = []
        for node, rig in self.rigs.items():
            try:
                text = (rig.state_root.parent / f"{node}.log").read_text(errors="replace")
            except OSError:
                text = ""
            notable = [line[-200:] for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
            tails.append(f"{node} log: {' | '.join(notable[-lines:]) or '(no warning or error)'}")
        return "; ".join(tails)

    def add(self, name: str, line: str) -> None:
        self.violations.setdefault(name, []).append(line)

    def check(self) -> None:
        for sample in self.samples:
            seen: dict[tuple[str, str], list[int]] = {}
            for pid, key in sample.bridges.items():
                seen.setdefault(key, []).append(pid)
            for (node, job), pids in seen.items():
                if len(pids) > 1:
                    self.add("one-bridge-per-job", f"{node}: bridges {pids} for job {job} at the same time")
        for before, after in pairs(self.samples):
            for pid, (node, job) in before.bridges.items():
                if pid in after.bridges:
                    continue
                pod = after.pods.get(job)
                started_for = before.served_for.get(pid, "")
                if pod is not None and pod[0] == started_for and pod[1] == node and pod[2]:
                    self.add("no-stop-while-running", f"{node}: the bridge {pid} of job {job} ended while its pod "
                                                      f"{started_for} still ran there ({self.ended.get(pid, '?')})")

    def close(self) -> None:
        for rig in self.rigs.values():
            rig.kill_process()
            rig.kill_bridges()
        for _ in range(2):  # whatever is left that names this schedule's directory: services first
            for pid in sorted(processes_under(self._tmp), key=lambda p: b" node " not in p[1]):
                try:
                    os.kill(pid[0], signal.SIGKILL)
                except OSError:
                    pass
        self.server.stop()
        if self.violations and os.environ.get("TFT_CHAOS_KEEP"):
            print(f"kept {self._tmp}")
            return
        shutil.rmtree(self._tmp, ignore_errors=True)


def processes_under(directory: Path) -> list[tuple[int, bytes]]:
    """(pid, command line) of every process whose command line names ``directory``."""
    found = []
    needle = str(directory).encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if needle in argv:
                found.append((int(entry.name), argv))
    return found


def pairs(samples: list[Sample]) -> Iterator[tuple[Sample, Sample]]:
    return zip(samples, samples[1:])


def _port() -> int:
    """A port for this process's listeners: the first part of its slice, the node
    services' being the others (``NodeChaos``)."""
    from bridge.core.listen_ports import free_port

    return free_port(within=child_slice(1, 1 + len(NODES)))
