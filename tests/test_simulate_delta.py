"""The simulator's delta scenario (issue 52): a block's expected entry against the real
encoder's bytes, the blocks a GPU's records touch against a byte-by-byte reference, the
planned fetch's reads and pushes against ``plan_delta_fetch`` itself (with the native
operations the executor coalesces them into), and a small planned scenario at change
rates 0 and 1."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from bench.simulate import (
    Cluster,
    DeltaBlocks,
    Scenario,
    delta_blocks,
    delta_traffic,
    expected_entry,
    gaps16_fits,
    simulate,
    touched_blocks,
)
from mooncake_rl.apply.coalesce import coalesced_reads, coalesced_writes
from mooncake_rl.apply.executor import PushOp
from mooncake_rl.engine import Write
from mooncake_rl.generations.checksums import BLOCK_BYTES, block_spans
from mooncake_rl.generations.delta import HEADER, WORDS, diff, encode
from mooncake_rl.plan import PlanParams
from mooncake_rl.plan.delta import DeltaDemand, EntryBlock, plan_delta_fetch
from mooncake_rl.plan.table import DEMAND_DTYPE
from mooncake_rl.store import RangeRead

MiB = 1 << 20


def _encoded(numel: int, itemsize: int, changed: int, seed: int) -> tuple[str, int]:
    """The real encoder's choice and entry bytes for ``changed`` elements at random places."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 1 << (8 * itemsize), numel, dtype=WORDS[itemsize])
    new = base.copy()
    new[rng.choice(numel, changed, replace=False)] ^= 1
    found = diff(base, new)
    return found.encoding, len(encode(found))


