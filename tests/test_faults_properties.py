"""Property tests: the two codec implementations agree with each other, with the
generated protobuf classes, and with ClusterD's documented rules, on arbitrary input."""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bridge.faults import _python as _faults_py  # noqa: E402
from bridge._proto import recover_pb2 as pb  # noqa: E402

compiled = pytest.importorskip("bridge.faults._c")

CANONICAL = re.compile(r"^\d+:[012](,\d+:[012])*$")
ranks = st.integers(min_value=0, max_value=2**31 - 1)
small_ranks = st.integers(min_value=0, max_value=64)
types = st.sampled_from([0, 1, 2])
fault_maps = st.dictionaries(st.one_of(ranks, small_ranks), types, max_size=300)
wild_keys = st.one_of(ranks, st.integers(), st.booleans(), st.text(max_size=3), st.floats(allow_nan=False))
wild_maps = st.dictionaries(wild_keys, st.one_of(types, st.integers(), st.booleans(), st.text(max_size=2)), max_size=6)
fault_alphabet = st.sampled_from(list("0123456789:, ") + ["\u0661", "x", "+", "-", "\t"])
fault_texts = st.one_of(st.text(fault_alphabet, max_size=40), st.text(max_size=20))


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", call())
    except (TypeError, ValueError) as error:
        return (type(error).__name__, str(error))


def agree(name: str, *args: Any, **kwargs: Any) -> Any:
    reference = outcome(lambda: getattr(_faults_py, name)(*args, **kwargs))
    assert outcome(lambda: getattr(compiled, name)(*args, **kwargs)) == reference
    return reference


@given(fault_maps)
def test_format_parse_round_trip(faults: dict[int, int]) -> None:
    status, text = agree("format_faults", faults)
    assert status == "ok"
    assert text == "" or CANONICAL.match(text)
    assert agree("parse_faults", text) == ("ok", faults)


@given(fault_texts)
@settings(max_examples=400)
def test_strict_parse_agrees_and_accepts_exactly_the_canonical_grammar(text: str) -> None:
    status, value = agree("parse_faults", text)
    grammatical = text == "" or (CANONICAL.match(text) is not None and text.isascii()
                                 and all(int(e.split(":")[0]) < 2**31 for e in text.split(",")))
    assert (status == "ok") == grammatical
    if status == "ok":
        assert agree("parse_faults", agree("format_faults", value)[1]) == ("ok", value)


@given(fault_texts)
@settings(max_examples=400)
def test_lenient_parse_agrees_and_never_yields_unrepresentable_faults(text: str) -> None:
    status, parsed = agree("parse_faults", text, strict=False)
    assert status == "ok"
    formatted = agree("format_faults", parsed.faults)[1]
    assert formatted == "" or CANONICAL.match(formatted)
    if parsed.poisoned:
        assert parsed.faults == {}


@given(st.lists(fault_maps, max_size=4))
def test_merge_agrees_and_follows_the_rule(maps: list[dict[int, int]]) -> None:
    status, merged = agree("merge_faults", *maps)
    assert status == "ok"
    for rank, fault_type in merged.items():
        seen = [m[rank] for m in maps if rank in m]
        assert fault_type == (1 if 1 in seen else seen[-1])


@given(fault_maps, st.lists(st.one_of(fault_maps, wild_maps), max_size=3))
def test_merge_into_agrees_with_merge_and_leaves_the_target_alone_on_error(
    target: dict[int, int], maps: list[dict[Any, Any]]
) -> None:
    expected = outcome(lambda: _faults_py.merge_faults(target, *maps))
    for implementation in (_faults_py, compiled):
        copy = dict(target)
        got = outcome(lambda: implementation.merge_faults_into(copy, *maps))
        if expected[0] == "ok":
            assert got == expected and copy == expected[1]
        else:
            assert got == expected and copy == target


@given(wild_maps)
def test_validation_errors_agree_on_arbitrary_maps(faults: dict[Any, Any]) -> None:
    agree("format_faults", faults)
    agree("merge_faults", faults)
    agree("encode_fault_ranks", faults, 2)


