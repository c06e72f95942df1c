"""ClusterD's pure rules, as the simulated server applies them: no I/O, no timing.

Fault caches keep ClusterD's own representation on purpose: rank ids and fault types
stay the strings the client sent (ClusterD validates neither), normal (type "1") and
retry (any other type) faults live in two separate lists, and duplicates follow
``RemoveSliceDuplicateFaults``. A client that sends a rank twice or a rank as both "0"
and "1" sees exactly what the real server would send back.

Sources: shared/spec/clusterd-protocol.md sections 4-5 and
shared/spec/deep/clusterd-research.md sections 1.5-1.7.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Iterable, Sequence

#: (rankId, faultType) exactly as they travel in ``FaultRank``.
FaultPair = tuple[str, str]

NORMAL = "1"
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
        if rank not in merged or merged[rank] in ("0", "2"):
            merged[rank] = fault_type
    return list(merged.items())


def go_atoi(text: str) -> int | None:
    """``strconv.Atoi``: optional sign and ASCII digits, else None."""
    digits = text[1:] if text[:1] in ("+", "-") else text
    if not digits or not digits.isascii() or not digits.isdigit():
        return None
    return int(text)


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


def fault_annotation(faults: Iterable[FaultPair], rng: random.Random) -> str:
    """``rank:type`` entries joined by ``,``, each rank once, in random order."""
    entries = [f"{rank}:{fault_type}" for rank, fault_type in dedupe_faults(faults)]
    rng.shuffle(entries)
    return ",".join(entries)


# --------------------------------------------------------------------------- strategy


def _supported(name: str, job: Sequence[str], agent: Sequence[str]) -> bool:
    return name in job and name in agent


def can_downgrade(job: Sequence[str], agent: Sequence[str], rank0_pod_faulty: bool) -> bool:
    """DP scale-in: elastic-training configured, the agent reported ``downgrade``, and the
    pod holding rank 0 is healthy (the simulation never reschedules pods)."""
    return ELASTIC in job and DOWNGRADE in agent and not rank0_pod_faulty


def choose_first(job: Sequence[str], agent: Sequence[str], has_normal_faults: bool,
                 rank0_pod_faulty: bool) -> str:
    """``firstChooseStrategy``: retry is decided on the job's configuration alone (the
    caller handles an agent that did not offer it); the rest needs both sides."""
    if RETRY in job and not has_normal_faults:
        return RETRY
    return choose_after_retry_failure(job, agent, rank0_pod_faulty)


def choose_after_retry_failure(job: Sequence[str], agent: Sequence[str],
                               rank0_pod_faulty: bool) -> str:
    if _supported(RECOVER, job, agent):
        return RECOVER
    if can_downgrade(job, agent, rank0_pod_faulty):
        return DOWNGRADE
    return choose_after_recover_failure(job, agent)


def choose_after_recover_failure(job: Sequence[str], agent: Sequence[str]) -> str:
    return DUMP if _supported(DUMP, job, agent) else EXIT
