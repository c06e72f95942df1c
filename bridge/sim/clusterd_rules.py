"""ClusterD's pure rules, shared by both simulations: no I/O, no timing.

One home for every rule of the real server that the simulated ClusterD
(:mod:`bridge.sim.clusterd`) and the simulated platform-mode ClusterD
(:mod:`bridge.sim.kube.podgroup_clusterd`) apply: the fault merge rule
(``RemoveSliceDuplicateFaults``: a type-"1" entry is sticky, between "0" and "2" the later
wins), Go's whitespace set (``strings.TrimSpace``), Go's ``strconv.Atoi`` with its int64
range check, the "rank:type" string parser (``String2Faults``), same-pod expansion and
the strategy choice.

Independent of the product on purpose: the bridge's own codec (:mod:`bridge.faults`)
implements the same rules separately, and the simulations must not import it. If both
sides shared one implementation, a bug in it would be invisible to every test, because
the simulated peer would make exactly the same mistake as the client it judges.

Fault caches keep ClusterD's own representation: rank ids and fault types stay the
strings the client sent (ClusterD validates neither), normal (type "1") and retry (any
other type) faults live in two separate lists. A client that sends a rank twice or a
rank as both "0" and "1" sees exactly what the real server would send back.

Reference: docs/clusterd.md ("Fault lists and their rules", "Strategy choice").
"""

from __future__ import annotations

import random
import re
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence

#: (rankId, faultType) exactly as they travel in ``FaultRank``.
FaultPair = tuple[str, str]

UCE = "0"
NORMAL = "1"
HCCL = "2"
#: The fault types a client may send; ClusterD's fault centre answers any other type
#: (e.g. "9") with preExitProcess instead of a retry cycle.
KNOWN_TYPES = (UCE, NORMAL, HCCL)
RETRY_TYPES = (UCE, HCCL)