@given(fault_maps, st.text(max_size=8), st.integers(min_value=-(2**31), max_value=2**31 - 1), st.text(max_size=8),
       st.lists(st.sampled_from(["exit", "dump", "retry", "recover", ""]), max_size=5))
def test_encoders_are_byte_identical_to_generated_classes(
    faults: dict[int, int], job_id: str, code: int, info: str, strategies: list[str]
) -> None:
    fault_ranks = [pb.FaultRank(rankId=str(r), faultType=str(t)) for r, t in faults.items()]
    expected = {
        "encode_process_fault_request": (
            (job_id, faults), pb.ProcessFaultRequest(jobId=job_id, faultRanks=fault_ranks)),
        "encode_stop_complete_request": (
            (job_id, code, info, faults),
            pb.StopCompleteRequest(jobId=job_id, status=pb.Status(code=code, info=info), faultRanks=fault_ranks)),
        "encode_recover_strategy_request": (
            (job_id, faults, strategies),
            pb.RecoverStrategyRequest(jobId=job_id, faultRanks=fault_ranks, strategies=strategies)),
        "encode_recover_status_request": (
            (job_id, code, info, "retry", strategies),
            pb.RecoverStatusRequest(jobId=job_id, status=pb.Status(code=code, info=info), strategy="retry",
                                    isolateRankIds=strategies)),
    }
    for name, (args, message) in expected.items():
        assert agree(name, *args) == ("ok", message.SerializeToString())


@given(fault_maps, st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3))
def test_decode_inverts_generated_signal(faults: dict[int, int], uuid: str, actions: list[str]) -> None:
    signal = pb.ProcessManageSignal(
        uuid=uuid, actions=actions, faultRanks=[pb.FaultRank(rankId=str(r), faultType=str(t)) for r, t in faults.items()]
    )
    assert agree("decode_signal_faults", signal.SerializeToString()) == ("ok", faults)


@given(st.binary(max_size=60))
def test_decode_agrees_on_arbitrary_bytes(raw: bytes) -> None:
    agree("decode_signal_faults", raw)


@given(st.lists(st.tuples(st.text(max_size=4), st.text(max_size=3)), max_size=6))
def test_decode_agrees_on_arbitrary_fault_rank_strings(entries: list[tuple[str, str]]) -> None:
    signal = pb.ProcessManageSignal(faultRanks=[pb.FaultRank(rankId=r, faultType=t) for r, t in entries])
    agree("decode_signal_faults", signal.SerializeToString())


def test_compiled_module_is_really_compiled() -> None:
    assert compiled.__file__.endswith((".so", ".pyd"))


class Text(str):
    """A str subclass: not on the compiled encoders' fast path, so the reference encodes it."""


class Index:
    """An int-like (``__index__``) status code, as a numpy integer is."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


wild_texts = st.one_of(st.text(max_size=4), st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                                                       min_size=1, max_size=2),
                       st.builds(Text, st.text(max_size=3)), st.integers(), st.none(), st.binary(max_size=2))
wild_codes = st.one_of(st.integers(), st.booleans(), st.builds(Index, st.integers(min_value=-(2**40), max_value=2**40)),
                       st.floats(allow_nan=False), st.text(max_size=2), st.none())
wild_lists = st.one_of(st.lists(wild_texts, max_size=3), st.tuples(wild_texts), wild_texts,
                       st.iterables(st.text(max_size=2), max_size=2))


@given(wild_texts, wild_codes, wild_texts, wild_texts, wild_lists)
def test_encoders_agree_on_arbitrary_head_arguments(
    job_id: Any, code: Any, info: Any, strategy: Any, strings: Any
) -> None:
    """The compiled encoders write exact str/int arguments themselves and hand anything
    else to the reference: the bytes or the error must be the same either way."""
    if hasattr(strings, "__next__"):  # a one-shot iterator: each call gets the same values
        strings = list(strings)
    agree("encode_process_fault_request", job_id, {1: 1})
    agree("encode_stop_complete_request", job_id, code, info, {2: 0})
    agree("encode_recover_strategy_request", job_id, {3: 2}, strings)
    agree("encode_recover_status_request", job_id, code, info, strategy, strings)
