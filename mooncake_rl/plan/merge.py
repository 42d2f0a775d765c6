"""Demand merge: per Store object, the union of demanded bytes cut into disjoint ranges.

A *range* is a rectangle of its object's grid (rows ``r0..r1`` of ``pitch`` bytes, columns
``c0..c1``) that every demand touching it covers entirely, so one read serves all its
consumers. Overlapping demands (replicated norms, the same shard on every instance)
collapse into one range with many consumers; bytes nobody demands never appear.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan import grid
from mooncake_rl.plan.targets import DemandSet


@dataclass(frozen=True, eq=False)
class Ranges:
    """Disjoint demanded source ranges and their consumers.

    Range ``r`` is rows ``r0[r]..r1[r]`` x bytes ``c0[r]..c1[r]`` of object ``obj[r]``,
    whose rows are ``pitch[r]`` bytes apart. Consumer ``c`` (``ptr[r] <= c < ptr[r+1]``,
    sorted by worker) receives row ``i`` at ``dst_offset[c] + i * dst_pitch[c]`` of its
    ``region[c]``.
    """

    obj: np.ndarray
    r0: np.ndarray
    r1: np.ndarray
    c0: np.ndarray
    c1: np.ndarray
    pitch: np.ndarray
    ptr: np.ndarray
    worker: np.ndarray
    region: np.ndarray
    dst_offset: np.ndarray
    dst_pitch: np.ndarray

    def __len__(self) -> int:
        return len(self.obj)


def merge_demands(demands: DemandSet) -> Ranges:
    """Partition the union of all demands into ranges with their consumer destinations."""
    rects, spaces = grid.to_rects(
        demands.obj, demands.src_offset, demands.length, demands.count, demands.src_stride
    )
    lanes = grid.to_lanes(rects)
    cells = grid.elementary_cells(lanes)
    rect = lanes.rect[cells.pair_entry]
    piece = rects.member[rect]
    pitch = rects.pitch[cells.space]
    strided = rects.strided[rect]
    rel = lanes.k0[cells.pair_entry] * demands.dst_stride[piece] + cells.pair_j0
    dst_pitch = np.where(strided, demands.dst_stride[piece], pitch[cells.pair_cell])

    counts = demands.ptr[piece + 1] - demands.ptr[piece]
    owner, within = grid.expand_counts(counts)
    consumer = demands.ptr[piece[owner]] + within
    cell = cells.pair_cell[owner]
    worker = demands.worker[consumer]
    order = grid.lex_order(cell, worker)
    cell, worker, owner, consumer = cell[order], worker[order], owner[order], consumer[order]
    duplicate = np.flatnonzero((cell[1:] == cell[:-1]) & (worker[1:] == worker[:-1]))
    if len(duplicate):
        c = cell[duplicate[0]]
        raise InvariantViolation(
            f"worker #{worker[duplicate[0]]} demands bytes of object #{spaces[cells.space[c]]} "
            f"(rows {cells.r0[c]}..{cells.r1[c]}, bytes {cells.c0[c]}..{cells.c1[c]}) twice"
        )
    n = len(cells.space)
    return Ranges(
        obj=spaces[cells.space],
        r0=cells.r0,
        r1=cells.r1,
        c0=cells.c0,
        c1=cells.c1,
        pitch=pitch,
        ptr=np.searchsorted(cell, np.arange(n + 1)).astype(np.int64),
        worker=worker,
        region=demands.region[consumer],
        dst_offset=demands.dst_offset[consumer] + rel[owner],
        dst_pitch=dst_pitch[owner],
    )


def split_by_node(ranges: Ranges, worker_node: np.ndarray) -> Ranges:
    """Each range once per node that consumes it, with that node's consumers only: the
    ranges a pull per node reads (``PlanParams.pull``). A range's copies name the same
    source bytes, so ranges are disjoint per node, not fleet-wide; a copy's single consumer
    node is where the reader assignment puts its read."""
    owner = np.repeat(np.arange(len(ranges), dtype=np.int64), np.diff(ranges.ptr))
    node = np.asarray(worker_node, np.int64)[ranges.worker]
    order = grid.lex_order(owner, node)  # stable: consumers stay in worker order
    starts = np.flatnonzero(grid.group_starts(owner[order], node[order]))
    parent = owner[order][starts]
    return Ranges(
        obj=ranges.obj[parent],
        r0=ranges.r0[parent],
        r1=ranges.r1[parent],
        c0=ranges.c0[parent],
        c1=ranges.c1[parent],
        pitch=ranges.pitch[parent],
        ptr=np.append(starts, len(order)).astype(np.int64),
        worker=ranges.worker[order],
        region=ranges.region[order],
        dst_offset=ranges.dst_offset[order],
        dst_pitch=ranges.dst_pitch[order],
    )
