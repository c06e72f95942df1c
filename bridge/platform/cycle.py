"""One PodGroup's fault cycle as the agent sees it: what to write next, and the patch.

Everything here is pure (no I/O, no clock of its own), so the rules can be tested on
their own. The agent calls :func:`observe` for every version of a PodGroup it receives
and :func:`next_step` whenever it may act; it writes the body of :func:`answer_patch`,
:func:`clear_patch` or :func:`arm_patch` with the resourceVersion it decided on.

Steps, in priority order (C = ProcessConfirmFault non-empty, R = ProcessResultFault key
present, S = ProcessRecoverStatus):

1. **clear, paused**: the ``process-recover-enable`` label is ``pause`` now, or went to
   ``pause`` after our last answer. ClusterD only does that in its FaultRetry state, the
   tail of a cycle that ended in exit (which writes no status), 508 or 509; no confirm
   exchange is running, so everything stale goes: C, R, our RankTableReady, and an
   interim S (``retry-failed``/``recover-failed``, which would otherwise make the next
   cycle's answer think a retry just failed). The memory-only trigger never deletes an
   unanswered confirm: that may be the next cycle's.
2. **answer**: C and no R. ClusterD is polling for R (every 3 s, 509 after 300 s).
   One patch writes the strategy, R, RankTableReady and deletes the previous S, so
   ClusterD never sees a result without the strategy meant for it, and any S that
   appears afterwards is this cycle's (a status written twice with the same value is
   no change and no watch event; deleting it here is what makes the next one visible).
3. **clear, status**: R and an S. ClusterD wrote the outcome of the step we answered;
   it never reads C or R again for it, and it never clears them: left in place, the
   next fault fails at once with 509 (C non-empty) or reads our old R as its answer.
   Fast matters: after ``retry-failed`` with code 405 ClusterD goes straight back to
   the confirm step, about a second later. S itself is kept for people to read.
4. **clear, stale_result**: R without C: nobody asked; the next cycle would take it as
   its answer.
5. **clear, timeout**: answered and no status for ``stale_after`` seconds, or an interim
   S that was never followed by anything: the end of the cycle went unseen.
6. **arm**: no C, no R, and the strategy is not the standing one: write it (the value
   ClusterD needs *before* it tells anyone about the next fault).

A clear resets ``ProcessRecoverStrategy`` to ``""`` rather than deleting it: ClusterD
decides platform mode by the key's presence (frozen at the job's first Init), and a
deleted key would turn the job's platform control off after its next restart. The
reset withdraws the cycle's decision; step 6 then writes the standing value again
(unless the policy holds: standing ``""``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from bridge.platform.annotations import CONFIRM, CONFIRM_STRATEGIES, INTERIM_STATUSES, RANK_TABLE_READY, RESULT, STATUS, STATUSES, STRATEGY, PodGroupView, resource_version_newer
from bridge.platform.confirm import CANONICAL
from bridge.platform.policy import Decision, Rules


class Kind(Enum):
    """What a step writes: nothing, the answer, the end-of-cycle clear, or the standing strategy (arm)."""
    NOTHING = "nothing"
    ANSWER = "answer"
    CLEAR = "clear"
    ARM = "arm"


@dataclass(frozen=True)
class Step:
    """The next write for one PodGroup and why (:func:`next_step`)."""
    kind: Kind
    reason: str = ""
    drop_status: bool = False
    keep_confirm: bool = False


NOTHING = Step(Kind.NOTHING)


@dataclass
class Memory:
    """What the agent remembers of one PodGroup. Lost on restart: every rule also works
    from the annotations alone, memory only catches short-lived states and times."""

    uid: str = ""
    seen: bool = False
    last_annotations: dict[str, str] = field(default_factory=dict)
    confirm_seen_at: float | None = None
    answer_rv: str | None = None
    last_pause_rv: str | None = None
    pause_pending: bool = False
    wait_signature: tuple[str, bool, str] | None = None
    wait_since: float = 0.0
    failures: int = 0

    def reset(self, uid: str) -> None:
        """Forget everything: a new PodGroup under an old name."""
        fresh = Memory(uid=uid)
        for name in fresh.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))


@dataclass(frozen=True)
class Observation:
    """What changed in one received version, for the metrics."""

    new_cycle: bool = False
    new_status: str = ""
    invalid: tuple[tuple[str, str], ...] = ()


def observe(view: PodGroupView, memory: Memory, now: float) -> Observation:
    """Update ``memory`` with one received version of the PodGroup."""
    if memory.uid != view.uid:
        memory.reset(view.uid)
    before = memory.last_annotations
    first = not memory.seen
    memory.seen = True
    memory.last_annotations = dict(view.annotations)

    new_cycle = False
    if not (view.confirm and not view.has_result):
        memory.confirm_seen_at = None  # answered, or cleared unanswered (a 509's FaultRetry)
    elif memory.confirm_seen_at is None:
        memory.confirm_seen_at = now
        new_cycle = True
    if view.paused:
        memory.last_pause_rv = view.resource_version
        if memory.answer_rv is None or resource_version_newer(view.resource_version, memory.answer_rv) is not False:
            memory.pause_pending = True

    new_status = ""
    if view.status and view.status != before.get(STATUS) and not first:
        new_status = view.status
    invalid: list[tuple[str, str]] = []
    for key, allowed in ((STRATEGY, ("",) + CONFIRM_STRATEGIES), (RANK_TABLE_READY, ("", "true")),
                         (STATUS, ("",) + STATUSES)):
        value = view.annotations.get(key)
        if value is not None and value not in allowed and value != before.get(key):
            invalid.append((key, "invalid"))
    result = view.annotations.get(RESULT)
    if result and result != before.get(RESULT) and not CANONICAL.fullmatch(result):
        invalid.append((RESULT, "non_canonical"))  # not ours: the agent writes only canonical text
    return Observation(new_cycle, new_status, tuple(invalid))


def next_step(view: PodGroupView, memory: Memory, rules: Rules, now: float, stale_after: float) -> Step:
    """The one thing to write next for this PodGroup (see the module docstring)."""
    if not view.platform_mode:
        return NOTHING
    confirm, result, status = bool(view.confirm), view.has_result, view.status
    owned_rank_table = rules.rank_table != "external" and RANK_TABLE_READY in view.annotations
    interim = status in INTERIM_STATUSES

    if view.paused and (confirm or result or owned_rank_table or interim):
        return Step(Kind.CLEAR, "paused", drop_status=interim)
    if memory.pause_pending:
        if result or interim:
            return Step(Kind.CLEAR, "paused", drop_status=interim, keep_confirm=confirm and not result)
        memory.pause_pending = False  # nothing left of the cycle the pause ended

    if confirm and not result:
        return Step(Kind.ANSWER, "confirm")
    if result and status:
        return Step(Kind.CLEAR, "status")
    if result and not confirm:
        return Step(Kind.CLEAR, "stale_result")

    signature = (view.confirm, result, status)
    waiting = (confirm and result) or interim
    if not waiting:
        memory.wait_signature = None
    elif memory.wait_signature != signature:
        memory.wait_signature, memory.wait_since = signature, now
    elif now - memory.wait_since >= stale_after:
        return Step(Kind.CLEAR, "timeout", drop_status=interim)
    if waiting and confirm:
        return NOTHING

    if rules.standing_strategy and view.strategy != rules.standing_strategy:
        return Step(Kind.ARM, "standing")
    return NOTHING


def after_failed_retry(view: PodGroupView) -> bool:
    """A confirm that follows ``retry-failed`` is the same cycle's second one (code 405):
    ClusterD will not retry again, so answering ``retry`` would leave it only ``exit``."""
    return view.status == "retry-failed"


# --------------------------------------------------------------------------- patches


def _body(view: PodGroupView, annotations: dict[str, str | None]) -> dict[str, Any]:
    """A merge patch conditioned on the version the decision was made on."""
    return {"metadata": {"resourceVersion": view.resource_version, "annotations": annotations}}


def answer_patch(view: PodGroupView, decision: Decision, result_text: str) -> dict[str, Any]:
    changes: dict[str, str | None] = {STRATEGY: decision.strategy, RESULT: result_text}
    if decision.rank_table == "true":
        changes[RANK_TABLE_READY] = "true"
    elif decision.rank_table == "delete" and RANK_TABLE_READY in view.annotations:
        changes[RANK_TABLE_READY] = None
    if STATUS in view.annotations:
        changes[STATUS] = None
    return _body(view, changes)


def clear_patch(view: PodGroupView, rules: Rules, step: Step) -> dict[str, Any]:
    changes: dict[str, str | None] = {}
    if CONFIRM in view.annotations and not step.keep_confirm:
        changes[CONFIRM] = None
    if RESULT in view.annotations:
        changes[RESULT] = None
    if rules.rank_table != "external" and RANK_TABLE_READY in view.annotations:
        changes[RANK_TABLE_READY] = None
    if step.drop_status and STATUS in view.annotations:
        changes[STATUS] = None
    if view.strategy != "":
        changes[STRATEGY] = ""
    return _body(view, changes)


def arm_patch(view: PodGroupView, rules: Rules) -> dict[str, Any]:
    return _body(view, {STRATEGY: rules.standing_strategy})
