"""The broadcast group's rank cursor: world size and SGLang-style rank offsets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.transport import GroupLayout, TopologyError, broadcast_group

A, B, C = "http://a:30000", "http://b:30000", "http://c:30000"


def test_one_gpu_per_engine() -> None:
    layout = broadcast_group([B, C], 1, [A, B, C])
    assert layout == GroupLayout(world_size=3, per_engine=1, offsets={B: 1, C: 2})


def test_two_gpus_per_engine() -> None:
    """Engine TP rank r joins as rank_offset + r: B takes ranks 1-2, A takes 3-4."""
    layout = broadcast_group([B, A], 2, [A, B, C])
    assert layout.world_size == 5
    assert list(layout.offsets.items()) == [(B, 1), (A, 3)]


@given(st.integers(1, 8), st.integers(1, 16))
def test_ranks_tile_the_group_exactly(per_engine: int, engines: int) -> None:
    urls = [f"http://e{i}" for i in range(engines)]
    layout = broadcast_group(urls, per_engine, urls)
    ranks = [o + r for o in layout.offsets.values() for r in range(per_engine)]
    assert [0, *ranks] == list(range(layout.world_size))


def test_empty_broadcast_set_is_refused() -> None:
    with pytest.raises(TopologyError, match="no engine to broadcast to"):
        broadcast_group([], 1, [A])


@pytest.mark.parametrize("per_engine", [0, -1, 1.0])
def test_per_engine_must_be_a_positive_count(per_engine: int) -> None:
    with pytest.raises(
        TopologyError, match=f"per_engine must be a GPU count >= 1, got {per_engine}"
    ):
        broadcast_group([A], per_engine, [A])


def test_broadcast_set_must_be_a_subset_of_the_targets() -> None:
    with pytest.raises(TopologyError) as raised:
        broadcast_group([A, C, B], 1, [A])
    assert f"not targets of this update: {C}, {B}" in str(raised.value)


def test_an_engine_listed_twice_is_refused() -> None:
    with pytest.raises(TopologyError, match=f"more than once: {A}"):
        broadcast_group([A, B, A], 1, [A, B])


@pytest.mark.parametrize(
    ("world_size", "per_engine", "offsets"),
    [
        (1, 1, {}),
        (3, 0, {A: 1, B: 1}),
        (3, 1, {A: 2, B: 1}),
        (5, 2, {A: 1, B: 2}),
        (4, 1, {A: 1, B: 2}),
    ],
)
def test_inconsistent_layouts_are_refused(
    world_size: int, per_engine: int, offsets: dict[str, int]
) -> None:
    with pytest.raises(InvariantViolation):
        GroupLayout(world_size, per_engine, offsets)
