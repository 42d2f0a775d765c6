"""Every checksum block an update reads is read whole by one worker in one batch, so the
worker checks it before pushing or landing any of it (``plan/blocks.py``)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rl.generations.checksums import BLOCK_BYTES
from mooncake_rl.plan import DirectDemand, PlanParams, Topology, Worker, plan_routing

from .helpers import (
    Spec,
    check_delivery,
    contents,
    execute,
    expected_delivery,
    manifest,
    parts,
)

ROW = 4096  # bytes per row of every test tensor (2048 bf16 columns)


def unchecked_bytes(table) -> int:
    """Read bytes in a block cell (``BLOCK_BYTES`` from the object's start) that no single
    (worker, batch) reads entirely: bytes its reader cannot check before using them."""
    spans = defaultdict(list)  # (worker, batch, object) -> contiguous source spans
    for r in table.reads:
        for k in range(int(r["count"])):
            start = int(r["src_offset"]) + k * int(r["src_stride"])
            spans[(int(r["worker"]), int(r["batch"]), int(r["object"]))].append(
                (start, start + int(r["length"]))
            )
    unchecked = 0
    for (_, _, obj), pieces in spans.items():
        size = int(table.object_sizes[obj])
        covered = np.zeros(-(-size // BLOCK_BYTES), np.int64)
        touched = np.zeros_like(covered)
        for lo, hi in pieces:
            for cell in range(lo // BLOCK_BYTES, (hi - 1) // BLOCK_BYTES + 1):
                inside = min(hi, (cell + 1) * BLOCK_BYTES) - max(lo, cell * BLOCK_BYTES)
                covered[cell] += inside
                touched[cell] += inside
        cell_size = np.minimum(
            BLOCK_BYTES, size - np.arange(len(covered), dtype=np.int64) * BLOCK_BYTES
        )
        unchecked += int(touched[covered < cell_size].sum())
    return unchecked


def dp_tp(tp: int, instances: int, nodes: int) -> Topology:
    """``instances`` TP engines, instance ``i`` on node ``i % nodes``."""
    return Topology.of(
        Worker(f"i{i}r{r}", f"n{i % nodes}", f"i{i}", r)
        for i in range(instances)
        for r in range(tp)
    )


def planned(specs: list[Spec], tp: int, instances: int, nodes: int, batch: int):
    ps = parts(specs, tp)
    topology = dp_tp(tp, instances, nodes)
    demand = DirectDemand.of({w.worker_id: ps[w.tp_rank] for w in topology.workers})
    return plan_routing(manifest(specs), topology, demand, params=PlanParams(batch_bytes=batch)), ps


@settings(max_examples=25, deadline=None)
@given(
    rows=st.lists(
        st.integers(1, 5 * BLOCK_BYTES // ROW // 8).map(lambda n: 8 * n), min_size=1, max_size=6
    ),
    layout=st.sampled_from([(2, 2, 2), (2, 1, 1), (4, 2, 1), (2, 4, 2)]),
    replicated=st.integers(0, 5),
)
def test_row_split_tensors_are_read_in_whole_blocks(rows, layout, replicated) -> None:
    """TP row shards of tensors stored alone (rank boundaries fall inside blocks), some
    tensors replicated, on DP engines within a node or spread over nodes: no read byte is
    left unchecked, and the table still delivers every byte exactly once."""
    specs = [
        Spec(f"t{i}", (n, ROW // 2), kind="replicated" if i == replicated else "split", dim=0)
        for i, n in enumerate(rows)
    ]
    tp, instances, nodes = layout
    table, _ = planned(specs, tp, instances, nodes, 16 * BLOCK_BYTES)
    assert unchecked_bytes(table) == 0
    assert table.totals.store_read_bytes == sum(s.nbytes for s in specs)
    assert (table.reads["length"] * table.reads["count"]).sum() == sum(s.nbytes for s in specs)


def test_a_tied_block_lands_every_byte_where_it_belongs() -> None:
    """One reader takes a block two ranks share: run on bytes, each rank gets its rows."""
    specs = [Spec("a", (1536, ROW // 2), kind="split"), Spec("b", (520, ROW // 2), kind="split")]
    table, ps = planned(specs, 2, 2, 2, 16 * BLOCK_BYTES)
    assert unchecked_bytes(table) == 0
    staged = table.reads["dst_region"] == 0
    assert staged.any()  # some rows were read for the other rank, into staging
    data = contents(specs)
    buffers, written, _ = execute(table, data)
    part_of = {w.worker_id: ps[w.tp_rank] for w in dp_tp(2, 2, 2).workers}
    demand = DirectDemand.of(part_of)
    check_delivery(
        table, buffers, written, expected_delivery(table, specs, data, demand, part_of, {})
    )


@pytest.mark.parametrize("batch", [BLOCK_BYTES // 2])
def test_batches_smaller_than_a_block_tie_nothing(batch: int) -> None:
    """A batch that cannot hold a block cannot check one: readers stay as the greedy chose."""
    specs = [Spec("a", (1536, ROW // 2), kind="split")]
    table, _ = planned(specs, 2, 1, 1, batch)
    assert not (table.reads["dst_region"] == 0).any()
