"""The fault-map codec's reference implementation.

A fault map is ``{global rank: fault type}``: 0 UCE (retryable), 1 any other fault, 2 HCCL
(retryable). It travels as Python dicts (the controller), ``"rank:type,..."`` strings
(PodGroup annotations) and repeated ``FaultRank{rankId, faultType}`` messages (decimal
strings). ``ext/_faults_c.pyx`` implements the same functions with the same results and
exceptions (one test suite runs both) and reuses ``clusterd_parse`` and the ``*_error``
helpers here, so an error reads the same from either. ClusterD's rules live here once:
its duplicate rule (``_REPLACEABLE``, ``_merge_into``), Go's ``strings.TrimSpace`` set
(``GO_SPACE``, ``clusterd_elements``) and ``strconv.Atoi`` (``go_atoi``), and this codec's
stricter rank text (ASCII digits up to ``MAX_RANK``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

MAX_RANK = 2**31 - 1
FAULT_TYPES = (0, 1, 2)
_TYPE_TEXT = ("0", "1", "2")
_TYPE_OF_TEXT = {text: fault_type for fault_type, text in enumerate(_TYPE_TEXT)}
_DIGITS = frozenset("0123456789")


class LenientParse(NamedTuple):
    """What ClusterD makes of an annotation string (``parse_faults(..., strict=False)``).

    ``dropped``: elements ClusterD drops with "bad fault format" (not exactly one ``:``).
    ``rejected``: elements ClusterD keeps as strings but that are not a fault this codec
    can represent (type other than 0/1/2, rank out of range).
    ``poisoned``: a kept rank is not an integer (``" 2"`` from ``"4:1, 2:1"``): ClusterD's
    conversion of the whole list then fails and its cycle runs with **no ranks at all**,
    so ``faults`` is empty.
    """

    faults: dict[int, int]
    dropped: tuple[str, ...]
    rejected: tuple[str, ...]
    poisoned: bool


# --------------------------------------------------------------------------- validation


def rank_error(key: object) -> Exception:
    """The exception for a fault-map key that is not a rank."""
    if isinstance(key, bool) or not _has_index(key):
        return TypeError(f"fault map key {key!r}: rank must be an int, not {type(key).__name__}")
    return ValueError(f"fault map key {key!r}: rank must be in 0..{MAX_RANK}")


def type_error(key: object, value: object) -> Exception:
    """The exception for a fault-map value that is not a fault type."""
    if isinstance(value, bool) or not _has_index(value):
        return TypeError(
            f"fault map key {key!r}: fault type {value!r} must be an int, not {type(value).__name__}"
        )
    return ValueError(f"fault map key {key!r}: fault type {value!r} must be 0, 1 or 2")


def not_a_map_error(faults: object) -> TypeError:
    return TypeError(f"a fault map must be a mapping of rank to fault type, not {type(faults).__name__}")


def not_a_string_error(text: object) -> TypeError:
    return TypeError(f"a fault string must be str, not {type(text).__name__}")


def _has_index(obj: object) -> bool:
    return hasattr(type(obj), "__index__")


def _checked(key: object, value: object) -> tuple[int, int]:
    """Validate one entry; int-likes (``operator.index``) are accepted, ``bool`` is not."""
    if isinstance(key, bool) or not _has_index(key):
        raise rank_error(key)
    rank = operator.index(key)  # type: ignore[arg-type]
    if not 0 <= rank <= MAX_RANK:
        raise rank_error(key)
    if isinstance(value, bool) or not _has_index(value):
        raise type_error(key, value)
    fault_type = operator.index(value)  # type: ignore[arg-type]
    if fault_type not in FAULT_TYPES:
        raise type_error(key, value)
    return rank, fault_type


def _items(faults: Mapping[Any, Any]) -> Iterable[tuple[int, int]]:
    if not isinstance(faults, Mapping):
        raise not_a_map_error(faults)
    for key, value in faults.items():
        yield _checked(key, value)


#: ClusterD's duplicate rule: a later fault replaces the stored one only while the stored
#: type is retryable (0 UCE, 2 HCCL); a stored 1 is sticky. ClusterD compares the type
#: *strings* before converting them (so an unknown type string is sticky too); this codec
#: stores ints: the set holds both forms of the same two types.
_REPLACEABLE_TYPES = frozenset({0, 2})
_REPLACEABLE: frozenset[object] = _REPLACEABLE_TYPES | {str(t) for t in _REPLACEABLE_TYPES}


def _merge_into(merged: dict[Any, Any], key: Any, fault_type: Any) -> None:
    """Store ``fault_type`` for ``key`` under ClusterD's duplicate rule (an absent key
    takes it like a replaceable one). Works on int maps and on ClusterD's string pairs."""
    if merged.get(key, 0) in _REPLACEABLE:
        merged[key] = fault_type


