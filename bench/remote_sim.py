"""The simulated ClusterD in a process of its own, for benchmarks.

In production ClusterD is another process (usually another machine); sharing the
bridge's interpreter would make the server's decoding compete with the bridge for the
GIL and distort every latency. The child prints each journal entry as one JSON line
(CLOCK_MONOTONIC is shared by all processes of a machine, so its times compare with the
parent's ``time.monotonic()``) and takes commands on stdin: ``pause JOB``,
``fault JOB RANK:TYPE,...``.

    python bench/remote_sim.py --child --listen 127.0.0.1:PORT --job JOB [...]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from child_server import ChildServer  # bench/ is this script's directory: on sys.path


#: The job's strategies unless a bench asks for others: no ``retry``, because the
#: latency benches report type-0 (UCE) maps over and over and rely on them starting no
#: cycle, and with retry configured ClusterD's fault centre turns a UCE report alone into
#: a retry cycle (docs/clusterd.md section 7). A bench that runs retry cycles (soak.py)
#: passes its own.
MEASURING_STRATEGIES: tuple[str, ...] = ("recover", "dump", "exit")


@dataclass
class Entry:
    seq: int
    at: float
    kind: str
    name: str
    detail: dict[str, Any] = field(default_factory=dict)


class RemoteSim(ChildServer):
    """Parent side: start the child, collect its journal, send commands."""

    #: The child's nice value (``os.nice`` before it starts a thread). A negative value
    #: stands for where ClusterD really runs: on another machine, out of reach of the
    #: busy processes a benchmark puts on this node's cores (bench_loaded --clusterd-nice).
    #: Needs the privilege to raise a priority; without it the child says so and runs at 0.
    nice = 0
    #: SCHED_FIFO priority of the child and every thread it starts (0: the normal policy).
    #: Since the bridge's loop and report thread are realtime (priority 1), a nice value no
    #: longer keeps ClusterD out of their reach on the benchmark's shared cores: priority 2
    #: does (bench_loaded --clusterd-fifo). Needs privilege, like ``nice``.
    fifo = 0

    def __init__(self, listen: str, job: str, world_size: int, devices_per_pod: int = 8,
                 keepalive: float = 1.0, phase_delay: float = 0.05, dump_exit_repeat: float = 0.5,
                 rank_sets: bool = True, strategies: tuple[str, ...] = MEASURING_STRATEGIES) -> None:
        argv = [sys.executable, __file__, "--child", "--listen", listen, "--job", job,
                "--world-size", str(world_size), "--devices-per-pod", str(devices_per_pod),
                "--keepalive", str(keepalive), "--phase-delay", str(phase_delay),
                "--dump-exit-repeat", str(dump_exit_repeat), "--strategies", ",".join(strategies)]
        if RemoteSim.nice:
            argv += ["--nice", str(RemoteSim.nice)]
        if RemoteSim.fifo:
            argv += ["--fifo", str(RemoteSim.fifo)]
        if not rank_sets:
            # A fault report's rank list, parsed from JSON on the measured process's
            # event loop, holds the GIL ~9 ms per 100 000 ranks: only when asked for.
            argv.append("--no-rank-sets")
        super().__init__(argv)
        self.entries: list[Entry] = []
        self._changed = asyncio.Event()
        self.violations: list[str] = []

    async def wait_listening(self) -> None:
        await self.wait_for(lambda e: e.kind == "listening", timeout=20)

    async def on_line(self, data: dict[str, Any]) -> None:
        if data["kind"] == "violation":
            self.violations.append(data["name"])
        self.entries.append(Entry(data["seq"], data["at"], data["kind"], data["name"], data.get("detail", {})))
        self._changed.set()

    async def wait_for(self, predicate: Callable[[Entry], bool], timeout: float = 10.0, after: int = -1) -> Entry:
        """The first entry with ``seq > after`` matching ``predicate``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # Entries arrive in seq order: start past ``after`` instead of rescanning the whole
        # journal, which grows all run long and shares the event loop with the bridge
        # being measured (a full scan per wait stalled it for milliseconds).
        checked = bisect.bisect_right(self.entries, after, key=lambda e: e.seq)
        while True:
            for index in range(checked, len(self.entries)):
                entry = self.entries[index]
                if entry.seq > after and predicate(entry):
                    return entry
            checked = len(self.entries)
            self._changed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError("no matching entry from the simulated ClusterD")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    @property
    def last_seq(self) -> int:
        return self.entries[-1].seq if self.entries else -1


