"""ClusterD's platform mode for one job of the gRPC simulated ClusterD: its PodGroup side.

Platform mode is on when the job's PodGroup carried ``ProcessRecoverStrategy`` (any
value, empty too) at the first Init (``SimJob.annotations``); an AI platform then steers
every fault cycle through PodGroup annotations, which a test writes as the platform
(``SimClusterD.platform_annotate``, the harness's ``POST /pg/annotate``). What the
recover controller does with them (controller.go, fault_recover_platform_plugin.go of
component/clusterd, the same in v7.3.2), each wait polling every ``timings.platform_poll``
(3 s) for at most ``timings.platform_wait`` (300 s):

* at a fault, before anything is sent, it waits for the platform's strategy (retry,
  recover or dump); none in time is 508 and FaultRetry (:meth:`Platform.wait_strategy`);
* before the globalFault it writes its faults (deduplicated, not yet widened to whole
  pods) into ``ProcessConfirmFault``, refused at once (509) while the previous confirm is
  still there, waits for the key ``ProcessResultFault``, merges, re-reads the strategy
  (``exit`` now allowed); any failure is 509 and FaultRetry (:meth:`Platform.confirm`);
* the platform's strategy gates the job's retry/recover/dump (``support*Strategy``), and
  a recover waits for ``RankTableReady`` (:meth:`Platform.rank_table_ready`).

The rules themselves (how the strategy is read, the confirm refusal, the merge, the
rank-table reading, the veto) are :mod:`bridge.sim.clusterd_rules`'s, shared with the
PodGroup-store simulation :mod:`bridge.sim.kube.podgroup_clusterd`. This module owns only the
waits and what they journal: ``platform`` entries named as the real log lines the
differential reads (``wait-strategy``: "start wait plat strategy ready"; ``strategy``:
"finish wait plat strategy"; ``merge``: "plat merge faults"; ``confirm``: "plat confirm
strategy"; ``confirm-failed``: the 509; ``rank-table-ready`` / ``rank-table-failed``:
"finish wait plat rankTable ready").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from bridge.sim import clusterd_rules as rules
from bridge.sim.clusterd_rules import FaultPair
from bridge.sim.clusterd_timings import Timings

T = TypeVar("T")


class PlatformHost(Protocol):
    """What platform mode reads and writes of the simulation (``clusterd_job.Host``)."""

    timings: Timings

    def record(self, kind: str, name: str, job_id: str, code: int | None = None, **detail: Any) -> None: ...
    def podgroup(self, job_id: str) -> dict[str, str]: ...
    def annotate(self, job_id: str, key: str, value: str) -> None: ...


class Platform:
    """One job's platform-mode PodGroup exchange (owned by its ``JobController``)."""

    def __init__(self, host: PlatformHost, job_id: str) -> None:
        self.host = host
        self.job_id = job_id
        #: ``ctl.platStrategy``: the platform's last strategy read; "" after a reset.
        self.strategy = ""

    def job_strategies(self, configured: tuple[str, ...]) -> tuple[str, ...]:
        """The job's strategies as the choice sees them under the platform's strategy."""
        return rules.platform_job_strategies(configured, self.strategy)

    async def wait_strategy(self) -> str | None:
        """``WaitPlatFormStrategyReady``: the strategy, or None after the wait (508)."""
        self.host.record("platform", "wait-strategy", self.job_id)
        value = await self._poll(lambda a: rules.platform_strategy(a, confirm=False))
        self.host.record("platform", "strategy", self.job_id,
                         None if value is not None else rules.STRATEGY_WAIT_TIMEOUT, strategy=value or "")
        if value is not None:
            self.strategy = value
        return value

    async def confirm(self, faults: list[FaultPair]) -> list[FaultPair] | None:
        """``writeConfirmFaultAndWaitPlatResultFault``: the merged faults, or None (509)."""
        written = rules.dedupe_faults(faults)
        annotations = self.host.podgroup(self.job_id)
        if rules.confirm_not_clear(annotations):
            return self._failed("plat not clear pre confirm fault", confirm=annotations[rules.CONFIRM_FAULT])
        self.host.annotate(self.job_id, rules.CONFIRM_FAULT, rules.faults_string(written))
        found = await self._poll(lambda a: dict(a) if rules.RESULT_FAULT in a else None)
        if found is None:
            return self._failed("wait process result fault: ProcessResultFault never appeared")
        merged = rules.merge_platform_faults(written, found[rules.RESULT_FAULT], found.get(rules.CONFIRM_FAULT, ""))
        plat = rules.platform_strategy(self.host.podgroup(self.job_id), confirm=True)
        self.strategy = plat or ""
        self.host.record("platform", "confirm", self.job_id, None if plat else rules.CONFIRM_OR_RESULT_FAILED,
                         strategy=self.strategy)
        if plat is None:
            return self._failed("confirm plat strategy: not retry/recover/dump/exit")
        self.host.record("platform", "merge", self.job_id, faults=rules.faults_string(merged))
        return merged

    async def rank_table_ready(self) -> bool:
        """``WaitRankTableReady``: True once "true"; False at once for any other value,
        or after the wait while it stays absent or empty."""
        state = await self._poll(lambda a: None if (s := rules.rank_table_state(a)) == "waiting" else s)
        self.host.record("platform", "rank-table-ready" if state == "ready" else "rank-table-failed", self.job_id,
                         reason=state or "timeout")
        return state == "ready"

    def reread_strategy(self) -> str | None:
        """``platFormStrategy`` at the confirm step again (after a failed rank table)."""
        plat = rules.platform_strategy(self.host.podgroup(self.job_id), confirm=True)
        self.strategy = plat or ""
        return plat

    def _failed(self, reason: str, **detail: Any) -> None:
        self.host.record("platform", "confirm-failed", self.job_id, rules.CONFIRM_OR_RESULT_FAILED,
                         reason=reason, **detail)
        return None

    async def _poll(self, read: Callable[[Mapping[str, str]], T | None]) -> T | None:
        """Read, then every poll period until ``read`` gives a value; None once the wait
        is over (checked after each sleep, before the read, as the real loops do)."""
        timings = self.host.timings
        loop = asyncio.get_running_loop()
        start = loop.time()
        value = read(self.host.podgroup(self.job_id))
        while value is None:
            await asyncio.sleep(timings.platform_poll)
            if loop.time() - start > timings.platform_wait:
                return None
            value = read(self.host.podgroup(self.job_id))
        return value
