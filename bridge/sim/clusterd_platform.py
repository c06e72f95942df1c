"""ClusterD's platform mode: the PodGroup exchange of one job, the one model both simulations play.

The recover controller's platform mode (docs/clusterd.md, section 10), each wait polling
every ``poll`` for at most ``wait`` (the real 3 s and 300 s: ``clusterd_timings.REAL``):

* at a fault, before anything is sent, it waits for the platform's strategy (retry,
  recover or dump); none in time is 508 (:meth:`PlatformMode.wait_strategy`);
* before the globalFault it writes its faults into ``ProcessConfirmFault``, refused at
  once while the previous confirm is still there, waits for the key
  ``ProcessResultFault``, merges, re-reads the strategy (``exit`` now allowed); any
  failure is 509 (:meth:`PlatformMode.confirm`);
* the platform's strategy gates the job's retry/recover/dump, and a recover waits for
  ``RankTableReady`` (:meth:`PlatformMode.rank_table`).

The rules (strategy reading, confirm refusal, merge, rank-table reading, veto) are
:mod:`bridge.sim.clusterd_rules`'s; this module owns the order of the exchange and its
waits. Two front-ends drive it: :class:`JournaledPlatform` inside the gRPC simulated
ClusterD (journals ``platform`` entries named as the real log lines), and
:class:`bridge.sim.kube.podgroup_clusterd.SimPlatformClusterD` on the stand-in API
server's PodGroup store. Everything runs on the caller's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from bridge.sim import clusterd_rules as rules
from bridge.sim.clusterd_rules import FaultPair
from bridge.sim.clusterd_timings import Timings

T = TypeVar("T")

#: Why a confirm exchange failed (509), as ClusterD logs it.
NOT_CLEAR = "plat not clear pre confirm fault"
NO_RESULT = "wait process result fault: ProcessResultFault never appeared"
NO_STRATEGY = "confirm plat strategy: not retry/recover/dump/exit"


class PodGroupSide(Protocol):
    """The job's PodGroup as platform mode sees it: its annotations, one key written at a time."""

    def annotations(self) -> Mapping[str, str]: ...
    def write(self, key: str, value: str) -> None: ...


@dataclass
class Confirmed:
    """One confirm exchange: ``failure`` is None when it went through (then ``strategy``
    is the platform's confirm-step strategy and ``merged`` the faults the cycle goes on
    with); ``written`` is None when ClusterD refused to write, ``result`` None when the
    result never came."""

    written: str | None = None
    result: str | None = None
    merged: list[FaultPair] = field(default_factory=list)
    strategy: str | None = None
    failure: str | None = None
    #: the ProcessConfirmFault that blocked the write (``failure == NOT_CLEAR``)
    blocking_confirm: str = ""