#: Go's ``unicode.IsSpace`` set, which ``strings.TrimSpace`` strips.
GO_SPACE = (
    "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: What every writer of a "rank:type" string must emit (no spaces, types 0/1/2).
CANONICAL_FAULTS = re.compile(r"\d+:[012](,\d+:[012])*")
_DIGITS = frozenset("0123456789")

RETRY = "retry"
RECOVER_IN_PLACE = "recover-in-place"
RECOVER = "recover"
ELASTIC = "elastic-training"
DUMP = "dump"
EXIT = "exit"
DOWNGRADE = "downgrade"
CONTINUE = "continue"

#: The job-side strategy names ClusterD accepts from the recover-strategy annotation,
#: in its priority order (retry first, exit last).
STRATEGY_PRIORITY: tuple[str, ...] = (RETRY, RECOVER_IN_PLACE, RECOVER, ELASTIC, DUMP, EXIT)

STOP_TRAIN_ACTIONS = ("stop_train",)
PAUSE_TRAIN_ACTIONS = ("pause_train",)
GLOBAL_FAULT_RETRY_ACTIONS = ("on_global_rank",)
GLOBAL_FAULT_ACTIONS = ("on_global_rank", "fault_nodes_exit")
CHANGE_STRATEGY_ACTIONS = ("change_strategy",)
SAVE_AND_EXIT_ACTIONS = ("save_and_exit",)
FAULT_NODES_EXIT_ACTIONS = ("fault_nodes_exit",)
#: an in-place recover: the controller gets ``recover``, the nodes restart the fault ranks
IN_PLACE_CHANGE_ACTIONS = ("change_strategy", "fault_nodes_restart")
#: a recover-in-place cycle that chose something else: the faulty pods' nodes exit
IN_PLACE_EXIT_ACTIONS = ("change_strategy", "fault_nodes_exit")
PRE_EXIT_ACTIONS = ("pre exit process",)

DOWNGRADE_EXTRA_PARAMS = '{"scale-in-strategy": "DP"}'
DUMP_EXIT = "dump_exit"
#: globalFault timeout when an HCCL (type "2") fault is involved: 3 + 30 s.
HCCL_GLOBAL_FAULT_TIMEOUT = 33


def new_uuid() -> str:
    """``<UnixNano in upper-case hex>-<32 hex chars>``, ClusterD's NewEventId(16)."""
    return f"{time.time_ns():X}-{secrets.token_hex(16)}"


def job_strategies(configured: Iterable[str]) -> tuple[str, ...]:
    """What Init makes of the PodGroup's recover-strategy annotation: unknown names
    dropped, ``exit`` always added, sorted by ClusterD's priority."""
    wanted = set(configured) | {EXIT}
    return tuple(name for name in STRATEGY_PRIORITY if name in wanted)


# --------------------------------------------------------------------------- faults


def dedupe_faults(faults: Iterable[FaultPair]) -> list[FaultPair]:
    """``RemoveSliceDuplicateFaults``: the first occurrence of a rank keeps its place; a
    later one replaces its type only while the stored type is "0" or "2"."""
    merged: dict[str, str] = {}
    for rank, fault_type in faults:
        if rank not in merged or merged[rank] in RETRY_TYPES:
            merged[rank] = fault_type
    return list(merged.items())


def go_atoi(text: str) -> int | None:
    """Go's ``strconv.Atoi`` on a 64-bit build: an optional sign and ASCII digits whose
    value fits an int64, else None (Go returns an error; ClusterD then drops the list)."""
    digits = text[1:] if text[:1] in ("+", "-") else text
    if not digits or not digits.isascii() or not digits.isdigit():
        return None
    value = int(text)
    return value if INT64_MIN <= value <= INT64_MAX else None


def trim_space(text: str) -> str:
    """Go's ``strings.TrimSpace``: strips :data:`GO_SPACE` from both ends."""
    return text.strip(GO_SPACE)


def parse_fault_string(text: str) -> list[FaultPair]:
    """``String2Faults``: trim whitespace from the whole string, then leading and
    trailing commas; split on "," then ":"; an element without exactly two parts is
    dropped. Elements are neither trimmed nor validated."""
    body = trim_space(text).strip(",")
    if not body:
        return []
    out: list[FaultPair] = []
    for element in body.split(","):
        parts = element.split(":")
        if len(parts) == 2:
            out.append((parts[0], parts[1]))
    return out


def faults_string(faults: Iterable[FaultPair]) -> str:
    """``Faults2String`` then ``Trim(",")``: "rank:type" joined by commas, as ClusterD
    writes ``ProcessConfirmFault`` (the pairs as they are, unvalidated)."""
    return ",".join(f"{rank}:{fault_type}" for rank, fault_type in faults).strip(",")


def merge_platform_faults(written: Iterable[FaultPair], result: str, confirm: str) -> list[FaultPair]:
    """``writeConfirmFaultAndWaitPlatResultFault``: ClusterD's own (deduplicated) list,
    then ``WaitProcessResultFault``'s ``dedupe(result + confirm as re-read)``, the whole
    deduplicated once more: ClusterD's entries keep their place and a type-"1" is sticky."""
    platform = dedupe_faults(parse_fault_string(result) + parse_fault_string(confirm))
    return dedupe_faults(dedupe_faults(written) + platform)


def rank_map(merged: Iterable[FaultPair]) -> tuple[dict[int, int], bool]:
    """The all-or-nothing rank conversion of a merged list: one rank id Atoi rejects
    empties it (returns ``({}, True)``). Types other than "1" count as retryable (kept as
    0 unless "2"); a type-1 entry is sticky."""
    faults: dict[int, int] = {}
    for rank_text, fault_type in merged:
        rank = go_atoi(rank_text)
        if rank is None:
            return {}, True
        value = 1 if fault_type == NORMAL else (2 if fault_type == HCCL else 0)
        if faults.get(rank) != 1:
            faults[rank] = value
    return faults, False


def is_canonical_pair(rank: str, fault_type: str) -> bool:
    """A rank of ASCII digits and a type "0", "1" or "2": what every client must send."""
    return bool(rank) and _DIGITS.issuperset(rank) and fault_type in KNOWN_TYPES


def pair_problem(rank: str, fault_type: str) -> str | None:
    """Why a reported (rank, type) is not what a client must send, or None. The text
    names what the real server does with it (tests read it; keep it accurate)."""
    problems = []
    if not (rank and _DIGITS.issuperset(rank)):
        problems.append("a non-integer rank id empties the cycle's rank list")
    if fault_type not in KNOWN_TYPES:
        problems.append("an unknown fault type makes the fault centre send preExitProcess "
                        "for that rank about 11 s later and starts no cycle")
    return "; ".join(problems) or None


class FaultCache:
    """The controller's ``cacheNormalFault`` and ``cacheUceFault`` lists."""

    def __init__(self) -> None:
        self.normal: list[FaultPair] = []
        self.retry: list[FaultPair] = []

    def __bool__(self) -> bool:
        return bool(self.normal or self.retry)

    def save(self, faults: Iterable[FaultPair]) -> None:
        """``saveCacheFault``: type "1" goes to the normal list, anything else (0, 2 or
        garbage) to the retry list; each list is then de-duplicated on its own, so one
        rank can sit in both."""
        for rank, fault_type in dedupe_faults(faults):
            (self.normal if fault_type == NORMAL else self.retry).append((rank, fault_type))
        self.normal = dedupe_faults(self.normal)
        self.retry = dedupe_faults(self.retry)

    def stop_train_faults(self) -> list[FaultPair]:
        """stopTrain carries the retry list followed by the normal list, as reported."""
        return self.retry + self.normal

    def all_types(self) -> set[str]:
        return {t for _, t in self.retry + self.normal}

    def take_retry_to_normal(self, *, last_result_was_retry: bool, retry_supported: bool) -> None:
        """``takeUceFault2NormalFault``: retry faults become normal after a failed retry,
        whenever a normal fault exists, or when the job does not configure retry."""
        if last_result_was_retry or self.normal or not retry_supported:
            self.retry_to_normal()

    def retry_to_normal(self) -> None:
        """Append the retry list to the normal list (types kept until the expansion)."""
        self.normal = self.normal + self.retry
        self.retry = []

    def keep_normal_in_place(self) -> list[str]:
        """``recoverInPlaceFaultAssociateSameNodeRank``: a recover-in-place cycle does not
        widen its faults to whole pods; they all become type "1" as they are."""
        self.normal = [(rank, NORMAL) for rank, _ in dedupe_faults(self.normal + self.retry)]
        self.retry = []
        return [rank for rank, _ in self.normal]

    def expand_normal(self, devices_per_pod: int) -> tuple[list[str], bool]:
        """``normalFaultAssociateSameNodeRank``: every normal fault widens to all ranks of
        its pod, all type "1". Returns the expanded rank ids and whether a non-numeric
        rank poisoned the conversion (then ClusterD's list is empty)."""
        ranks, poisoned = same_node_ranks([rank for rank, _ in self.normal], devices_per_pod)
        self.normal = [(rank, NORMAL) for rank in ranks]
        self.retry = []
        return ranks, poisoned


def same_node_ranks(rank_ids: Sequence[str], devices_per_pod: int) -> tuple[list[str], bool]:
    """All ranks of the pods holding ``rank_ids`` (pod = rank // devices_per_pod), in
    first-seen order; ``([], True)`` when any rank id is not an integer."""
    numbers = [go_atoi(rank) for rank in rank_ids]
    if any(n is None for n in numbers):
        return [], True
    out: dict[str, None] = {}
    for number in numbers:
        assert number is not None
        pod = number // devices_per_pod
        for offset in range(devices_per_pod):
            out[str(pod * devices_per_pod + offset)] = None
    return list(out), False


def pod_indices(rank_ids: Iterable[str], devices_per_pod: int, rng: random.Random) -> list[str]:
    """The pods of ``rank_ids`` as strings, in random order: ClusterD builds them from a Go
    map, so the real order is random too and a client must not depend on it."""
    pods = {str(n // devices_per_pod) for n in (go_atoi(r) for r in rank_ids) if n is not None}
    ordered = sorted(pods, key=int)
    rng.shuffle(ordered)
    return ordered


# --------------------------------------------------------------------------- strategy


def _supported(name: str, job: Sequence[str], agent: Sequence[str]) -> bool:
    return name in job and name in agent


def can_downgrade(job: Sequence[str], agent: Sequence[str], rank0_pod_faulty: bool) -> bool:
    """DP scale-in: elastic-training configured, the agent reported ``downgrade``, and the
    pod holding rank 0 is healthy (the simulation never reschedules pods)."""
    return ELASTIC in job and DOWNGRADE in agent and not rank0_pod_faulty


def choose_first(job: Sequence[str], agent: Sequence[str], has_normal_faults: bool,
                 rank0_pod_faulty: bool, in_place: bool = False) -> str:
    """``firstChooseStrategy``: retry is decided on the job's configuration alone (the
    caller handles an agent that did not offer it); the rest needs both sides."""
    if RETRY in job and not has_normal_faults:
        return RETRY
    return choose_after_retry_failure(job, agent, rank0_pod_faulty, in_place)


def choose_after_retry_failure(job: Sequence[str], agent: Sequence[str],
                               rank0_pod_faulty: bool, in_place: bool = False) -> str:
    """``chooseForRetryFail``: recover-in-place first when the cycle can restart its
    faulty processes in place (configured, and the agent offered ``recover``)."""
    if in_place and RECOVER_IN_PLACE in job and RECOVER in agent:
        return RECOVER_IN_PLACE
    if _supported(RECOVER, job, agent):
        return RECOVER
    if can_downgrade(job, agent, rank0_pod_faulty):
        return DOWNGRADE
    return choose_after_recover_failure(job, agent)


def choose_after_recover_failure(job: Sequence[str], agent: Sequence[str]) -> str:
    return DUMP if _supported(DUMP, job, agent) else EXIT


# --------------------------------------------------------------------------- platform mode
#: ClusterD's PodGroup annotation keys of platform mode (its constant package): the
#: platform's strategy, ClusterD's confirmed faults, the platform's result faults, the
#: platform's rank-table readiness. ProcessRecoverStatus is ClusterD's outcome.
PLATFORM_STRATEGY = "ProcessRecoverStrategy"
CONFIRM_FAULT = "ProcessConfirmFault"
RESULT_FAULT = "ProcessResultFault"
RANK_TABLE_READY = "RankTableReady"
RECOVER_STATUS = "ProcessRecoverStatus"
#: The PodGroup label FaultRetry sets to ``pause`` and back to ``on``.
RECOVER_ENABLE_LABEL = "process-recover-enable"
RECOVER_PAUSED = "pause"
#: The strategies a platform may set before the confirm step (``exit`` only at it).
PLATFORM_CHOICES = (RETRY, RECOVER, DUMP)
#: ``WaitPlatStrategyTimeout``: no usable ProcessRecoverStrategy within the wait.
STRATEGY_WAIT_TIMEOUT = 508
#: ``WriteConfirmFaultOrWaitPlatResultFault``: the confirm was not clear, no result
#: came, or the strategy re-read at the confirm step is not usable.
CONFIRM_OR_RESULT_FAILED = 509


def platform_mode(annotations: Mapping[str, str]) -> bool:
    """Init's ``PlatFormMode``: the *presence* of ProcessRecoverStrategy (empty counts)."""
    return PLATFORM_STRATEGY in annotations


def platform_strategy(annotations: Mapping[str, str], *, confirm: bool) -> str | None:
    """``platFormStrategy``: the key must exist; its value after ``TrimSpace`` then
    ``Trim(",")`` must be retry, recover or dump (or ``exit`` at the confirm step)."""
    if PLATFORM_STRATEGY not in annotations:
        return None
    value = trim_space(annotations[PLATFORM_STRATEGY]).strip(",")
    return value if value in PLATFORM_CHOICES or (confirm and value == EXIT) else None


def confirm_not_clear(annotations: Mapping[str, str]) -> bool:
    """``UpdateProcessConfirmFault`` refuses ("plat not clear pre confirm fault") while the
    previous confirm is still there: any non-empty value."""
    return len(annotations.get(CONFIRM_FAULT, "")) > 0


def rank_table_state(annotations: Mapping[str, str]) -> str:
    """``WaitRankTableReady``'s reading: ``ready`` ("true"), ``failed`` (any other
    non-empty value: fails at once), ``waiting`` (absent or empty: poll on)."""
    value = annotations.get(RANK_TABLE_READY, "")
    if value == "true":
        return "ready"
    return "failed" if value else "waiting"


def platform_job_strategies(job: Sequence[str], plat: str) -> tuple[str, ...]:
    """The job's strategies as ``support*Strategy`` sees them in platform mode: retry,
    recover and dump only if the platform chose that one (recover-in-place rides on
    ``recover``); elastic-training (downgrade) and exit are not the platform's to veto."""
    gated = {RETRY: RETRY, RECOVER: RECOVER, DUMP: DUMP, RECOVER_IN_PLACE: RECOVER}
    return tuple(name for name in job if name not in gated or gated[name] == plat)
