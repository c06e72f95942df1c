"""One job on the real peers: ClusterD, an entry point hosting the real controller, 4 ranks.

``RealJob`` puts tests/conformance/peers.py's parts together in the order MindCluster
starts them (ClusterD; the controller listening and subscribed; the ranks), with the
node agent following ClusterD's fault lists, and takes everything down again (process
groups, killed) however the test ends. ``transcript()`` reads the run back as a
tests/conformance/transcript.py ``Transcript``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from types import TracebackType

from ..conftest import eventually_sync
from . import transcript as tr
from .peers import ENTRIES, ClusterDHarness, Entry, HarnessOptions, NodeAgent, Ranks


class RealJob:
    """ClusterD (``options``), one entry point (``"daemon"`` or ``"seed"``) hosting the
    real controller, ``options.world_size`` ranks, and the node agent; every log under
    ``workdir``."""

    def __init__(self, peers: Path, workdir: Path, entry: str, options: HarnessOptions | None = None, *,
                 wait_mindx_time: int = 30, clusterd_port: int = 0, step_sleep: float = 0.2,
                 node_agent: bool = True) -> None:
        self.peers = peers
        self.workdir = workdir
        self.options = options or HarnessOptions()
        self.clusterd = ClusterDHarness(peers, self.options, workdir, port=clusterd_port)
        self.entry: Entry = ENTRIES[entry](peers, self.clusterd, workdir, wait_mindx_time=wait_mindx_time)
        self.ranks = Ranks(peers, self.options.world_size, self.entry.ttp_port, workdir, devs=self.options.devs,
                           step_sleep=step_sleep)
        self.agent = NodeAgent(self.clusterd, self.ranks) if node_agent else None

    def start(self, *, fault_rank: int = -1, fault_step: int = 8, fault_kind: str = "none",
              timeout: float = 60.0) -> RealJob:
        """ClusterD, then the entry (controller listening, subscribed), then every rank
        (``fault_*`` as fake_rank.py's knobs), then waits until every rank registered."""
        self.clusterd.start()
        if self.agent is not None:
            self.agent.start()
        self.entry.start(timeout)
        self.ranks.start(fault_rank=fault_rank, fault_step=fault_step, fault_kind=fault_kind)
        eventually_sync(lambda: len({e["src"] for e in self.ranks.events("registered")}) == self.options.world_size,
                        timeout, "every rank registered with the controller")
        return self

    def close(self) -> None:
        try:
            if self.agent is not None:
                self.agent.stop()
        finally:
            self.ranks.close()
            self.entry.close()
            self.clusterd.stop()

    def __enter__(self) -> RealJob:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def transcript(self, outcome: bool = True) -> tr.Transcript:
        """Every side's steps, merged in the order they were seen (the bridge's recorder
        keeps wall time; it is put on the same monotonic clock)."""
        offset = time.time() - time.monotonic()
        bridge = [_shifted(s, offset) for s in tr.bridge_steps(self.entry.bridge_events())]
        steps = [*tr.clusterd_steps(self.clusterd.log.lines(), self.options.release),
                 *tr.controller_steps(self.entry.log.lines()), *bridge]
        steps.sort(key=lambda s: s.at)
        status = None
        if outcome and self.clusterd.process is not None and self.clusterd.process.poll() is None:
            status = self.clusterd.annotation("ProcessRecoverStatus")
        return tr.Transcript(steps, status, self.entry.exit_code())

    def dump(self) -> str:
        """For a failing test's message: where the logs are, and the transcript so far."""
        try:
            text = str(self.transcript(outcome=False))
        except Exception as error:  # noqa: BLE001 - a diagnostic must not hide the failure
            text = f"(no transcript: {error!r})"
        return f"logs in {self.workdir}\n{text}"


def _shifted(step: tr.Step, offset: float) -> tr.Step:
    return replace(step, at=step.at - offset) if step.at else step
