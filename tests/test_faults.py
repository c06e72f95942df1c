"""The fault codec's contract, run against both implementations (``codec`` fixture)."""

from __future__ import annotations

import random
import re
import sys
import sysconfig
from collections import OrderedDict
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

from bridge._proto import recover_pb2 as pb

CANONICAL = re.compile(r"^\d+:[012](,\d+:[012])*$")


class IntLike:
    """An int-like object (``__index__``), as numpy integers are."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __hash__(self) -> int:
        return hash(("IntLike", self.value))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IntLike) and other.value == self.value

    def __repr__(self) -> str:
        return f"IntLike({self.value})"


def ranks_msg(faults: dict[int, int]) -> list[pb.FaultRank]:
    return [pb.FaultRank(rankId=str(r), faultType=str(t)) for r, t in faults.items()]


# --------------------------------------------------------------------------- format


def test_format_sorts_ranks_and_has_no_spaces(codec: ModuleType) -> None:
    text = codec.format_faults({40: 1, 12: 0, 7: 2})
    assert text == "7:2,12:0,40:1"
    assert CANONICAL.match(text)


def test_format_empty_map_is_empty_string(codec: ModuleType) -> None:
    assert codec.format_faults({}) == ""


def test_format_large_unsorted_map_uses_radix_path(codec: ModuleType) -> None:
    faults = {r: r % 3 for r in range(5000, 0, -7)}
    text = codec.format_faults(faults)
    assert text == ",".join(f"{r}:{r % 3}" for r in sorted(faults))


@pytest.mark.parametrize("count", [400, 9000])
@pytest.mark.parametrize("spread", [lambda r: r << 11, lambda r: r << 22, lambda r: 5 + (r << 22), lambda r: r * 40_009,
                                    lambda r: (r << 8) | 3, lambda r: 2**31 - 1 - r])
def test_format_sorts_ranks_that_share_some_radix_digits(codec: ModuleType, spread: Callable[[int], int],
                                                         count: int) -> None:
    """Ranks whose low, middle or high bits are all alike (radix digits that are the same
    for every rank), in shuffled order, in maps short and long enough for each digit width."""
    ranks = [spread(r) for r in range(1, count)]
    random.Random(3).shuffle(ranks)
    faults = {rank: rank % 3 for rank in ranks if 0 <= rank <= 2**31 - 1}
    assert codec.format_faults(faults) == ",".join(f"{r}:{r % 3}" for r in sorted(faults))


@pytest.mark.parametrize("count", [100, 9000])
def test_format_int_likes_colliding_in_a_long_map_follow_merge_rule(codec: ModuleType, count: int) -> None:
    """Each rank given twice (an int-like and an int) in a map long enough to be radix
    sorted: the sort must keep each rank's two entries in the map's order."""
    rng = random.Random(5)
    ranks = rng.sample(range(10 * count), count)
    faults: OrderedDict[object, int] = OrderedDict()
    for rank in ranks:
        faults[IntLike(rank)] = rank % 3
    for rank in reversed(ranks):
        faults[rank] = (rank + 1) % 3
    expected = {rank: rank % 3 if rank % 3 == 1 else (rank + 1) % 3 for rank in ranks}
    assert codec.format_faults(faults) == ",".join(f"{r}:{expected[r]}" for r in sorted(expected))


def test_format_accepts_int_likes_and_other_mappings(codec: ModuleType) -> None:
    assert codec.format_faults(OrderedDict([(IntLike(3), IntLike(1)), (1, 0)])) == "1:0,3:1"


def test_format_int_likes_colliding_on_one_rank_follow_merge_rule(codec: ModuleType) -> None:
    assert codec.format_faults({IntLike(3): 1, 3: 0}) == "3:1"
    assert codec.format_faults({IntLike(3): 0, 3: 2}) == "3:2"


def test_format_extreme_ranks(codec: ModuleType) -> None:
    assert codec.format_faults({2**31 - 1: 1, 0: 0}) == "0:0,2147483647:1"


# Each side of every change in a rank's digit count: the compiled codec computes the count
# from the bit length, which is off by one exactly here if it is wrong.
DIGIT_EDGES = sorted({0} | {e for k in range(1, 10) for e in (10**k - 1, 10**k, 10**k + 1)}
                     | {2**b - d for b in range(1, 32) for d in (0, 1) if 2**b - d < 2**31})


def test_every_digit_count_edge_formats_and_encodes_exactly(codec: ModuleType) -> None:
    faults = {rank: rank % 3 for rank in DIGIT_EDGES}
    assert codec.format_faults(faults) == ",".join(f"{r}:{r % 3}" for r in DIGIT_EDGES)
    expected = pb.ProcessFaultRequest(jobId="j", faultRanks=ranks_msg(faults)).SerializeToString()
    assert codec.encode_process_fault_request("j", faults) == expected


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("faults", "error", "fragment"),
    [
        ({True: 1}, TypeError, "fault map key True: rank must be an int, not bool"),
        ({"3": 1}, TypeError, "fault map key '3': rank must be an int, not str"),
        ({1.0: 1}, TypeError, "not float"),
        ({-1: 1}, ValueError, "fault map key -1: rank must be in 0..2147483647"),
        ({2**31: 1}, ValueError, "fault map key 2147483648: rank must be in"),
        ({2**70: 1}, ValueError, "rank must be in"),
        ({3: False}, TypeError, "fault map key 3: fault type False must be an int, not bool"),
        ({3: "1"}, TypeError, "fault type '1' must be an int, not str"),
        ({3: 3}, ValueError, "fault map key 3: fault type 3 must be 0, 1 or 2"),
        ({3: -1}, ValueError, "fault type -1 must be 0, 1 or 2"),
        ({3: 2**65}, ValueError, "must be 0, 1 or 2"),
    ],
)
@pytest.mark.parametrize("operation", ["format", "merge", "encode"])
def test_bad_entries_name_the_key(codec: ModuleType, faults: dict, error: type, fragment: str, operation: str) -> None:
    call = {
        "format": lambda: codec.format_faults(faults),
        "merge": lambda: codec.merge_faults({0: 1}, faults),
        "encode": lambda: codec.encode_fault_ranks(faults, 2),
    }[operation]
    with pytest.raises(error, match=re.escape(fragment)):
        call()


@pytest.mark.parametrize("not_a_map", [[(1, 1)], "1:1", None, 5])
def test_non_mappings_are_rejected(codec: ModuleType, not_a_map: object) -> None:
    with pytest.raises(TypeError, match="a fault map must be a mapping of rank to fault type"):
        codec.format_faults(not_a_map)
    with pytest.raises(TypeError, match="a fault map must be a mapping"):
        codec.merge_faults({}, not_a_map)


def test_bad_entry_leaves_inputs_untouched(codec: ModuleType) -> None:
    first = {1: 0}
    second = {2: 1, 3: 9}
    with pytest.raises(ValueError):
        codec.merge_faults(first, second)
    assert first == {1: 0} and second == {2: 1, 3: 9}


# --------------------------------------------------------------------------- strict parse


def test_parse_round_trips_canonical_strings(codec: ModuleType) -> None:
    assert codec.parse_faults("7:2,12:0,40:1") == {7: 2, 12: 0, 40: 1}
    assert codec.parse_faults("") == {}
    assert codec.parse_faults("0:0") == {0: 0}
    assert codec.parse_faults("2147483647:1") == {2147483647: 1}
    assert codec.parse_faults("007:1") == {7: 1}


def test_parse_duplicates_follow_clusterd_merge_rule(codec: ModuleType) -> None:
    assert codec.parse_faults("1:1,1:0") == {1: 1}
    assert codec.parse_faults("1:0,1:2") == {1: 2}
    assert codec.parse_faults("1:2,1:0,1:1,1:0") == {1: 1}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1:1,", "element 1 '' at offset 4: empty element"),
        (",1:1", "element 0 '' at offset 0: empty element"),
        ("1:1,,2:1", "element 1 '' at offset 4: empty element"),
        ("4:1, 2:1", "element 1 ' 2:1' at offset 4: rank must be ASCII decimal digits"),
        (" 4:1", "element 0 ' 4:1' at offset 0: rank must be ASCII decimal digits"),
        ("4:1 ", "element 0 '4:1 ' at offset 0: fault type must be 0, 1 or 2"),
        ("+4:1", "rank must be ASCII decimal digits"),
        ("-4:1", "rank must be ASCII decimal digits"),
        ("\u0661\u0662:0", "element 0 '\u0661\u0662:0' at offset 0: rank must be ASCII decimal digits"),
        ("1:\u0661", "fault type must be 0, 1 or 2"),
        ("12:0,40:3", "element 1 '40:3' at offset 5: fault type must be 0, 1 or 2"),
        ("7", "element 0 '7' at offset 0: missing ':' between rank and fault type"),
        ("bad", "missing ':'"),
        ("1:1:1", "element 0 '1:1:1' at offset 0: fault type must be 0, 1 or 2"),
        (":1", "rank must be ASCII decimal digits"),
        ("1:", "fault type must be 0, 1 or 2"),
        ("2147483648:1", "element 0 '2147483648:1' at offset 0: rank exceeds 2147483647"),
        ("99999999999999999999:1", "rank exceeds 2147483647"),
        ("1:01", "fault type must be 0, 1 or 2"),
        (",", "empty element"),
    ],
)
def test_strict_parse_names_the_offending_element(codec: ModuleType, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        codec.parse_faults(text)


def test_parse_rejects_non_strings(codec: ModuleType) -> None:
    with pytest.raises(TypeError, match="a fault string must be str, not bytes"):
        codec.parse_faults(b"1:1")
    with pytest.raises(TypeError, match="not NoneType"):
        codec.parse_faults(None, strict=False)


# --------------------------------------------------------------------------- lenient parse


def test_lenient_parse_reproduces_clusterd_verified_merge(codec: ModuleType) -> None:
    # Observed on the real server: confirm "1:1" + result "4:1,1:0,4:0,bad,7" -> 1:1,4:1.
    result = codec.parse_faults("4:1,1:0,4:0,bad,7", strict=False)
    confirm = codec.parse_faults("1:1", strict=False)
    assert result.dropped == ("bad", "7")
    assert not result.poisoned
    assert codec.merge_faults(result.faults, confirm.faults) == {4: 1, 1: 1}


def test_lenient_parse_one_space_poisons_everything(codec: ModuleType) -> None:
    parsed = codec.parse_faults("4:1, 2:1", strict=False)
    assert parsed.poisoned
    assert parsed.faults == {}


def test_lenient_parse_trims_only_the_whole_string(codec: ModuleType) -> None:
    parsed = codec.parse_faults("  ,,1:1,2:0,, \n", strict=False)
    assert parsed.faults == {1: 1, 2: 0}
    assert parsed.dropped == ()
    inner = codec.parse_faults("1:1,,2:1", strict=False)
    assert inner.faults == {1: 1, 2: 1}
    assert inner.dropped == ("",)


def test_lenient_parse_keeps_first_sticky_type_and_rejects_unknown_types(codec: ModuleType) -> None:
    parsed = codec.parse_faults("3:x,3:1,5:0,5:2,6:7", strict=False)
    # "x" is stored first and, not being "0"/"2", is sticky on ClusterD: rank 3 is unusable.
    assert parsed.faults == {5: 2}
    assert parsed.rejected == ("3:x", "6:7")


def test_lenient_parse_go_atoi_signs_and_range(codec: ModuleType) -> None:
    parsed = codec.parse_faults("+5:1,-1:1", strict=False)
    assert parsed.faults == {5: 1}
    assert parsed.rejected == ("-1:1",)
    assert codec.parse_faults("99999999999999999999:1", strict=False).poisoned


def test_lenient_parse_of_empty_and_blank(codec: ModuleType) -> None:
    for text in ("", "   ", ",,,"):
        parsed = codec.parse_faults(text, strict=False)
        assert parsed.faults == {} and parsed.dropped == () and not parsed.poisoned


# --------------------------------------------------------------------------- merge


def test_merge_rule(codec: ModuleType) -> None:
    assert codec.merge_faults({1: 0, 4: 1}, {1: 1}) == {1: 1, 4: 1}
    assert codec.merge_faults({1: 1}, {1: 0}) == {1: 1}
    assert codec.merge_faults({1: 0}, {1: 2}) == {1: 2}
    assert codec.merge_faults({1: 2}, {1: 0}) == {1: 0}
    assert codec.merge_faults() == {}
    assert codec.merge_faults({}, {}) == {}


def test_merge_normalises_int_likes(codec: ModuleType) -> None:
    merged = codec.merge_faults({IntLike(5): IntLike(2)})
    assert merged == {5: 2}
    assert all(type(k) is int and type(v) is int for k, v in merged.items())


def test_merge_returns_a_new_dict(codec: ModuleType) -> None:
    source = {1: 0}
    merged = codec.merge_faults(source)
    merged[2] = 1
    assert source == {1: 0}


def test_merge_into_writes_the_target_in_place(codec: ModuleType) -> None:
    target = {1: 0, 4: 1, 6: 2}
    result = codec.merge_faults_into(target, {1: 2, 4: 0}, {6: 1, 9: 0})
    assert result is target
    assert target == {1: 2, 4: 1, 6: 1, 9: 0}


def test_merge_into_equals_merge_faults(codec: ModuleType) -> None:
    maps = [{r: (r * 7) % 3 for r in range(0, 300, step)} for step in (1, 2, 5)]
    target = dict(maps[0])
    assert codec.merge_faults_into(target, *maps[1:]) == codec.merge_faults(*maps)


def test_merge_into_normalises_int_likes(codec: ModuleType) -> None:
    target = {5: 0}
    codec.merge_faults_into(target, {IntLike(5): IntLike(2), IntLike(7): 1})
    assert target == {5: 2, 7: 1}
    assert all(type(k) is int and type(v) is int for k, v in target.items())


def test_merge_into_bad_entry_leaves_the_target_untouched(codec: ModuleType) -> None:
    target = {1: 0}
    with pytest.raises(ValueError, match="fault type 7"):
        codec.merge_faults_into(target, {2: 1}, {3: 7})
    assert target == {1: 0}
    with pytest.raises(TypeError, match="must be a dict"):
        codec.merge_faults_into([], {2: 1})


# --------------------------------------------------------------------------- encoding


@pytest.mark.parametrize("faults", [{}, {0: 0}, {7: 1, 3: 2, 2**31 - 1: 0}, {r: r % 3 for r in range(300)}])
def test_encoders_match_generated_classes(codec: ModuleType, faults: dict[int, int]) -> None:
    assert codec.encode_fault_ranks(faults, 5) == b"".join(
        pb.ProcessManageSignal(faultRanks=[fr]).SerializeToString() for fr in ranks_msg(faults)
    )
    assert codec.encode_process_fault_request("job-1", faults) == pb.ProcessFaultRequest(
        jobId="job-1", faultRanks=ranks_msg(faults)
    ).SerializeToString()
    assert codec.encode_stop_complete_request("j", 404, "stop ok", faults) == pb.StopCompleteRequest(
        jobId="j", status=pb.Status(code=404, info="stop ok"), faultRanks=ranks_msg(faults)
    ).SerializeToString()
    assert codec.encode_recover_strategy_request(
        "j", faults, ["exit", "dump", "retry", "recover"]
    ) == pb.RecoverStrategyRequest(
        jobId="j", faultRanks=ranks_msg(faults), strategies=["exit", "dump", "retry", "recover"]
    ).SerializeToString()


def test_status_is_always_set_even_when_default(codec: ModuleType) -> None:
    for raw, cls in [
        (codec.encode_stop_complete_request("", 0, "", {}), pb.StopCompleteRequest),
        (codec.encode_recover_status_request("", 0, "", ""), pb.RecoverStatusRequest),
    ]:
        message = cls.FromString(raw)
        assert message.HasField("status")


def test_recover_status_request(codec: ModuleType) -> None:
    raw = codec.encode_recover_status_request("j", 201, "isolate", "downgrade", ["3", "4"])
    assert raw == pb.RecoverStatusRequest(
        jobId="j", status=pb.Status(code=201, info="isolate"), strategy="downgrade", isolateRankIds=["3", "4"]
    ).SerializeToString()
    negative = codec.encode_recover_status_request("j", -5, "", "retry")
    assert pb.RecoverStatusRequest.FromString(negative).status.code == -5


def test_encoder_argument_errors(codec: ModuleType) -> None:
    with pytest.raises(ValueError, match="field number 0"):
        codec.encode_fault_ranks({1: 1}, 0)
    with pytest.raises(ValueError, match="does not fit int32"):
        codec.encode_stop_complete_request("j", 2**31, "", {})
    with pytest.raises(TypeError, match="expected str"):
        codec.encode_process_fault_request(7, {})
    with pytest.raises(TypeError, match="single str"):
        codec.encode_recover_strategy_request("j", {}, "retry")


def test_non_ascii_job_id_and_info_round_trip(codec: ModuleType) -> None:
    raw = codec.encode_stop_complete_request("作业", 0, "停止", {1: 1})
    message = pb.StopCompleteRequest.FromString(raw)
    assert (message.jobId, message.status.info) == ("作业", "停止")


# --------------------------------------------------------------------------- decoding


def test_decode_signal_faults(codec: ModuleType) -> None:
    signal = pb.ProcessManageSignal(
        uuid="18A-abc", jobId="j", signalType="globalFault", actions=["on_global_rank", "fault_nodes_exit"],
        faultRanks=ranks_msg({0: 1, 1: 1, 9: 0}), timeout=33, nodeRankIds=["0"], extraParams="x",
    )
    assert codec.decode_signal_faults(signal.SerializeToString()) == {0: 1, 1: 1, 9: 0}
    assert codec.decode_signal_faults(b"") == {}
    assert codec.decode_signal_faults(bytearray(signal.SerializeToString())) == {0: 1, 1: 1, 9: 0}


def test_decode_duplicates_merge(codec: ModuleType) -> None:
    signal = pb.ProcessManageSignal(faultRanks=[
        pb.FaultRank(rankId="3", faultType="1"), pb.FaultRank(rankId="3", faultType="0"),
        pb.FaultRank(rankId="4", faultType="0"), pb.FaultRank(rankId="4", faultType="2"),
    ])
    assert codec.decode_signal_faults(signal.SerializeToString()) == {3: 1, 4: 2}


@pytest.mark.parametrize(
    ("rank_id", "fault_type"),
    [("x", "1"), (" 2", "1"), ("", "1"), ("3", "5"), ("3", ""), ("2147483648", "1"), ("-1", "0"), ("3", "10")],
)
def test_decode_rejects_malformed_entries_by_index(codec: ModuleType, rank_id: str, fault_type: str) -> None:
    signal = pb.ProcessManageSignal(faultRanks=[
        pb.FaultRank(rankId="1", faultType="1"), pb.FaultRank(rankId=rank_id, faultType=fault_type),
    ])
    with pytest.raises(ValueError, match=re.escape(f"signal fault entry 1 (rankId={rank_id!r}, faultType={fault_type!r})")):
        codec.decode_signal_faults(signal.SerializeToString())


@pytest.mark.parametrize("raw", [b"\x2a", b"\x2a\x05\x0a", b"\xff", b"\x00\x00", b"\x0b", b"\x09\x01"])
def test_decode_rejects_truncated_protobuf(codec: ModuleType, raw: bytes) -> None:
    with pytest.raises(ValueError, match="malformed protobuf"):
        codec.decode_signal_faults(raw)


def test_decode_skips_unknown_fields_of_every_wire_type(codec: ModuleType) -> None:
    inner = pb.FaultRank(rankId="12", faultType="2").SerializeToString()
    extra = b"\x18\x96\x01" + b"\x21" + b"\x00" * 8 + b"\x2d" + b"\x00" * 4  # fields 3, 4, 5 (varint, 64, 32 bit)
    raw = b"\x38\x21" + b"\x2a" + bytes([len(inner) + len(extra)]) + inner + extra
    assert codec.decode_signal_faults(raw) == {12: 2}


# --------------------------------------------------------------------------- ClusterD's rules, one home


def test_the_compiled_twin_takes_its_sticky_type_from_the_reference_rule() -> None:
    from bridge.faults import _python as _faults_py

    compiled = pytest.importorskip("bridge.faults._c")
    assert compiled._sticky_type() == 1
    assert [t for t in (0, 1, 2) if t not in _faults_py._REPLACEABLE] == [1]


def test_the_compiled_twin_reads_dict_entry_tables_in_place_on_every_supported_python() -> None:
    """The compiled walks read a dict's entry table in place only after an import-time
    check found CPython's layout as expected; a Python whose layout moved would silently
    take the slower PyDict_Next walk, so on the versions the codec is built for, say so."""
    compiled = pytest.importorskip("bridge.faults._c")
    if sys.version_info >= (3, 14) or sysconfig.get_config_var("Py_GIL_DISABLED"):
        pytest.skip("no known dict layout: the PyDict_Next walk is the one used")
    assert compiled._ENTRY_TABLES_READ_IN_PLACE is True
    faults = {r: r % 3 for r in range(1000)}
    for r in range(0, 1000, 3):
        del faults[r]  # deleted entries stay in the table as holes
    faults[5000] = 1
    assert compiled.format_faults(faults) == _faults_py_format(faults)
    assert compiled.merge_faults(faults) == faults and list(compiled.merge_faults({}, faults)) == list(faults)


def test_the_compiled_twin_tells_fault_types_by_offset_on_every_supported_python() -> None:
    """The compiled fast check tells a type by its object's offset from CPython's cached 0
    only after an import-time check found 0, 1 and 2 evenly laid out; a Python where they
    are not would silently take the comparisons, so on the versions built for, say so."""
    compiled = pytest.importorskip("bridge.faults._c")
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        pytest.skip("no small-int layout relied on there")
    assert compiled._TYPES_BY_OFFSET is True


class IntSubclass(int):
    pass


@pytest.mark.parametrize("by_offset", [True, False])
def test_fault_types_told_by_offset_or_by_comparison_agree_with_the_reference(by_offset: bool) -> None:
    """Mixed types in a long map, and values next to 0, 1 and 2 in memory (-1, 3), or equal
    to them but other objects (True, an int subclass, 1.0): both ways of telling a type
    give the reference's result or error."""
    from bridge.faults import _python as _faults_py

    compiled = pytest.importorskip("bridge.faults._c")
    try:
        if compiled._type_by_offset(by_offset) is not by_offset:
            pytest.skip("the small ints' layout is not the one relied on")
        rng = random.Random(11)
        faults = {rank: rng.choice((0, 1, 2)) for rank in rng.sample(range(100_000), 5000)}
        for call in ("format_faults", "merge_faults"):
            assert getattr(compiled, call)(faults) == getattr(_faults_py, call)(faults)
        assert compiled.merge_faults(faults) is not faults
        assert compiled.encode_process_fault_request("j", faults) == _faults_py.encode_process_fault_request("j", faults)
        for value in (-1, 3, True, False, IntSubclass(1), 1.0, 2**40):
            odd = {**faults, 77: value}
            for call in ("format_faults", "merge_faults", "encode_process_fault_request"):
                args = ("j", odd) if call.startswith("encode") else (odd,)
                expected = outcome_of(lambda: getattr(_faults_py, call)(*args))
                assert outcome_of(lambda: getattr(compiled, call)(*args)) == expected, (call, value)
            target: dict[int, int] = {}
            expected = outcome_of(lambda: _faults_py.merge_faults_into({}, odd))
            assert outcome_of(lambda: compiled.merge_faults_into(target, odd)) == expected
    finally:
        compiled._type_by_offset()


