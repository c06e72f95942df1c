"""The outbox's in-place merge gives exactly ClusterD's merge, on both of its paths."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bridge import faults as codec
from bridge.relay import merge_into

maps = st.dictionaries(st.integers(0, 200), st.sampled_from([0, 1, 2]), max_size=60)


@given(maps, maps)
def test_merge_into_equals_merge_faults(target: dict[int, int], faults: dict[int, int]) -> None:
    expected = codec.merge_faults(target, faults)
    assert merge_into(dict(target), faults) == expected


def test_small_updates_are_in_place() -> None:
    target = {rank: 0 for rank in range(100)}
    assert merge_into(target, {5: 1, 500: 2}) is target
    assert target[5] == 1 and target[500] == 2
    assert merge_into(target, {5: 0})[5] == 1  # type 1 stays sticky