def _is_digits(text: str) -> bool:
    """Non-empty ASCII decimal digits (``str.isdigit`` also accepts other scripts' digits)."""
    return bool(text) and _DIGITS.issuperset(text)


def _rank_or_none(text: str) -> int | None:
    """The rank written as ``text`` in the form this codec writes: ASCII digits, at most
    ``MAX_RANK``; None otherwise."""
    if not _is_digits(text):
        return None
    rank = int(text)
    return rank if rank <= MAX_RANK else None


# --------------------------------------------------------------------------- strings


def format_faults(faults: Mapping[int, int]) -> str:
    """The canonical ``"rank:type"`` string: ascending ranks, no spaces, ``""`` when empty.

    It always matches ``^\\d+:[012](,\\d+:[012])*$``, the only form ClusterD parses safely.
    """
    merged: dict[int, int] = {}
    for rank, fault_type in _items(faults):
        _merge_into(merged, rank, fault_type)
    return ",".join(f"{rank}:{merged[rank]}" for rank in sorted(merged))


def strict_error(text: str) -> ValueError:
    """The error for the first element of ``text`` that breaks the canonical form."""
    offset = 0
    for index, element in enumerate(text.split(",")):
        reason = _element_problem(element)
        if reason:
            return ValueError(
                f"fault string element {index} {element!r} at offset {offset}: {reason}"
            )
        offset += len(element) + 1
    return ValueError(f"fault string {text!r} is not in canonical form")  # pragma: no cover


def _element_problem(element: str) -> str:
    if not element:
        return "empty element"
    rank_text, colon, type_text = element.partition(":")
    if not colon:
        return "missing ':' between rank and fault type"
    if not _is_digits(rank_text):
        return "rank must be ASCII decimal digits"
    if type_text not in _TYPE_TEXT:
        return "fault type must be 0, 1 or 2"
    if _rank_or_none(rank_text) is None:
        return f"rank exceeds {MAX_RANK}"
    return ""


def parse_faults(text: str, *, strict: bool = True) -> Any:
    """Parse a ``"rank:type,..."`` string.

    ``strict=True`` (the default) returns ``dict[int, int]`` and accepts exactly the
    canonical grammar ``^\\d+:[012](,\\d+:[012])*$`` (ASCII digits, ranks up to 2**31-1);
    anything else raises ``ValueError`` naming the first offending element, its index and
    its character offset. A rank given twice follows ClusterD's merge rule.

    ``strict=False`` returns a :class:`LenientParse`: exactly what ClusterD's own parser
    makes of the string, plus what it dropped, so callers can count bad input.
    """
    if not isinstance(text, str):
        raise not_a_string_error(text)
    if not strict:
        return clusterd_parse(text)
    faults: dict[int, int] = {}
    if not text:
        return faults
    for element in text.split(","):
        rank_text, colon, type_text = element.partition(":")
        rank = _rank_or_none(rank_text)
        fault_type = _TYPE_OF_TEXT.get(type_text)
        if rank is None or fault_type is None or not colon:
            raise strict_error(text)
        _merge_into(faults, rank, fault_type)
    return faults


def clusterd_parse(text: str) -> LenientParse:
    """ClusterD's String2Faults + RemoveSliceDuplicateFaults + integer conversion.

    Whitespace and then commas are trimmed from the whole string only; elements are
    split on ``,`` then ``:`` and must have exactly two parts, or they are dropped.
    Elements are neither trimmed nor validated. Duplicates: the first occurrence fixes
    the entry and a later one replaces it only while the stored type is "0" or "2".
    Ranks are then converted as one list (Go ``strconv.Atoi``): one failure empties it.
    """
    dropped: list[str] = []
    kept: dict[str, str] = {}
    for element in clusterd_elements(text):
        parts = element.split(":")
        if len(parts) != 2:
            dropped.append(element)
            continue
        _merge_into(kept, parts[0], parts[1])
    ranks = {rank_text: go_atoi(rank_text) for rank_text in kept}
    if any(rank is None for rank in ranks.values()):
        return LenientParse({}, tuple(dropped), (), True)
    faults: dict[int, int] = {}
    rejected: list[str] = []
    for rank_text, type_text in kept.items():
        rank = ranks[rank_text]
        assert rank is not None
        if type_text in _TYPE_TEXT and 0 <= rank <= MAX_RANK:
            _merge_into(faults, rank, int(type_text))
        else:
            rejected.append(f"{rank_text}:{type_text}")
    return LenientParse(faults, tuple(dropped), tuple(rejected), False)