def outcome_of(call: Callable[[], object]) -> tuple[str, object]:
    """("ok", result) or (exception type name, message)."""
    try:
        return "ok", call()
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)


def _faults_py_format(faults: dict[int, int]) -> str:
    return ",".join(f"{r}:{t}" for r, t in sorted(faults.items()))


def test_the_duplicate_rule_on_clusterd_strings_keeps_unknown_types_sticky() -> None:
    from bridge.faults._python import _merge_into

    kept: dict[str, str] = {}
    for rank_text, type_text in (("1", "0"), ("1", "2"), ("2", "7"), ("2", "0"), ("3", "1"), ("3", "2")):
        _merge_into(kept, rank_text, type_text)
    assert kept == {"1": "2", "2": "7", "3": "1"}


@pytest.mark.parametrize(("text", "value"), [
    ("0", 0), ("+7", 7), ("-7", -7), ("007", 7), (str(2**63 - 1), 2**63 - 1), (str(-(2**63)), -(2**63)),
    (str(2**63), None), ("", None), ("+", None), (" 1", None), ("1 ", None), ("\u0661", None), ("1_0", None),
])
def test_go_atoi(text: str, value: int | None) -> None:
    from bridge.faults._python import go_atoi

    assert go_atoi(text) == value


def test_clusterd_elements_trims_go_space_then_commas_from_the_whole_string_only() -> None:
    from bridge.faults._python import GO_SPACE, clusterd_elements

    assert clusterd_elements("\u3000,1:0, 2:1,\u00a0") == ["1:0", " 2:1"]
    assert clusterd_elements(GO_SPACE + ",," + GO_SPACE) == []
    assert clusterd_elements("") == []