@given(
    itemsize=st.sampled_from([1, 2, 4]),
    numel=st.integers(1, 3000),
    share=st.floats(0, 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_small_blocks_entry_is_the_encoders_bytes(
    itemsize: int, numel: int, share: float, seed: int
) -> None:
    """Under 2**16 elements no gap can overflow 16 bits: given the changed count, the real
    encoder's bytes are deterministic, and the model's (rate = changed / numel) equal them."""
    changed = round(share * numel)
    _, nbytes = _encoded(numel, itemsize, changed, seed)
    assert math.isclose(expected_entry(numel, itemsize, changed / numel)[1], nbytes, abs_tol=1e-6)


@pytest.mark.parametrize(
    ("numel", "itemsize", "changed", "encoding"),
    [
        (BLOCK_BYTES, 1, 0, "gaps16"),  # a 4 MiB fp8 block unchanged: the header alone
        (BLOCK_BYTES, 1, 41_943, "gaps16"),  # 1 %
        (BLOCK_BYTES // 4, 4, 10_486, "gaps16"),  # 1 % of a float32 block
        (BLOCK_BYTES, 1, 419_430, "bitmask"),  # 10 %
        (BLOCK_BYTES // 2, 2, 1_887_437, "bitmask"),  # 90 % of a bf16 block
        (BLOCK_BYTES // 2, 2, 1_992_294, "whole"),  # 95 %
        (BLOCK_BYTES, 1, BLOCK_BYTES, "whole"),  # every element
        (MiB, 1, 4, "gaps32"),  # 4 changes in 1 Mi elements: some gap passes 2**16
    ],
)
def test_a_full_blocks_entry_and_encoding_are_the_encoders(
    numel: int, itemsize: int, changed: int, encoding: str
) -> None:
    modelled, nbytes = expected_entry(numel, itemsize, changed / numel)
    assert _encoded(numel, itemsize, changed, seed=52) == (modelled, round(nbytes))
    assert modelled == encoding and math.isclose(nbytes, round(nbytes), abs_tol=1e-6)


def test_gaps16_fits_small_blocks_always_and_large_ones_by_rate() -> None:
    assert gaps16_fits(1 << 16, 1e-9) and gaps16_fits(BLOCK_BYTES, 0.0)
    assert gaps16_fits(BLOCK_BYTES, 1e-3) and not gaps16_fits(BLOCK_BYTES, 1e-5)


def _demands(rows: list[tuple[int, int, int, int, int, int]]) -> np.ndarray:
    """(worker, object, src, length, count, stride) rows."""
    out = np.zeros(len(rows), DEMAND_DTYPE)
    for i, (worker, obj, src, length, count, stride) in enumerate(rows):
        out[i] = (worker, 1, 0, length, obj, src, stride, length, count)
    return out


@given(
    objects=st.lists(
        st.tuples(st.integers(1, 10 * MiB), st.lists(st.integers(1, 10 * MiB), max_size=4)),
        min_size=1,
        max_size=3,
    ),
    rows=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.integers(0, 2),
            st.floats(0, 1),
            st.integers(1, MiB),
            st.integers(1, 20),
            st.integers(0, 2 * MiB),
        ),
        min_size=1,
        max_size=8,
    ),
)
@example(  # rows at [0, 500) and [3000, 3500) skip the block [1000, 2000)
    objects=[(MiB, [1000, 2000])], rows=[(0, 0, 0.0, 500, 2, 2500)]
)
def test_touched_blocks_are_those_some_row_overlaps(
    objects: list[tuple[int, list[int]]],
    rows: list[tuple[int, int, float, int, int, int]],
) -> None:
    sizes = np.array([n for n, _ in objects], np.int64)
    cuts = [sorted({c for c in cs if c < n}) for n, cs in objects]
    spans = [list(block_spans(int(n), c)) for n, c in zip(sizes, cuts, strict=True)]
    records, expected = [], set()
    for worker, o, at, length, count, gap in rows:
        obj = o % len(sizes)
        stride = length + gap if count > 1 else length
        length = min(length, int(sizes[obj]))
        extent = (count - 1) * stride + length
        if extent > sizes[obj]:
            count, stride, extent = 1, length, length
        src = int(at * (sizes[obj] - extent))
        records.append((worker, obj, src, length, count, stride))
        first = sum(len(s) for s in spans[:obj])
        for k in range(count):
            a, b = src + k * stride, src + k * stride + length
            expected |= {
                (worker, first + j) for j, (s, e) in enumerate(spans[obj]) if s < b and a < e
            }
    blocks = delta_blocks(sizes, np.ones(len(sizes), np.int64), cuts, 0.0)
    worker, block = touched_blocks(_demands(records), blocks)
    assert list(zip(worker.tolist(), block.tolist(), strict=True)) == sorted(expected)


def _table(nodes: list[int], demands: np.ndarray, objects: int) -> SimpleNamespace:
    """The parts of a direct routing table ``delta_traffic`` reads: workers and objects
    named in sorted order, as the planner names them."""
    return SimpleNamespace(
        workers=tuple(f"w{i:02d}" for i in range(len(nodes))),
        worker_node=nodes,
        objects=tuple(f"g/payload/obj{o:02d}" for o in range(objects)),
        demands=demands,
        params=PlanParams(),
    )


def test_a_shared_block_is_read_once_and_pushed() -> None:
    """Worker 0 (node 0) touches blocks 0-1 and 3 of object 0 and object 1's only block;
    worker 1 (node 1) touches object 0's block 1 twice (once); worker 2 nothing. At rate 0
    each entry is its header alone. Block 1 goes to node 1, which has moved nothing yet: it
    reads it and pushes it across to worker 0, whose own reads are then blocks 0 and 3 of
    object 0 (two ranges, one key) and object 1's block (another key)."""
    sizes = np.array([16 * MiB, MiB], np.int64)
    blocks = delta_blocks(sizes, np.array([2, 2]), [(), ()], 0.0)
    demands = _demands(
        [
            (0, 0, 0, 5 * MiB, 1, 5 * MiB),
            (0, 0, 13 * MiB, 10, 1, 10),
            (0, 1, 0, 10, 1, 10),
            (1, 0, 5 * MiB, 10, 2, MiB),
        ]
    )
    traffic, ops, gpu_blocks = delta_traffic(
        _table([0, 1, 1], demands, 2), blocks, np.array([0, 1]), 2
    )
    h = HEADER.size
    assert gpu_blocks.tolist() == [4, 1, 0]
    assert (ops.read_keys.tolist(), ops.read_ranges.tolist()) == ([2, 1, 0], [3, 1, 0])
    assert ops.pushes.tolist() == [0, 1, 0]
    assert traffic.reads_per_gpu.tolist() == [3 * h, h, 0]
    assert traffic.received_per_gpu().tolist() == [4 * h, h, 0]
    assert (traffic.gpu_nic_out.tolist(), traffic.gpu_nic_in.tolist()) == (
        [0, h, 0],
        [4 * h, h, 0],
    )
    assert traffic.nvlink_in.sum() == traffic.nvlink_out.sum() == 0
    assert traffic.trainer_node_out.tolist() == [3 * h, h]
    assert (traffic.store_read_bytes, traffic.delivered_bytes) == (4 * h, 5 * h)
    assert traffic.pushed_bytes == traffic.cross_node_pushed_bytes == h


def test_the_fetch_needs_the_planners_order() -> None:
    table = _table([0], _demands([(0, 0, 0, 10, 1, 10)]), 2)
    table.objects = table.objects[::-1]
    blocks = delta_blocks(np.array([MiB, MiB]), np.array([1, 1]), [(), ()], 0.0)
    with pytest.raises(ValueError, match="sorted"):
        delta_traffic(table, blocks, np.array([0, 0]), 1)


@given(
    objects=st.lists(
        st.tuples(st.integers(1, 10 * MiB), st.lists(st.integers(1, 10 * MiB), max_size=4)),
        min_size=1,
        max_size=3,
    ),
    nodes=st.lists(st.integers(0, 2), min_size=1, max_size=6),
    rows=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 2), st.floats(0, 1), st.integers(1, 8 * MiB)),
        min_size=1,
        max_size=12,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_simulated_delta_bytes_come_exactly_from_the_planner(
    objects: list[tuple[int, list[int]]],
    nodes: list[int],
    rows: list[tuple[int, int, float, int]],
    seed: int,
) -> None:
    """On any small table the simulated fetch is ``plan_delta_fetch``'s plan for the same
    demand: each distinct entry read once, every (worker, block) delivered once, every
    other copy pushed; each worker reads, pushes (across nodes or not) and receives the
    bytes the plan gives it, in the operations the executor's coalescing leaves of them."""
    sizes = np.array([n for n, _ in objects], np.int64)
    cuts = [sorted({c for c in cs if c < n}) for n, cs in objects]
    records = []
    for worker, o, at, length in rows:
        obj = o % len(sizes)
        length = min(length, int(sizes[obj]))
        records.append(
            (worker % len(nodes), obj, int(at * (sizes[obj] - length)), length, 1, length)
        )
    shape = delta_blocks(sizes, np.ones(len(sizes), np.int64), cuts, 0.0)
    entry = np.random.default_rng(seed).integers(1, 1000, len(shape.start))
    blocks = replace(shape, entry_bytes=entry.astype(np.float64))
    table = _table(nodes, _demands(records), len(sizes))
    traffic, ops, _ = delta_traffic(table, blocks, np.zeros(len(sizes), np.int64), 1)

    demand = _planner_demand(table, blocks, *touched_blocks(table.demands, blocks))
    slices = plan_delta_fetch(demand, 1 << 40)
    names = table.workers
    batches = [[b for stage in slices[w].stages for b in stage] for w in names]
    reads = [[r for b in wb for r in b.reads] for wb in batches]
    pushes = [[p for b in wb for p in b.pushes] for wb in batches]
    every = [b for w in names for b in demand.blocks[w]]
    assert traffic.store_read_bytes == sum(b.length for b in set(every))
    assert traffic.delivered_bytes == sum(b.length for b in every)
    assert traffic.pushed_bytes == traffic.delivered_bytes - traffic.store_read_bytes
    assert traffic.reads_per_gpu.tolist() == [sum(r.length for r in rs) for rs in reads]
    sent = (traffic.gpu_nic_out + traffic.nvlink_out).tolist()
    assert sent == [sum(p.length for p in ps) for ps in pushes]
    assert traffic.received_per_gpu().tolist() == [
        sum(b.length for b in demand.blocks[w]) for w in names
    ]
    cross = [
        sum(p.length for p in ps if nodes[names.index(p.peer)] != n)
        for ps, n in zip(pushes, nodes, strict=True)
    ]
    assert traffic.gpu_nic_out.tolist() == cross
    assert ops.read_keys.tolist() == [len({r.key for r in rs}) for rs in reads]
    assert ops.read_ranges.tolist() == [
        len(coalesced_reads([RangeRead(r.key, r.src_offset, r.dst_offset, r.length) for r in rs]))
        for rs in reads
    ]
    assert ops.pushes.tolist() == [_writes(ps) for ps in pushes]


def _planner_demand(
    table: SimpleNamespace, blocks: DeltaBlocks, worker: np.ndarray, block: np.ndarray
) -> DeltaDemand:
    """The planner's demand for the simulated (worker, block) pairs: each block's entry
    at its place in its object's delta object (entries back to back, block by block)."""
    first = np.searchsorted(blocks.obj, blocks.obj)  # each block's object's first block
    offset = np.r_[0, np.cumsum(blocks.entry_bytes)].astype(np.int64)
    wanted: dict[str, list[EntryBlock]] = {w: [] for w in table.workers}
    for w, b in zip(worker.tolist(), block.tolist(), strict=True):
        start = int(offset[b] - offset[first[b]])
        end = start + int(blocks.entry_bytes[b])
        key = table.objects[blocks.obj[b]]
        wanted[table.workers[w]].append(EntryBlock(key, b - int(first[b]), start, end))
    nodes = {w: f"node{n}" for w, n in zip(table.workers, table.worker_node, strict=True)}
    return DeltaDemand(nodes, {w: tuple(bs) for w, bs in wanted.items()})


def _writes(pushes: list[PushOp]) -> int:
    """The Transfer Engine writes ``pushes`` (one call) take: per peer, after coalescing
    (offsets into one region on each side, at some address of it)."""
    base = 1 << 20
    by_peer: dict[str, list[Write]] = defaultdict(list)
    for p in pushes:
        by_peer[p.peer].append(Write(base + p.src_offset, base + p.dst_offset, p.length))
    return sum(len(coalesced_writes(ws)) for ws in by_peer.values())


@pytest.mark.parametrize(("layout", "dtype"), [("ep", "fp8"), ("tp", "bfloat16")])
def test_a_planned_delta_at_rates_0_and_1(layout: str, dtype: str) -> None:
    """Rate 0: each GPU receives exactly the headers of the blocks it touches; rate 1: every
    entry is its whole block, so each GPU receives at least the bytes it holds. Either way
    the Store serves every entry once. TP splits row-parallel weights by columns: strided
    demand records."""

    def scenario(rate: float) -> Scenario:
        cluster = Cluster(trainer_gpus=16, rollout_instances=2, rollout_tp=4, rollout_layout=layout)
        return Scenario(model="small", dtype=dtype, cluster=cluster, modes=("direct",),
                        pack_bytes=MiB, delta_change_rate=rate)  # fmt: skip

    still, moved = simulate(scenario(0.0)), simulate(scenario(1.0))
    for result in (still, moved):
        assert "delta" in result["assumptions"]
    zero, one = still["delta"], moved["delta"]
    assert zero["blocks_per_gpu"] == one["blocks_per_gpu"]
    assert zero["delta_bytes_per_gpu"] == {
        k: HEADER.size * v for k, v in zero["blocks_per_gpu"].items()
    }
    assert zero["stored_bytes"] == HEADER.size * zero["blocks"]
    assert one["stored_bytes"] == still["scenario"]["model_bytes"] + HEADER.size * one["blocks"]
    assert one["bytes_ratio_per_gpu"]["min"] >= 1
    assert one["blocks_by_encoding"]["whole"] == one["blocks"]
    for result in (zero, one):  # every block is held by some GPU: read once, pushed on
        assert result["store_read_bytes"] == result["stored_bytes"]
        assert result["pushed_bytes"] == result["delivered_bytes"] - result["store_read_bytes"]
    assert zero["update_seconds_by_op_costs"]["none"]["update_seconds"] < 1e-4
    no_delta = simulate(replace(scenario(0.0), delta_change_rate=None))
    assert "delta" not in no_delta and "delta" not in no_delta["assumptions"]