#: Go's ``strings.TrimSpace`` set (``unicode.IsSpace``), which ClusterD applies to a whole
#: annotation string (never to its elements).
GO_SPACE = (
    "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)


def clusterd_elements(text: str) -> list[str]:
    """ClusterD's String2Faults split: Go white space and then commas trimmed from the
    whole string, the rest split on ``,``; elements are not trimmed. ``[]`` when empty."""
    if not isinstance(text, str):
        raise not_a_string_error(text)
    body = text.strip(GO_SPACE).strip(",")
    return body.split(",") if body else []


def go_atoi(text: str) -> int | None:
    """``strconv.Atoi`` on 64-bit: optional sign, ASCII digits, int64 range; else None."""
    digits = text[1:] if text[:1] in ("+", "-") else text
    if not _is_digits(digits):
        return None
    value = int(text)
    if not -(2**63) <= value < 2**63:
        return None
    return value


def merge_faults(*maps: Mapping[int, int]) -> dict[int, int]:
    """Merge fault maps in order with ClusterD's rule: type 1 is sticky; between 0 and 2
    the later one wins. Every entry is validated like ``format_faults``'s input."""
    merged: dict[int, int] = {}
    for faults in maps:
        for rank, fault_type in _items(faults):
            _merge_into(merged, rank, fault_type)
    return merged


def merge_faults_into(target: dict[int, int], *maps: Mapping[int, int]) -> dict[int, int]:
    """``merge_faults(target, *maps)`` written into ``target`` itself, which is returned.

    In place, so that a storm of one-rank reports merged into one queued report costs
    O(1) each, not a copy of everything merged so far. ``target`` must hold valid
    entries (it is not re-checked); ``maps`` are validated first, and an invalid entry
    raises before ``target`` is touched.
    """
    if not isinstance(target, dict):
        raise TypeError(f"the merge target must be a dict, not {type(target).__name__}")
    checked = [list(_items(faults)) for faults in maps]
    for items in checked:
        for rank, fault_type in items:
            _merge_into(target, rank, fault_type)
    return target


# --------------------------------------------------------------------------- protobuf wire

_LEN = 2  # wire type of strings, bytes and sub-messages


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int32/int64 negatives are sign-extended to ten bytes
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | _LEN) + _varint(len(payload)) + payload


def _string_field(number: int, text: str) -> bytes:
    """A proto3 string field; the empty string is the default and is not written."""
    return _field(number, text.encode()) if text else b""


def _fault_rank(rank: int, fault_type: int) -> bytes:
    return _string_field(1, str(rank)) + _string_field(2, _TYPE_TEXT[fault_type])


def encode_fault_ranks(faults: Mapping[int, int], field_number: int) -> bytes:
    """The repeated ``FaultRank`` field ``field_number`` as serialized bytes, one entry per
    map item in the map's order (what the generated classes produce when the entries are
    appended in that order)."""
    if not isinstance(field_number, int) or not 1 <= field_number < 2**29:
        raise ValueError(f"field number {field_number!r} must be in 1..{2**29 - 1}")
    return b"".join(_field(field_number, _fault_rank(r, t)) for r, t in _items(faults))


def _status_field(code: int, info: str) -> bytes:
    """``Status`` as field 2, always present: ClusterD dereferences it unconditionally
    (a request without it crashes the whole server)."""
    code = operator.index(code)
    _require_str(info)
    if not -(2**31) <= code < 2**31:
        raise ValueError(f"status code {code} does not fit int32")
    body = (_varint(1 << 3) + _varint(code) if code else b"") + _string_field(2, info)
    return _field(2, body)


