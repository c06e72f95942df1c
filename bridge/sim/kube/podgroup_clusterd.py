"""ClusterD's platform mode on the stand-in API server's PodGroup store, to drive the platform agent.

A front-end of :class:`bridge.sim.clusterd_platform.PlatformMode` (the waits and the confirm
exchange, docs/clusterd.md section 10) for one PodGroup, with what only a PodGroup-side
test needs: scripted strategy outcomes instead of the gRPC side, the choice among the
job's strategies under the platform's veto, ``ProcessRecoverStatus`` written with a merge
patch (nothing to conflict), FaultRetry's ``pause`` label after dump, exit, 508 and 509,
and a :class:`CycleReport` of what the platform wrote. A 405 retry failure goes back to
the confirm step, any other failed retry moves on without recover, a failed recover
moves on to dump or exit. Times are scaled down (:class:`SimTimings`).

Not simulated here: the gRPC side (bridge/sim/clusterd.py has it), same-node rank
expansion, the ConfigMap, pod rescheduling, recover-in-place, downgrade.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bridge.sim import clusterd_rules as rules
from bridge.sim.clusterd_platform import NOT_CLEAR, NO_RESULT, PlatformMode
from bridge.sim.clusterd_rules import CONFIRM_OR_RESULT_FAILED, STRATEGY_WAIT_TIMEOUT
from bridge.sim.kube.apiserver import PodGroupStore

__all__ = ["CONFIRM_OR_RESULT_FAILED", "STRATEGY_WAIT_TIMEOUT", "CycleReport", "Outcomes", "SimPlatformClusterD",
           "SimTimings"]


@dataclass(frozen=True)
class SimTimings:
    """The platform-mode waits, scaled down (the real ones: ``clusterd_timings.REAL``)."""
    poll: float = 0.02  # real: 3 s
    wait: float = 2.0  # real: 300 s
    # After a 405 retry failure, before the next confirm: real, not scaled. It is the
    # platform's deadline to clear the previous confirm (ClusterD's write fails with
    # "plat not clear pre confirm fault" otherwise), and the platform's speed is not scaled.
    reconfirm_delay: float = 1.0
    pause: float = 0.05  # how long FaultRetry keeps the label at "pause"


@dataclass(frozen=True)
class Outcomes:
    """Scripted results: ``retry`` success, failed (moves on) or failed-405 (re-confirm);
    ``recover`` and ``dump`` success or failed."""

    retry: str = "success"
    recover: str = "success"
    dump: str = "success"


@dataclass
class CycleReport:
    """What one fault cycle did and saw: ``code`` 0, 508 or 509; ``violations`` what the platform got wrong."""
    code: int = 0
    strategies: list[str] = field(default_factory=list)  # what changeStrategy would have carried
    statuses: list[str] = field(default_factory=list)
    confirms: list[str] = field(default_factory=list)  # the confirm texts written
    results: list[str] = field(default_factory=list)  # the result texts read
    platform_strategies: list[str] = field(default_factory=list)  # the strategy read at each confirm
    merged: list[dict[int, int]] = field(default_factory=list)
    poisoned: list[bool] = field(default_factory=list)
    rank_table: list[str] = field(default_factory=list)  # ready, failed-now, timeout
    fault_retry: bool = False
    violations: list[str] = field(default_factory=list)


class _StorePodGroup:
    """One PodGroup of the store: unconditional annotation patches, as ClusterD writes."""

    def __init__(self, store: PodGroupStore, namespace: str, name: str) -> None:
        self._store = store
        self._namespace = namespace
        self._name = name

    def annotations(self) -> Mapping[str, str]:
        return self._store.annotations(self._namespace, self._name)

    def write(self, key: str, value: str) -> None:
        self._store.patch_annotations(self._namespace, self._name, {key: value})


class SimPlatformClusterD:
    """One job's ClusterD controller in platform mode. :meth:`fault` blocks for a whole
    cycle on an event loop of its own: call it from a worker thread, never from a loop."""

    def __init__(self, store: PodGroupStore, namespace: str, name: str,
                 configured: Sequence[str] = ("retry", "recover", "dump", "exit"),
                 timings: SimTimings = SimTimings(), seed: int | None = None) -> None:
        self.store = store
        self.namespace = namespace
        self.name = name
        self.configured = tuple(configured)
        self.timings = timings
        self._random = random.Random(seed)
        self._mode = PlatformMode(_StorePodGroup(store, namespace, name), timings.poll, timings.wait)
        self.platform_mode: bool | None = None

    # ----------------------------------------------------------------- public

    def init(self) -> bool:
        """Init: platform mode is frozen at the first call."""
        if self.platform_mode is None:
            self.platform_mode = rules.platform_mode(self.store.annotations(self.namespace, self.name))
        return self.platform_mode

    def fault(self, faults: Mapping[int, int] | str, outcomes: Outcomes = Outcomes()) -> CycleReport:
        """One fault cycle. ``faults``: a map (written as ClusterD would, random order) or
        the exact confirm text to write (ClusterD writes whatever rank ids it was given)."""
        if not self.init():
            raise RuntimeError("not in platform mode: ProcessRecoverStrategy was absent at Init")
        text = faults if isinstance(faults, str) else self._faults_to_string(faults)
        return asyncio.run(self._cycle(text, outcomes))

    # ----------------------------------------------------------------- steps

    async def _cycle(self, text: str, outcomes: Outcomes) -> CycleReport:
        report = CycleReport()
        if await self._mode.wait_strategy() is None:
            report.code = STRATEGY_WAIT_TIMEOUT
            await self._fault_retry(report)
            return report
        after_failed_retry = False
        while True:
            plat = await self._confirm_exchange(text, report)
            if plat is None:
                report.code = CONFIRM_OR_RESULT_FAILED
                await self._fault_retry(report)
                return report
            merged = report.merged[-1]
            normal = any(t == 1 for t in merged.values())
            choices = self._choices(plat, normal, after_failed_retry)
            if not await self._run_strategies(choices, outcomes, report):
                return report
            after_failed_retry = True
            await asyncio.sleep(self.timings.reconfirm_delay)

    async def _confirm_exchange(self, text: str, report: CycleReport) -> str | None:
        """The model's confirm exchange, reported; the platform's strategy or None (509)."""
        out = await self._mode.confirm(rules.parse_fault_string(text), text)
        if out.failure == NOT_CLEAR:
            report.violations.append(f"{NOT_CLEAR}: {out.blocking_confirm!r}")
            return None
        report.confirms.append(text)
        if out.failure == NO_RESULT or out.result is None:
            report.violations.append("ProcessResultFault never appeared")
            return None
        report.results.append(out.result)
        if out.result and not rules.CANONICAL_FAULTS.fullmatch(out.result):
            report.violations.append(f"non-canonical ProcessResultFault {out.result!r}")
        merged, poisoned = rules.rank_map(out.merged)
        report.merged.append(merged)
        report.poisoned.append(poisoned)
        report.platform_strategies.append(out.strategy or "")
        if out.strategy is None:
            report.violations.append("confirm-step strategy is not retry/recover/dump/exit")
        return out.strategy

    def _choices(self, plat: str, normal: bool, after_failed_retry: bool) -> list[str]:
        allowed = rules.platform_job_strategies(self.configured, plat)
        order: list[str] = []
        if not after_failed_retry and "retry" in allowed and not normal:
            order.append("retry")
        for strategy in rules.PLATFORM_CHOICES[1:]:
            if strategy in allowed:
                order.append(strategy)
        order.append("exit")
        return order

    async def _run_strategies(self, choices: list[str], outcomes: Outcomes, report: CycleReport) -> bool:
        """Try ``choices`` in order; True when a 405 retry failure sends us back to confirm."""
        for strategy in choices:
            if strategy == "recover" and not await self._rank_table_ready(report):
                continue
            report.strategies.append(strategy)
            if strategy == "exit":
                await self._fault_retry(report)
                return False
            outcome = getattr(outcomes, strategy)
            ok = outcome == "success"
            self._write_status(f"{strategy}-{'success' if ok else 'failed'}", report)
            if strategy == "dump":
                report.strategies.append("exit")  # dump_exit follows either way
                await self._fault_retry(report)
                return False
            if ok:
                return False
            if strategy == "retry":
                if outcome == "failed-405":
                    return True
                # KillPodForUnrecoverableRetry: the next choice excludes recover
                rest = [s for s in choices[choices.index("retry") + 1:] if s != "recover"]
                return await self._run_strategies(rest or ["exit"], outcomes, report)
            if strategy == "recover":
                # after a failed recover only dump or exit remain
                rest = [s for s in choices[choices.index("recover") + 1:] if s in ("dump", "exit")]
                return await self._run_strategies(rest or ["exit"], outcomes, report)
        return False

    async def _rank_table_ready(self, report: CycleReport) -> bool:
        state = await self._mode.rank_table()
        report.rank_table.append("failed-now" if state == "failed" else state)
        return state == "ready"

    def _write_status(self, value: str, report: CycleReport) -> None:
        """A merge patch of the one key, as ``updateFixResult`` does: nothing to conflict."""
        self.store.patch_annotations(self.namespace, self.name, {rules.RECOVER_STATUS: value})
        report.statuses.append(value)

    async def _fault_retry(self, report: CycleReport) -> None:
        report.fault_retry = True
        self.store.patch_labels(self.namespace, self.name, {rules.RECOVER_ENABLE_LABEL: rules.RECOVER_PAUSED})
        await asyncio.sleep(self.timings.pause)
        self.store.patch_labels(self.namespace, self.name, {rules.RECOVER_ENABLE_LABEL: "on"})

    # ----------------------------------------------------------------- helpers

    def _faults_to_string(self, faults: Mapping[int, int]) -> str:
        items = list(faults.items())
        self._random.shuffle(items)  # Go map order
        return ",".join(f"{rank}:{fault_type}" for rank, fault_type in items).strip(",")
