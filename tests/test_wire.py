"""A routing slice's strided runs (``apply.wire``, protocol 4): a worker expands each into
the ranges it stands for, exactly, and refuses a malformed or oversized run before it
makes a single range."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake_rl.apply import wire
from mooncake_rl.apply.executor import PushOp, ReadOp
from mooncake_rl.apply.wire import decode_slice
from mooncake_rl.errors import InvariantViolation


def sliced(reads: list[Any], pushes: list[Any] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    return {"regions": {"r": 1 << 20}, "stages": [[{"reads": reads, "pushes": list(pushes)}]]}


@given(
    src=st.integers(0, 1 << 40),
    dst=st.integers(0, 1 << 20),
    length=st.integers(1, 64),
    count=st.integers(1, 50),
    src_gap=st.integers(0, 64),
    dst_gap=st.integers(0, 64),
)
def test_a_strided_run_is_the_ranges_it_stands_for(
    src: int, dst: int, length: int, count: int, src_gap: int, dst_gap: int
) -> None:
    run = (count, length + src_gap, length + dst_gap)
    decoded = decode_slice(
        sliced([("k", src, "r", dst, length, *run)], [("w1", "r", src, "s", dst, length, *run)])
    )
    (batch,) = decoded.stages[0]
    ranges = [(src + k * run[1], dst + k * run[2]) for k in range(count)]
    assert batch.reads == tuple(ReadOp("k", s, "r", d, length) for s, d in ranges)
    assert batch.pushes == tuple(PushOp("w1", "r", s, "s", d, length) for s, d in ranges)


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        (("k", 0, "r", 0, 8, 0, 8, 8), "needs at least one range"),
        (("k", 0, "r", 0, 8, 2, 4, 8), "strides of at least the length"),
        (("k", 0, "r", 0, 8, 2, 8, 7), "strides of at least the length"),
        (("k", 0, "r", 0, 8, 2, 8), "appends \\[count, src_stride, dst_stride\\]"),
        (("k", 0, "r", 0, 8, 2, 8, 8, 1), "appends \\[count, src_stride, dst_stride\\]"),
        (("k", 0, "r", 0, 8, -2, 8, 8), "non-negative integers"),
        (("k", 0, "r", 0, 8, 2.0, 8, 8), "non-negative integers"),
    ],
)
def test_a_malformed_run_is_refused_by_name(row: tuple[Any, ...], problem: str) -> None:
    with pytest.raises(InvariantViolation, match=problem):
        decode_slice(sliced([row]))


def test_a_slice_that_expands_past_the_bound_is_refused_before_any_range_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hostile count (say 2**62) must not make the worker build ranges until it runs out
    of memory: the bound is checked on the counts alone."""
    made: list[int] = []
    real = wire._ranges
    monkeypatch.setattr(wire, "_ranges", lambda *a: made.append(1) or real(*a))
    with pytest.raises(InvariantViolation, match=f"over {wire.MAX_RANGES} ranges"):
        decode_slice(sliced([("k", 0, "r", 0, 1, 1 << 62, 1, 1)]))
    assert made == []
    monkeypatch.setattr(wire, "MAX_RANGES", 5)
    runs = [("k", 0, "r", 0, 1, 3, 1, 1), ("k", 3, "r", 3, 1, 3, 1, 1)]
    with pytest.raises(InvariantViolation, match="over 5 ranges"):
        decode_slice(sliced(runs))
    assert len(decode_slice(sliced(runs[:1])).stages[0][0].reads) == 3