def test_merge_into_ranks_above_two_to_the_thirty(codec: ModuleType) -> None:
    """CPython >= 3.12 stores these in two digits, off the compiled fast path."""
    big = {2**31 - 1: 0, 2**30: 1, 2**30 - 1: 2}
    target: dict[int, int] = {2**31 - 1: 1}
    assert codec.merge_faults_into(target, big) == {2**31 - 1: 1, 2**30: 1, 2**30 - 1: 2}
    assert codec.merge_faults_into({}, big, {2**30: 0}) == codec.merge_faults(big, {2**30: 0})


@pytest.fixture(params=["tables in place", "PyDict_Next"])
def walk(request: pytest.FixtureRequest, codec: ModuleType) -> Iterator[str]:
    """The compiled codec reads dict entry tables in place where it trusts CPython's
    layout, and walks with PyDict_Next elsewhere: both ways, for the compiled twin."""
    if request.param == "PyDict_Next":
        if not hasattr(codec, "_trust_entry_tables"):
            pytest.skip("the Python twin has one way")
        codec._trust_entry_tables(False)
    try:
        yield request.param
    finally:
        if hasattr(codec, "_trust_entry_tables"):
            codec._trust_entry_tables()


@pytest.mark.parametrize("late", [IntLike(7), 2**30 + 5, True, "9"])
def test_an_entry_off_the_fast_path_late_in_a_large_map(codec: ModuleType, walk: str, late: object) -> None:
    """Hundreds of exact ranks, then one key that is an int-like, a two-digit int on
    CPython >= 3.12, or bad: every operation's result or error is the one it gives for
    the same entries in a small map, however far into the map the entry comes."""
    head = {r * 7919 % 100_003: r % 3 for r in range(1, 400)}
    faults = {**head, late: 1, 5: 2}
    rank = late.value if isinstance(late, IntLike) else late
    if type(rank) is not int:
        for call in (lambda: codec.format_faults(faults), lambda: codec.merge_faults(faults),
                     lambda: codec.merge_faults(head, faults), lambda: codec.merge_faults_into({}, head, faults),
                     lambda: codec.encode_process_fault_request("j", faults)):
            with pytest.raises(TypeError, match=re.escape(f"fault map key {late!r}")):
                call()
        return
    expected = {**head, rank: 1, 5: 2}
    assert codec.merge_faults(faults) == expected
    assert codec.merge_faults(head, faults, {rank: 0}) == expected  # a stored 1 stays
    target = {5: 1}
    assert codec.merge_faults_into(target, head, faults) is target
    assert target == {**expected, 5: 1}
    assert codec.format_faults(faults) == ",".join(f"{r}:{t}" for r, t in sorted(expected.items()))
    request = pb.ProcessFaultRequest(jobId="j", faultRanks=ranks_msg(expected))
    assert codec.encode_process_fault_request("j", faults) == request.SerializeToString()


def test_large_maps_with_deleted_entries_agree_with_the_reference(codec: ModuleType, walk: str) -> None:
    """Thousands of ranks in a map that had entries deleted (holes in its entry table),
    merged, formatted and encoded exactly as the reference does."""
    from bridge.faults import _python as _faults_py

    faults = {r * 7919 % 1_000_003: r % 3 for r in range(3000)}
    for r in range(0, 3000, 5):
        del faults[r * 7919 % 1_000_003]
    other = {r * 7919 % 1_000_003: (r + 1) % 3 for r in range(1000, 5000)}
    assert codec.merge_faults(faults, other) == _faults_py.merge_faults(faults, other)
    assert list(codec.merge_faults(faults, other)) == list(_faults_py.merge_faults(faults, other))
    assert codec.merge_faults_into(dict(other), faults) == _faults_py.merge_faults_into(dict(other), faults)
    assert codec.format_faults(faults) == _faults_py.format_faults(faults)
    assert codec.encode_process_fault_request("j", faults) == _faults_py.encode_process_fault_request("j", faults)