# --------------------------------------------------------------------------- child

async def _child(args: argparse.Namespace) -> None:
    from bridge.sim.clusterd import SimClusterD, SimJob
    from bridge.sim.clusterd_timings import FAST

    # The real delays / 100 (a bench measures the bridge, not ClusterD's sleeps), then the
    # ones the parent chose.
    strategies = tuple(name for name in args.strategies.split(",") if name)
    sim = SimClusterD([SimJob(args.job, world_size=args.world_size, devices_per_pod=args.devices_per_pod,
                              strategies=strategies)],
                      timings=FAST, keepalive_interval=args.keepalive, global_fault_delay=args.phase_delay,
                      flush_delay=0.01, dump_exit_repeat=args.dump_exit_repeat)
    out = sys.stdout

    def emit(kind: str, name: str, seq: int, at: float, detail: dict[str, Any]) -> None:
        out.write(json.dumps({"seq": seq, "at": at, "kind": kind, "name": name, "detail": detail}) + "\n")
        out.flush()

    def on_entry(entry: Any) -> None:
        detail = {k: v for k, v in entry.detail.items() if k in ("uuid", "actions", "changeStrategy", "stream", "value")}
        if "faults" in entry.detail:
            detail["ranks"] = len(entry.detail["faults"])
            if args.rank_sets:
                detail["rank_set"] = sorted(entry.detail["faults"]) if entry.name == "ReportProcessFault" else []
        if "status" in entry.detail and entry.detail["status"]:
            detail["code"] = entry.detail["status"].get("code")
        emit(entry.kind, entry.name, entry.seq, entry.at, detail)

    sim.journal.add_listener(on_entry)
    await sim.start(args.listen)
    emit("listening", sim.address or "", 0, time.monotonic(), {})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = (await reader.readline()).decode().split()
        if not line:
            break
        try:
            if line[0] == "pause":
                await sim.pause(line[1], timeout=60)
            elif line[0] == "fault":
                from bridge.faults import parse_faults

                await sim.start_clusterd_fault(line[1], parse_faults(line[2]))
        except Exception as error:  # report it; the benchmark decides what it means
            emit("error", f"{line[0]}: {error}", 0, time.monotonic(), {})
    for violation in sim.violations:
        emit("violation", violation, -1, time.monotonic(), {})
    await sim.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--devices-per-pod", type=int, default=8)
    parser.add_argument("--keepalive", type=float, default=1.0)
    parser.add_argument("--phase-delay", type=float, default=0.05)
    parser.add_argument("--dump-exit-repeat", type=float, default=0.5)
    parser.add_argument("--strategies", default=",".join(MEASURING_STRATEGIES))
    parser.add_argument("--no-rank-sets", dest="rank_sets", action="store_false")
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("--fifo", type=int, default=0)
    child_args = parser.parse_args()
    if child_args.fifo:
        try:  # before any thread exists, without SCHED_RESET_ON_FORK: every thread inherits it
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(child_args.fifo))
        except OSError as error:
            print(f"remote_sim: SCHED_FIFO {child_args.fifo} refused ({error}); normal policy", file=sys.stderr)
    if child_args.nice:
        try:
            os.nice(child_args.nice)  # before any thread exists: every thread of the child inherits it
        except OSError as error:
            print(f"remote_sim: nice {child_args.nice} refused ({error}); running at 0", file=sys.stderr)
    asyncio.run(_child(child_args))