class PlatformMode:
    """One job's platform-mode exchange over its PodGroup (owned by the front-end that
    built it; not thread-safe: one event loop drives it)."""

    def __init__(self, podgroup: PodGroupSide, poll: float, wait: float) -> None:
        self.podgroup = podgroup
        self.poll = poll
        self.wait = wait
        #: ``ctl.platStrategy``: the platform's last strategy read; "" after :meth:`reset`.
        self.strategy = ""

    def reset(self) -> None:
        """The job's reset forgets the platform's strategy."""
        self.strategy = ""

    def job_strategies(self, configured: Sequence[str]) -> tuple[str, ...]:
        """The job's strategies as the choice sees them under the platform's strategy."""
        return rules.platform_job_strategies(configured, self.strategy)

    async def wait_strategy(self) -> str | None:
        """``WaitPlatFormStrategyReady``: the strategy, or None after the wait (508)."""
        value = await self._poll(lambda a: rules.platform_strategy(a, confirm=False))
        if value is not None:
            self.strategy = value
        return value

    async def confirm(self, written: Sequence[FaultPair], text: str) -> Confirmed:
        """``writeConfirmFaultAndWaitPlatResultFault``: write ``text`` (ClusterD writes
        ``faults_string`` of its deduplicated ``written``), wait for the result key, merge
        ``written`` with the result and the confirm as re-read, re-read the strategy."""
        out = Confirmed()
        annotations = self.podgroup.annotations()
        if rules.confirm_not_clear(annotations):
            out.failure, out.blocking_confirm = NOT_CLEAR, annotations[rules.CONFIRM_FAULT]
            return out
        self.podgroup.write(rules.CONFIRM_FAULT, text)
        out.written = text
        found = await self._poll(lambda a: dict(a) if rules.RESULT_FAULT in a else None)
        if found is None:
            out.failure = NO_RESULT
            return out
        out.result = found[rules.RESULT_FAULT]
        out.merged = rules.merge_platform_faults(written, out.result, found.get(rules.CONFIRM_FAULT, ""))
        out.strategy = self.reread_strategy()
        if out.strategy is None:
            out.failure = NO_STRATEGY
        return out

    async def rank_table(self) -> str:
        """``WaitRankTableReady``: "ready" once "true"; "failed" at once for any other
        value; "timeout" after the wait while it stays absent or empty."""
        state = await self._poll(lambda a: None if (s := rules.rank_table_state(a)) == "waiting" else s)
        return state or "timeout"

    def reread_strategy(self) -> str | None:
        """``platFormStrategy`` in confirm mode (``exit`` allowed); remembered, "" if unusable."""
        plat = rules.platform_strategy(self.podgroup.annotations(), confirm=True)
        self.strategy = plat or ""
        return plat

    async def _poll(self, read: Callable[[Mapping[str, str]], T | None]) -> T | None:
        """Read, then every poll period until ``read`` gives a value; None once the wait
        is over (checked after each sleep, before the read, as the real loops do)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        value = read(self.podgroup.annotations())
        while value is None:
            await asyncio.sleep(self.poll)
            if loop.time() - start > self.wait:
                return None
            value = read(self.podgroup.annotations())
        return value


class PlatformHost(Protocol):
    """What the gRPC front-end reads and writes of the simulation (``clusterd_job.Host``)."""

    timings: Timings

    def record(self, kind: str, name: str, job_id: str, code: int | None = None, **detail: Any) -> None: ...
    def podgroup(self, job_id: str) -> dict[str, str]: ...
    def annotate(self, job_id: str, key: str, value: str) -> None: ...


class _HostPodGroup:
    """One job's PodGroup inside the gRPC simulation's host."""

    def __init__(self, host: PlatformHost, job_id: str) -> None:
        self._host = host
        self._job_id = job_id

    def annotations(self) -> Mapping[str, str]:
        return self._host.podgroup(self._job_id)

    def write(self, key: str, value: str) -> None:
        self._host.annotate(self._job_id, key, value)


class JournaledPlatform:
    """Platform mode inside the gRPC simulated ClusterD (owned by the job's ``JobController``):
    :class:`PlatformMode` plus its ``platform`` journal entries, named as the real log lines
    the differential reads (``wait-strategy``: "start wait plat strategy ready"; ``strategy``:
    "finish wait plat strategy"; ``merge``: "plat merge faults"; ``confirm``: "plat confirm
    strategy"; ``confirm-failed``: the 509; ``rank-table-ready`` / ``rank-table-failed``:
    "finish wait plat rankTable ready")."""

    def __init__(self, host: PlatformHost, job_id: str) -> None:
        self.host = host
        self.job_id = job_id
        self.mode = PlatformMode(_HostPodGroup(host, job_id), host.timings.platform_poll,
                                 host.timings.platform_wait)

    @property
    def strategy(self) -> str:
        """The platform's last strategy read ("" after a reset)."""
        return self.mode.strategy

    def reset(self) -> None:
        self.mode.reset()

    def job_strategies(self, configured: tuple[str, ...]) -> tuple[str, ...]:
        return self.mode.job_strategies(configured)

    async def wait_strategy(self) -> str | None:
        """The strategy, or None after the wait (508, journaled)."""
        self.host.record("platform", "wait-strategy", self.job_id)
        value = await self.mode.wait_strategy()
        self.host.record("platform", "strategy", self.job_id,
                         None if value is not None else rules.STRATEGY_WAIT_TIMEOUT, strategy=value or "")
        return value

    async def confirm(self, faults: list[FaultPair]) -> list[FaultPair] | None:
        """The merged faults, or None (509, journaled as ``confirm-failed``)."""
        written = rules.dedupe_faults(faults)
        out = await self.mode.confirm(written, rules.faults_string(written))
        if out.failure == NOT_CLEAR:
            return self._failed(out.failure, confirm=out.blocking_confirm)
        if out.failure == NO_RESULT:
            return self._failed(out.failure)
        self.host.record("platform", "confirm", self.job_id,
                         None if out.strategy else rules.CONFIRM_OR_RESULT_FAILED, strategy=self.mode.strategy)
        if out.failure is not None:
            return self._failed(out.failure)
        self.host.record("platform", "merge", self.job_id, faults=rules.faults_string(out.merged))
        return out.merged

    async def rank_table_ready(self) -> bool:
        """True once ``RankTableReady`` is "true"; journaled either way."""
        state = await self.mode.rank_table()
        self.host.record("platform", "rank-table-ready" if state == "ready" else "rank-table-failed", self.job_id,
                         reason=state)
        return state == "ready"

    def reread_strategy(self) -> str | None:
        """The platform's strategy at the confirm step again (after a failed rank table)."""
        return self.mode.reread_strategy()

    def _failed(self, reason: str, **detail: Any) -> None:
        self.host.record("platform", "confirm-failed", self.job_id, rules.CONFIRM_OR_RESULT_FAILED,
                         reason=reason, **detail)
        return None
