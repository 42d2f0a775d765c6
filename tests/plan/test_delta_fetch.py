"""The planned fetch of delta entries (``mooncake_rl.plan.delta``): every entry read from the
Store once, by a worker that needs it, and delivered exactly once to every other worker that
needs it, at the place its own buffer layout gives; readers spread over nodes."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rl.apply.coalesce import coalesced_reads, coalesced_writes
from mooncake_rl.engine import Write
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.chain import DeltaTable, ObjectDelta, delta_key
from mooncake_rl.plan.delta import (
    DELTA_REGION,
    RUN_BYTES,
    DeltaDemand,
    EntryBlock,
    entry_blocks,
    entry_offsets,
    plan_delta_fetch,
)
from mooncake_rl.store import RangeRead


def _table(sizes: list[int]) -> DeltaTable:
    """One object per size, each of two blocks (cut in the middle), entries of 10 and 7."""
    return DeltaTable(
        2,
        1,
        {
            f"g/payload/obj{i}": ObjectDelta(n, (10, 17), ("0" * 16, "0" * 16), (n // 2,))
            for i, n in enumerate(sizes)
        },
    )


@st.composite
def demands(draw: st.DrawFn) -> tuple[DeltaDemand, list[EntryBlock]]:
    universe = []
    for o in range(draw(st.integers(1, 4))):
        lengths = draw(st.lists(st.integers(1, 300), min_size=1, max_size=5))
        ends = entry_offsets([EntryBlock("x", 0, 0, n) for n in lengths])
        universe += [
            EntryBlock(f"g/payload/obj{o}", b, start, end)
            for b, (start, end) in enumerate(itertools.pairwise(ends))
        ]
    workers = draw(st.integers(1, 6))
    nodes = {f"w{i}": f"node{draw(st.integers(0, 2))}" for i in range(workers)}
    blocks = {
        w: tuple(sorted(set(draw(st.lists(st.sampled_from(universe), max_size=len(universe))))))
        for w in nodes
    }
    return DeltaDemand(nodes, blocks), universe


@settings(max_examples=150, deadline=None)
@given(demands(), st.integers(1, 800))
def test_every_entry_is_read_once_and_lands_once_where_each_buffer_wants_it(
    drawn: tuple[DeltaDemand, list[EntryBlock]], batch_bytes: int
) -> None:
    demand, _ = drawn
    slices = plan_delta_fetch(demand, batch_bytes)
    assert sorted(slices) == sorted(demand.blocks)
    reads: Counter[tuple[str, int, int]] = Counter()
    landed: dict[str, list[tuple[int, int]]] = defaultdict(list)  # worker -> (offset, length)
    for worker, found in slices.items():
        layout = demand.blocks[worker]
        size = entry_offsets(layout)[-1]
        assert dict(found.regions) == {DELTA_REGION: max(size, 1)}
        assert len(found.stages) == 1
        at = dict(zip(entry_offsets(layout)[:-1], layout, strict=True))
        for batch in found.stages[0]:
            # A batch reads at most batch_bytes, unless one entry alone is larger.
            assert len(batch.reads) == 1 or batch.staging_bytes <= batch_bytes
            read_here = {(r.dst_offset, r.length) for r in batch.reads}
            for read in batch.reads:
                block = at[read.dst_offset]  # the entry its own layout puts there
                assert (read.key, read.src_offset, read.length) == (
                    delta_key(block.key),
                    block.start,
                    block.length,
                )
                reads[read.key, read.src_offset, read.length] += 1
                landed[worker].append((read.dst_offset, read.length))
            for push in batch.pushes:
                # What a batch pushes it read itself, in the same batch.
                assert (push.src_offset, push.length) in read_here
                assert push.peer != worker and push.dst_region == DELTA_REGION
                landed[push.peer].append((push.dst_offset, push.length))
    distinct = {b for blocks in demand.blocks.values() for b in blocks}
    assert sorted(reads) == sorted((delta_key(b.key), b.start, b.length) for b in distinct)
    assert set(reads.values()) <= {1}  # the Store serves each entry once
    for worker, layout in demand.blocks.items():
        expected = list(zip(entry_offsets(layout)[:-1], (b.length for b in layout), strict=True))
        assert sorted(landed[worker]) == expected  # every byte of its buffer, once


def test_readers_take_runs_and_spread_them_over_nodes() -> None:
    """Four engines on two nodes share every entry of one object: readers take runs of
    RUN_BYTES of consecutive entries (each run one read and, per peer, one write once
    merged), and each node reads half the bytes."""
    mib = 1 << 20
    blocks = tuple(EntryBlock("g/payload/obj", b, b * mib, (b + 1) * mib) for b in range(64))
    nodes = {"a0": "a", "a1": "a", "b0": "b", "b1": "b"}
    slices = plan_delta_fetch(DeltaDemand(nodes, dict.fromkeys(nodes, blocks)), 1 << 30)
    read = {w: s.read_bytes for w, s in slices.items()}
    assert read["a0"] + read["a1"] == read["b0"] + read["b1"] == 32 * mib
    assert sum(read.values()) == 64 * mib  # once
    for worker, found in slices.items():
        reads = [r for batch in found.stages[0] for r in batch.reads]
        ranges = coalesced_reads(
            [RangeRead(r.key, r.src_offset, r.dst_offset, r.length) for r in reads]
        )
        assert len(ranges) == len(reads) * mib // RUN_BYTES  # one range per run
        for peer in set(nodes) - {worker}:
            pushes = [p for batch in found.stages[0] for p in batch.pushes if p.peer == peer]
            writes = coalesced_writes(
                [Write(1 + p.src_offset, 1 + p.dst_offset, p.length) for p in pushes]
            )
            assert len(writes) == len(ranges)  # one write per run to every peer


def test_entry_blocks_are_the_blocks_a_read_touches() -> None:
    table = _table([100, 60])
    blocks = entry_blocks(
        table, [("g/payload/obj1", 0, 30), ("g/payload/obj0", 49, 2), ("g/payload/obj0", 60, 1)]
    )
    assert blocks == (
        EntryBlock("g/payload/obj0", 0, 0, 10),
        EntryBlock("g/payload/obj0", 1, 10, 17),
        EntryBlock("g/payload/obj1", 0, 0, 10),
    )
    assert entry_offsets(blocks) == [0, 10, 17, 27]


def test_a_demand_out_of_its_layout_order_or_without_a_node_is_refused() -> None:
    a, b = EntryBlock("g/payload/o", 0, 0, 5), EntryBlock("g/payload/o", 1, 5, 9)
    with pytest.raises(InvariantViolation, match="order"):
        DeltaDemand({"w": "n"}, {"w": (b, a)})
    with pytest.raises(InvariantViolation, match="node"):
        DeltaDemand({}, {"w": (a,)})
    with pytest.raises(InvariantViolation, match="non-empty"):
        EntryBlock("g/payload/o", 0, 5, 5)
    with pytest.raises(InvariantViolation, match="batch_bytes"):
        plan_delta_fetch(DeltaDemand({"w": "n"}, {"w": (a,)}), 0)
