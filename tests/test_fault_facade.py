"""The codec facade's in-place helpers: ``merge_into`` gives exactly ClusterD's merge on
both of its paths, and ``clean_faults`` keeps every valid entry of a bad fault map."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bridge import faults as codec

maps = st.dictionaries(st.integers(0, 200), st.sampled_from([0, 1, 2]), max_size=60)


@given(maps, maps)
def test_merge_into_equals_merge_faults(target: dict[int, int], faults: dict[int, int]) -> None:
    expected = codec.merge_faults(target, faults)
    assert codec.merge_into(dict(target), faults) == expected


def test_small_updates_are_in_place() -> None:
    target = {rank: 0 for rank in range(100)}
    assert codec.merge_into(target, {5: 1, 500: 2}) is target
    assert target[5] == 1 and target[500] == 2
    assert codec.merge_into(target, {5: 0})[5] == 1  # type 1 stays sticky


@given(maps)
def test_clean_faults_of_a_valid_map_is_the_map(faults: dict[int, int]) -> None:
    assert codec.clean_faults(faults) == (codec.merge_faults(faults), 0, "")


@pytest.mark.parametrize(("raw", "clean", "bad"), [
    ({1: 0, "x": 1, 3: 7, 4: 2}, {1: 0, 4: 2}, 2),  # a non-int rank and an unknown type go, the rest stays
    ({-1: 0, 2: 1}, {2: 1}, 1),
    ({True: 0, 5: 0}, {5: 0}, 1),  # a bool is not a rank
    ([(1, 0)], {}, 1),  # not a mapping at all: one bad input
    (None, {}, 1),
])
def test_clean_faults_leaves_out_only_the_bad_entries(raw: Any, clean: dict[int, int], bad: int) -> None:
    result = codec.clean_faults(raw)
    assert result.faults == clean
    assert result.bad == bad
    assert result.error  # the codec's message says what was wrong


def test_clean_faults_survives_a_mapping_whose_items_fail() -> None:
    class Broken:
        def items(self) -> list[tuple[int, int]]:
            raise RuntimeError("boom")

    result = codec.clean_faults(Broken())
    assert result.bad == 1 and "boom" in result.error
