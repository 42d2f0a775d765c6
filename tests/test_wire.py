"""A routing slice on the wire (``apply.wire``): a worker expands each strided run
(protocol 4) into the ranges it stands for, exactly, and refuses a malformed or oversized
run before it makes a single range; every string is an index into the slice's ``names``
(protocol 5), and an index that names nothing is refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake_rl.apply import wire
from mooncake_rl.apply.executor import Batch, PushOp, ReadOp
from mooncake_rl.apply.wire import WorkerSlice, decode_slice, encode_slice
from mooncake_rl.errors import InvariantViolation

NAMES = ["r", "k", "w1", "s"]


def sliced(reads: list[Any], pushes: list[Any] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    """A one-batch slice of ``reads`` and ``pushes`` written with their strings, sent as
    indices into ``NAMES``."""

    def indexed(row: tuple[Any, ...], strings: tuple[int, ...]) -> tuple[Any, ...]:
        return tuple(NAMES.index(v) if i in strings else v for i, v in enumerate(row))

    batch = {
        "reads": [indexed(row, (0, 2)) for row in reads],
        "pushes": [indexed(row, (0, 1, 3)) for row in pushes],
    }
    return {"names": NAMES, "regions": [(0, 1 << 20)], "stages": [[batch]]}


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


def test_every_string_is_its_index_in_the_slice_names() -> None:
    """What the executor gets back is what was encoded, each name spelled once on the wire."""
    reads = (ReadOp("k", 0, "r", 0, 8), ReadOp("k", 8, "r2", 0, 8))
    pushes = (PushOp("w1", "r", 0, "r", 0, 8), PushOp("w2", "r2", 0, "r", 8, 8))
    worker_slice = WorkerSlice(
        {"r": 16, "r2": 8}, ((Batch(reads, pushes),), ()), region_dtypes={"r2": "bfloat16"}
    )
    raw = encode_slice(worker_slice)
    assert raw["names"] == ["r", "r2", "bfloat16", "k", "w1", "w2"]
    assert raw["regions"] == [(0, 16), (1, 8, 2)]
    assert raw["stages"][0][0]["pushes"][1] == (5, 1, 0, 0, 8, 8)
    assert decode_slice(raw) == worker_slice
    with pytest.raises(InvariantViolation, match="gives a dtype for 'r3', not a region"):
        WorkerSlice({"r": 16}, (), region_dtypes={"r3": "bfloat16"})


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda raw: raw["stages"][0][0]["reads"].append((4, 0, 0, 0, 8)), "name index 4 is not"),
        (lambda raw: raw["stages"][0][0]["reads"].append((-1, 0, 0, 0, 8)), "name index -1"),
        (lambda raw: raw["stages"][0][0]["pushes"].append((2, 0, 0, "r", 0, 8)), "index 'r'"),
        (lambda raw: raw["regions"].append((True, 8)), "name index True"),
        (lambda raw: raw["regions"].append((0, 8)), "gives region 'r' twice"),
        (lambda raw: raw["regions"].append((1, 8, 0, 0)), "region 'k': \\[name, bytes"),
        (lambda raw: raw["regions"].append((1, 8, 9)), "name index 9 is not"),
        (lambda raw: raw.update(names=[*NAMES, ""]), "list of non-empty strings"),
        (lambda raw: raw.update(names={"0": "r"}), "list of non-empty strings"),
        (lambda raw: raw.pop("names"), "malformed routing slice: 'names'"),
        (lambda raw: raw.update(checksums=[(7, 8, "0" * 32, [])]), "name index 7 is not"),
        (
            lambda raw: raw.update(checksums=[(1, 8, "0" * 32, []), (1, 8, "0" * 32, [])]),
            "gives the checksum of 'k' twice",
        ),
    ],
)
def test_a_name_index_that_names_nothing_is_refused_by_name(
    change: Callable[[dict[str, Any]], Any], problem: str
) -> None:
    raw = sliced([("k", 0, "r", 0, 8)])
    change(raw)
    with pytest.raises(InvariantViolation, match=problem):
        decode_slice(raw)