def _strings(number: int, values: Iterable[str]) -> bytes:
    """A repeated string field: every element is written, empty ones too."""
    if isinstance(values, str):
        raise TypeError("expected a sequence of str, got a single str")
    return b"".join(_field(number, _require_str(v).encode()) for v in values)


def _require_str(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected str, got {type(value).__name__}")
    return value


def encode_process_fault_request(job_id: str, faults: Mapping[int, int]) -> bytes:
    """``ProcessFaultRequest{jobId, faultRanks}``."""
    return _string_field(1, _require_str(job_id)) + encode_fault_ranks(faults, 2)


def encode_stop_complete_request(
    job_id: str, code: int, info: str, faults: Mapping[int, int]
) -> bytes:
    """``StopCompleteRequest{jobId, status, faultRanks}`` with ``status`` always set."""
    return (
        _string_field(1, _require_str(job_id))
        + _status_field(code, info)
        + encode_fault_ranks(faults, 3)
    )


def encode_recover_strategy_request(
    job_id: str, faults: Mapping[int, int], strategies: Iterable[str]
) -> bytes:
    """``RecoverStrategyRequest{jobId, faultRanks, strategies}``."""
    return (
        _string_field(1, _require_str(job_id))
        + encode_fault_ranks(faults, 2)
        + _strings(3, strategies)
    )


def encode_recover_status_request(
    job_id: str, code: int, info: str, strategy: str, isolate_rank_ids: Iterable[str] = ()
) -> bytes:
    """``RecoverStatusRequest{jobId, status, strategy, isolateRankIds}``, status always set."""
    return (
        _string_field(1, _require_str(job_id))
        + _status_field(code, info)
        + _string_field(3, _require_str(strategy))
        + _strings(4, isolate_rank_ids)
    )


# --------------------------------------------------------------------------- decoding


def signal_fault_error(index: int, rank_id: str, fault_type: str) -> ValueError:
    return ValueError(
        f"signal fault entry {index} (rankId={rank_id!r}, faultType={fault_type!r}): "
        "rankId must be ASCII decimal digits up to 2147483647 and faultType 0, 1 or 2"
    )


def truncated_error(offset: int) -> ValueError:
    return ValueError(f"malformed protobuf at byte {offset}: truncated or invalid field")


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise truncated_error(pos)
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _skip(data: bytes, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _read_varint(data, pos)[1]
    if wire_type == 1:
        end = pos + 8
    elif wire_type == 2:
        length, pos = _read_varint(data, pos)
        end = pos + length
    elif wire_type == 5:
        end = pos + 4
    else:
        raise truncated_error(pos)
    if end > len(data):
        raise truncated_error(pos)
    return end


def _fields(data: bytes) -> Iterable[tuple[int, int, int, int]]:
    """(field number, wire type, payload start, payload end) for each top-level field."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise truncated_error(pos)
        if wire_type == _LEN:
            length, start = _read_varint(data, pos)
            pos = start + length
            if pos > len(data):
                raise truncated_error(start)
            yield number, wire_type, start, pos
        else:
            start = pos
            pos = _skip(data, pos, wire_type)
            yield number, wire_type, start, pos


def decode_signal_faults(data: bytes) -> dict[int, int]:
    """The ``faultRanks`` (field 5) of a serialized ``ProcessManageSignal``.

    Each entry must carry a decimal rank and a type 0/1/2, else ``ValueError`` naming the
    entry; a rank listed twice follows ClusterD's merge rule.
    """
    data = bytes(data)
    faults: dict[int, int] = {}
    index = 0
    for number, wire_type, start, end in _fields(data):
        if number != 5 or wire_type != _LEN:
            continue
        rank_id = fault_type = ""
        for sub_number, sub_wire, sub_start, sub_end in _fields(data[start:end]):
            if sub_wire != _LEN or sub_number not in (1, 2):
                continue
            try:
                text = data[start + sub_start : start + sub_end].decode()
            except UnicodeDecodeError:
                text = repr(data[start + sub_start : start + sub_end])
            if sub_number == 1:
                rank_id = text
            else:
                fault_type = text
        rank = _rank_or_none(rank_id)
        if rank is None or fault_type not in _TYPE_TEXT:
            raise signal_fault_error(index, rank_id, fault_type)
        _merge_into(faults, rank, int(fault_type))
        index += 1
    return faults
