"""The per-PodGroup state machine and the fault strings, without any API server.

The property tests are the contract with ClusterD: whatever ClusterD writes into
ProcessConfirmFault, what the agent writes back into ProcessResultFault parses under
ClusterD's own rules to exactly the intended ranks, is never poisoned, and is either
empty or ``^\\d+:[012](,\\d+:[012])*$``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bridge.faults import merge_faults, parse_faults
from bridge.platform import cycle
from bridge.platform.annotations import CONFIRM, ENABLE_LABEL, RANK_TABLE_READY, RESULT, STATUS, STRATEGY, PodGroupView, resource_version_newer
from bridge.platform.confirm import read_confirm, result_for, salvage
from bridge.platform.policy import Rules, Situation, decide

CANONICAL = re.compile(r"^\d+:[012](,\d+:[012])*$")


def view(annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None,
         rv: str = "10", uid: str = "u1") -> PodGroupView:
    return PodGroupView("ns", "job", uid, rv, dict(annotations or {}), dict(labels or {}))


def step(annotations: dict[str, str], memory: cycle.Memory | None = None, rules: Rules = Rules(),
         now: float = 0.0, labels: dict[str, str] | None = None, stale_after: float = 100.0) -> cycle.Step:
    return cycle.next_step(view(annotations, labels), memory or cycle.Memory(), rules, now, stale_after)


# --------------------------------------------------------------------------- next_step


def test_not_platform_mode_is_left_alone() -> None:
    assert step({CONFIRM: "1:1"}).kind is cycle.Kind.NOTHING


def test_arm_standing_strategy() -> None:
    assert step({STRATEGY: ""}) == cycle.Step(cycle.Kind.ARM, "standing")
    assert step({STRATEGY: "retry"}).kind is cycle.Kind.ARM
    assert step({STRATEGY: "dump"}).kind is cycle.Kind.NOTHING
    assert step({STRATEGY: ""}, rules=Rules(standing_strategy="")).kind is cycle.Kind.NOTHING  # hold
    assert step({STRATEGY: "retry"}, rules=Rules(standing_strategy="")).kind is cycle.Kind.NOTHING


def test_answer_a_pending_confirm() -> None:
    assert step({STRATEGY: "dump", CONFIRM: "1:1"}).kind is cycle.Kind.ANSWER
    assert step({STRATEGY: "dump", CONFIRM: " "}).kind is cycle.Kind.ANSWER  # ClusterD: len > 0 is "set"
    assert step({STRATEGY: "dump", CONFIRM: "1:1", STATUS: "retry-success"}).kind is cycle.Kind.ANSWER


def test_wait_for_the_status_then_clear() -> None:
    answered = {STRATEGY: "retry", CONFIRM: "1:0", RESULT: "1:0"}
    assert step(answered).kind is cycle.Kind.NOTHING
    cleared = step({**answered, STATUS: "retry-success"})
    assert cleared == cycle.Step(cycle.Kind.CLEAR, "status")


def test_stale_result_is_cleared() -> None:
    assert step({STRATEGY: "dump", RESULT: ""}) == cycle.Step(cycle.Kind.CLEAR, "stale_result")


def test_pause_label_clears_everything_left() -> None:
    paused = {ENABLE_LABEL: "pause"}
    assert step({STRATEGY: "retry", CONFIRM: "1:1"}, labels=paused) == cycle.Step(cycle.Kind.CLEAR, "paused")
    interim = step({STRATEGY: "dump", STATUS: "retry-failed"}, labels=paused)
    assert interim == cycle.Step(cycle.Kind.CLEAR, "paused", drop_status=True)
    assert step({STRATEGY: "dump", STATUS: "dump-success"}, labels=paused).kind is cycle.Kind.NOTHING


def test_remembered_pause_never_deletes_an_unanswered_confirm() -> None:
    memory = cycle.Memory(pause_pending=True)
    s = step({STRATEGY: "dump", CONFIRM: "1:1", STATUS: "recover-failed"}, memory)
    assert s == cycle.Step(cycle.Kind.CLEAR, "paused", drop_status=True, keep_confirm=True)
    body = cycle.clear_patch(view({STRATEGY: "dump", CONFIRM: "1:1", STATUS: "recover-failed"}), Rules(), s)
    assert body["metadata"]["annotations"] == {STATUS: None, STRATEGY: ""}
    memory = cycle.Memory(pause_pending=True)
    assert step({STRATEGY: "dump", CONFIRM: "1:1"}, memory).kind is cycle.Kind.ANSWER
    assert memory.pause_pending is False


def test_timeout_clears_a_cycle_whose_end_was_missed() -> None:
    memory = cycle.Memory()
    answered = {STRATEGY: "retry", CONFIRM: "1:0", RESULT: "1:0"}
    assert step(answered, memory, now=0.0).kind is cycle.Kind.NOTHING
    assert step(answered, memory, now=99.0).kind is cycle.Kind.NOTHING
    assert step(answered, memory, now=100.0) == cycle.Step(cycle.Kind.CLEAR, "timeout")
    interim = {STRATEGY: "dump", STATUS: "recover-failed"}
    memory = cycle.Memory()
    assert step(interim, memory, now=0.0).kind is cycle.Kind.NOTHING
    assert step(interim, memory, now=200.0) == cycle.Step(cycle.Kind.CLEAR, "timeout", drop_status=True)


def test_after_failed_retry() -> None:
    assert cycle.after_failed_retry(view({STATUS: "retry-failed"}))
    assert not cycle.after_failed_retry(view({STATUS: "recover-failed"}))


# --------------------------------------------------------------------------- observe


def test_observe_counts_cycles_statuses_and_invalid_values() -> None:
    memory = cycle.Memory()
    first = cycle.observe(view({STRATEGY: "dump", STATUS: "retry-success"}, rv="1"), memory, 0.0)
    assert first == cycle.Observation()  # an old status seen at start-up is not a new one
    seen = cycle.observe(view({STRATEGY: "dump", STATUS: "retry-success", CONFIRM: "1:1"}, rv="2"), memory, 1.0)
    assert seen.new_cycle and memory.confirm_seen_at == 1.0
    again = cycle.observe(view({STRATEGY: "dump", STATUS: "retry-success", CONFIRM: "1:1"}, rv="3"), memory, 2.0)
    assert not again.new_cycle and memory.confirm_seen_at == 1.0
    status = cycle.observe(view({STRATEGY: "nonsense", STATUS: "dump-failed", RANK_TABLE_READY: "false"}, rv="4"),
                           memory, 3.0)
    assert status.new_status == "dump-failed"
    assert set(status.invalid) == {(STRATEGY, "invalid"), (RANK_TABLE_READY, "invalid")}
    foreign = cycle.observe(view({STRATEGY: "dump", RESULT: "1:1, 2:1"}, rv="5"), memory, 4.0)
    assert foreign.invalid == ((RESULT, "non_canonical"),)


def test_observe_pause_after_the_answer_only() -> None:
    memory = cycle.Memory(uid="u1", seen=True, answer_rv="20")
    cycle.observe(view({STRATEGY: "retry"}, {ENABLE_LABEL: "pause"}, rv="15"), memory, 0.0)
    assert not memory.pause_pending  # older than the answer
    cycle.observe(view({STRATEGY: "retry"}, {ENABLE_LABEL: "pause"}, rv="21"), memory, 0.0)
    assert memory.pause_pending and memory.last_pause_rv == "21"


def test_new_uid_forgets() -> None:
    memory = cycle.Memory(uid="old", answer_rv="5", pause_pending=True)
    cycle.observe(view({STRATEGY: "dump"}, uid="new"), memory, 0.0)
    assert memory.uid == "new" and memory.answer_rv is None and not memory.pause_pending


def test_resource_version_order() -> None:
    assert resource_version_newer("11", "9") is True
    assert resource_version_newer("9", "11") is False
    assert resource_version_newer("9", "9") is False
    assert resource_version_newer("abc", "9") is None


# --------------------------------------------------------------------------- patches


def test_answer_patch_is_one_conditional_write() -> None:
    pg = view({STRATEGY: "dump", CONFIRM: "2:1", STATUS: "retry-success", RANK_TABLE_READY: "true"}, rv="42")
    body = cycle.answer_patch(pg, decide(Rules(), Situation({2: 1})), "2:1")
    assert body == {"metadata": {"resourceVersion": "42", "annotations": {
        STRATEGY: "recover", RESULT: "2:1", RANK_TABLE_READY: "true", STATUS: None}}}
    body = cycle.answer_patch(pg, decide(Rules(), Situation({2: 0})), "2:0")
    assert body["metadata"]["annotations"] == {STRATEGY: "retry", RESULT: "2:0", RANK_TABLE_READY: None,
                                               STATUS: None}


def test_clear_patch_keeps_the_strategy_key() -> None:
    pg = view({STRATEGY: "recover", CONFIRM: "2:1", RESULT: "2:1", RANK_TABLE_READY: "true",
               STATUS: "recover-success", "other": "kept"}, rv="7")
    body = cycle.clear_patch(pg, Rules(), cycle.Step(cycle.Kind.CLEAR, "status"))
    assert body == {"metadata": {"resourceVersion": "7", "annotations": {
        CONFIRM: None, RESULT: None, RANK_TABLE_READY: None, STRATEGY: ""}}}
    external = cycle.clear_patch(pg, Rules(rank_table="external"), cycle.Step(cycle.Kind.CLEAR, "status"))
    assert RANK_TABLE_READY not in external["metadata"]["annotations"]


def test_arm_patch() -> None:
    assert cycle.arm_patch(view({STRATEGY: ""}, rv="3"), Rules(standing_strategy="retry")) == {
        "metadata": {"resourceVersion": "3", "annotations": {STRATEGY: "retry"}}}


# --------------------------------------------------------------------------- fault strings


@pytest.mark.parametrize(
    ("text", "faults", "kinds", "answer"),
    [
        ("3:1,1:0", {1: 0, 3: 1}, {}, "1:0,3:1"),
        ("4:1, 2:1", {4: 1}, {"poisoned": 1}, "4:1"),  # ClusterD: no ranks at all
        ("1:1,,2:1,bad,1:1:1", {1: 1, 2: 1}, {"dropped": 3}, "1:1,2:1"),
        ("1:7,2:0", {2: 0}, {"rejected": 1}, "2:0"),
        ("  ,1:1,  ", {1: 1}, {}, "1:1"),
        ("1:1,1:0,2:0,2:2", {1: 1, 2: 2}, {}, "1:1,2:2"),
        ("", {}, {}, ""),
        ("x:1", {}, {"poisoned": 1}, ""),
    ],
)
def test_read_confirm(text: str, faults: dict[int, int], kinds: dict[str, int], answer: str) -> None:
    reading = read_confirm(text)
    assert reading.faults == faults
    assert reading.malformed_counts() == kinds
    assert result_for(reading.faults, {})[1] == answer


def test_platform_faults_merge_with_clusterds_rule() -> None:
    assert result_for({1: 1, 2: 0}, {1: 0, 2: 1, 9: 2}) == ({1: 1, 2: 1, 9: 2}, "1:1,2:1,9:2")


_ELEMENTS = st.one_of(
    st.builds(lambda r, t: f"{r}:{t}", st.integers(0, 2**31 + 5), st.sampled_from(["0", "1", "2"])),
    st.builds(lambda r, t: f"{r}:{t}", st.integers(-(2**64), 2**64), st.text(max_size=3)),
    st.sampled_from(["", " ", "bad", "7", "1:1:1", ":", " 2:1", "2 :1", "+3:1", "-1:0", "٣:1", "\t4:0",
                     "99999999999999999999:1", "0007:2", "\u00a05:1"]),
    st.text(max_size=8),
)
_CONFIRM_TEXT = st.one_of(
    st.lists(_ELEMENTS, max_size=12).map(",".join),
    st.builds(lambda pre, body, post: pre + body + post, st.sampled_from(["", " ", ",", "\n ,"]),
              st.lists(_ELEMENTS, max_size=8).map(",".join), st.sampled_from(["", " ", ",", ", \t"])),
    st.text(max_size=40),
)
_PLATFORM = st.dictionaries(st.integers(0, 2**31 - 1), st.sampled_from([0, 1, 2]), max_size=5)


@settings(max_examples=250, deadline=None)
@given(text=_CONFIRM_TEXT, platform=_PLATFORM)
@example(text="4:1, 2:1", platform={})
@example(text="1:1,,2:1,bad,7,1:1:1", platform={3: 0})
@example(text=" 1:0 ", platform={})
def test_the_answer_is_always_what_clusterd_reads_exactly(text: str, platform: dict[int, int]) -> None:
    reading = read_confirm(text)
    intended, answer = result_for(reading.faults, platform)
    assert answer == "" or CANONICAL.match(answer)
    back = parse_faults(answer, strict=False)
    assert not back.poisoned and not back.dropped and not back.rejected
    assert back.faults == intended
    clusterd = parse_faults(text, strict=False)
    if not clusterd.poisoned:
        # ClusterD's own reading is kept exactly, merged with the platform's by its rule
        assert reading.faults == clusterd.faults
        assert intended == merge_faults(clusterd.faults, platform)
    else:
        # salvaged ranks are only ever ones written as integers in the confirm
        written = {int(e.split(":")[0]) for e in text.split(",")
                   if e.count(":") == 1 and re.fullmatch(r"[+-]?[0-9]+", e.split(":")[0].strip())}
        assert set(reading.faults) <= written
    # and the whole answer patch carries nothing else ClusterD could misread
    decision = decide(Rules(), Situation(intended, unusable=reading.poisoned or not intended))
    body = cycle.answer_patch(view({STRATEGY: "dump", CONFIRM: text}), decision, answer)
    annotations: dict[str, Any] = body["metadata"]["annotations"]
    assert annotations[RESULT] == answer
    assert annotations[STRATEGY] in ("retry", "recover", "dump", "exit")
    if reading.poisoned or not intended:
        assert annotations[STRATEGY] == "dump"


@settings(max_examples=200, deadline=None)
@given(text=_CONFIRM_TEXT)
def test_salvage_agrees_with_clusterd_when_not_poisoned(text: str) -> None:
    clusterd = parse_faults(text, strict=False)
    if not clusterd.poisoned:
        assert salvage(text) == clusterd.faults
