"""ClusterD's platform mode, simulated on a :class:`PodGroupStore`, to drive the agent.

It follows the real server (docs/clusterd.md, "Platform mode") as far as the PodGroup
is concerned, with its sharp edges kept:

* platform mode is the *presence* of ``ProcessRecoverStrategy`` at the first Init;
* at a fault it polls the strategy until it is retry, recover or dump (after trimming
  whitespace and commas), else 508 after the wait and FaultRetry;
* it writes ``ProcessConfirmFault`` only if the key is empty or absent, else 509 at
  once ("plat not clear pre confirm fault"); the write is an unconditional patch;
* it waits for the ``ProcessResultFault`` *key* (an empty value is fine), else 509;
* it merges its in-memory confirm, the result and the confirm as re-read, with ClusterD's
  own string rules (whole-string trim, two-part elements, first rank text wins unless its
  type is 0/2, one non-integer rank empties the list);
* it re-reads the strategy in confirm mode (``exit`` allowed), else 509;
* it chooses with the platform's value (plus exit) among the job's strategies; a
  recover waits for ``RankTableReady``: "true" goes, any other non-empty value fails at
  once, absent or empty waits and then fails; then the next choice;
* it writes ``ProcessRecoverStatus`` with a merge patch (``updateFixResult``:
  ``RetryPatchPodGroupAnnotations``, in every release from v7.0.RC1 to master), so a
  platform's concurrent edit is never a conflict for it;
* a retry that fails with 405 goes back to the confirm step (which needs the confirm
  cleared again); any other failed retry moves on without retry; a failed recover
  moves on to dump/exit; ``exit`` writes no status;
* dump, exit, 508 and 509 end in FaultRetry: the ``process-recover-enable`` label goes
  to ``pause`` and back to ``on``;
* it never clears ProcessConfirmFault, ProcessResultFault or RankTableReady.

Every rule above that reads or writes an annotation (the strategy reading, the confirm
refusal, the merge, the rank-table reading, the platform's veto over the job's
strategies) lives in :mod:`bridge.sim.clusterd_rules`, the module of ClusterD rules both
simulations share and that stays independent of the product's codec on purpose: the
gRPC simulated ClusterD plays the same platform mode with them (bridge/sim/clusterd_platform.py).

Not simulated here: the gRPC side (stopTrain, reports: outcomes are scripted; the gRPC
simulation has it), same-node rank expansion, the ConfigMap, pod rescheduling,
recover-in-place, downgrade. Times are scaled down (:class:`SimTimings`); the real polls
and waits are ``clusterd_timings.REAL.platform_poll`` (3 s) and ``platform_wait`` (300 s).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from bridge.sim.clusterd_rules import CANONICAL_FAULTS, CONFIRM_OR_RESULT_FAILED, PLATFORM_CHOICES, STRATEGY_WAIT_TIMEOUT, confirm_not_clear, merge_fault_strings, platform_job_strategies, platform_mode, platform_strategy, rank_table_state
from bridge.platform.annotations import CONFIRM, ENABLE_LABEL, PAUSED, RESULT, STATUS
from bridge.sim.kube.apiserver import PodGroupStore

log = logging.getLogger("tft_bridge.platform.sim.clusterd")

__all__ = ["CONFIRM_OR_RESULT_FAILED", "STRATEGY_WAIT_TIMEOUT", "CycleReport", "Outcomes", "SimPlatformClusterD",
           "SimTimings"]


@dataclass(frozen=True)
class SimTimings:
    poll: float = 0.02  # real: 3 s
    wait: float = 2.0  # real: 300 s
    reconfirm_delay: float = 0.05  # after a 405 retry failure, before the next confirm (real: ~1 s)
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


class SimPlatformClusterD:
    """One job's ClusterD controller in platform mode (blocking calls: run it in a thread)."""

    def __init__(self, store: PodGroupStore, namespace: str, name: str,
                 configured: Sequence[str] = ("retry", "recover", "dump", "exit"),
                 timings: SimTimings = SimTimings(), seed: int | None = None) -> None:
        self.store = store
        self.namespace = namespace
        self.name = name
        self.configured = tuple(configured)
        self.timings = timings
        self._random = random.Random(seed)
        self.platform_mode: bool | None = None

    # ----------------------------------------------------------------- public

    def init(self) -> bool:
        """Init: platform mode is frozen at the first call."""
        if self.platform_mode is None:
            self.platform_mode = platform_mode(self._annotations())
        return self.platform_mode

    def fault(self, faults: Mapping[int, int] | str, outcomes: Outcomes = Outcomes()) -> CycleReport:
        """One fault cycle. ``faults``: a map (written as ClusterD would, random order) or
        the exact confirm text to write (ClusterD writes whatever rank ids it was given)."""
        if not self.init():
            raise RuntimeError("not in platform mode: ProcessRecoverStrategy was absent at Init")
        report = CycleReport()
        text = faults if isinstance(faults, str) else self._faults_to_string(faults)
        if self._wait_strategy() is None:
            report.code = STRATEGY_WAIT_TIMEOUT
            self._fault_retry(report)
            return report
        after_failed_retry = False
        while True:
            plat = self._confirm_exchange(text, report)
            if plat is None:
                report.code = CONFIRM_OR_RESULT_FAILED
                self._fault_retry(report)
                return report
            merged = report.merged[-1]
            normal = any(t == 1 for t in merged.values())
            choices = self._choices(plat, normal, after_failed_retry)
            again = self._run_strategies(choices, outcomes, report)
            if not again:
                return report
            after_failed_retry = True
            time.sleep(self.timings.reconfirm_delay)

    # ----------------------------------------------------------------- steps

    def _wait_strategy(self) -> str | None:
        deadline = time.monotonic() + self.timings.wait
        while True:
            value = platform_strategy(self._annotations(), confirm=False)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.timings.poll)

    def _confirm_exchange(self, text: str, report: CycleReport) -> str | None:
        """Write the confirm, wait for the result, merge, re-read the strategy."""
        annotations = self._annotations()
        if confirm_not_clear(annotations):
            report.violations.append(f"plat not clear pre confirm fault: {annotations[CONFIRM]!r}")
            return None
        self.store.patch_annotations(self.namespace, self.name, {CONFIRM: text})
        report.confirms.append(text)
        deadline = time.monotonic() + self.timings.wait
        while True:
            annotations = self._annotations()
            if RESULT in annotations:
                break
            if time.monotonic() >= deadline:
                report.violations.append("ProcessResultFault never appeared")
                return None
            time.sleep(self.timings.poll)
        result = annotations[RESULT]
        report.results.append(result)
        if result and not CANONICAL_FAULTS.fullmatch(result):
            report.violations.append(f"non-canonical ProcessResultFault {result!r}")
        merged, poisoned = merge_fault_strings(text, result, annotations.get(CONFIRM, ""))
        report.merged.append(merged)
        report.poisoned.append(poisoned)
        plat = platform_strategy(annotations, confirm=True)
        report.platform_strategies.append(plat or "")
        if plat is None:
            report.violations.append("confirm-step strategy is not retry/recover/dump/exit")
            return None
        return plat

    def _choices(self, plat: str, normal: bool, after_failed_retry: bool) -> list[str]:
        allowed = platform_job_strategies(self.configured, plat)
        order: list[str] = []
        if not after_failed_retry and "retry" in allowed and not normal:
            order.append("retry")
        for strategy in PLATFORM_CHOICES[1:]:
            if strategy in allowed:
                order.append(strategy)
        order.append("exit")
        return order

    def _run_strategies(self, choices: list[str], outcomes: Outcomes, report: CycleReport) -> bool:
        """Try ``choices`` in order; True when a 405 retry failure sends us back to confirm."""
        for strategy in choices:
            if strategy == "recover" and not self._rank_table_ready(report):
                continue
            report.strategies.append(strategy)
            if strategy == "exit":
                self._fault_retry(report)
                return False
            outcome = getattr(outcomes, strategy)
            ok = outcome == "success"
            self._write_status(f"{strategy}-{'success' if ok else 'failed'}", report)
            if strategy == "dump":
                report.strategies.append("exit")  # dump_exit follows either way
                self._fault_retry(report)
                return False
            if ok:
                return False
            if strategy == "retry":
                if outcome == "failed-405":
                    return True
                # KillPodForUnrecoverableRetry: the next choice excludes recover
                rest = [s for s in choices[choices.index("retry") + 1:] if s != "recover"]
                return self._run_strategies(rest or ["exit"], outcomes, report)
            if strategy == "recover":
                # after a failed recover only dump or exit remain
                rest = [s for s in choices[choices.index("recover") + 1:] if s in ("dump", "exit")]
                return self._run_strategies(rest or ["exit"], outcomes, report)
        return False

    def _rank_table_ready(self, report: CycleReport) -> bool:
        deadline = time.monotonic() + self.timings.wait
        while True:
            state = rank_table_state(self._annotations())
            if state == "ready":
                report.rank_table.append("ready")
                return True
            if state == "failed":
                report.rank_table.append("failed-now")
                return False
            if time.monotonic() >= deadline:
                report.rank_table.append("timeout")
                return False
            time.sleep(self.timings.poll)

    def _write_status(self, value: str, report: CycleReport) -> None:
        """A merge patch of the one key, as ``updateFixResult`` does: nothing to conflict."""
        self.store.patch_annotations(self.namespace, self.name, {STATUS: value})
        report.statuses.append(value)

    def _fault_retry(self, report: CycleReport) -> None:
        report.fault_retry = True
        self.store.patch_labels(self.namespace, self.name, {ENABLE_LABEL: PAUSED})
        time.sleep(self.timings.pause)
        self.store.patch_labels(self.namespace, self.name, {ENABLE_LABEL: "on"})

    # ----------------------------------------------------------------- helpers

    def _annotations(self) -> dict[str, str]:
        return self.store.annotations(self.namespace, self.name)

    def _faults_to_string(self, faults: Mapping[int, int]) -> str:
        items = list(faults.items())
        self._random.shuffle(items)  # Go map order
        return ",".join(f"{rank}:{fault_type}" for rank, fault_type in items).strip(",")

