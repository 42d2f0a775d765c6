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


def join_adjacent(ranges: Ranges) -> Ranges:
    """Runs of ranges that continue one another, in the source and in every consumer's
    destination, joined into one single-row range.

    Why: a pack holds many small tensors back to back, and compat receive buffers (or an
    expert's fused gate and up rows) hold them back to back too; as separate ranges each
    would get its own reader and its own read and pushes, and Mooncake charges per range
    (``mooncake_rl.apply.coalesce``). Joined, they are chunked and read like one large
    tensor. Two ranges join only when both are contiguous (one row, or whole rows), the
    second starts where the first ends in the same object, and their consumers are the same
    workers and regions, each receiving the second right after the first. Coverage and
    consumers are unchanged, so every later invariant holds as before; ranges that join
    nothing keep their order and fields.
    """
    n = len(ranges)
    if n < 2:
        return ranges
    rows = ranges.r1 - ranges.r0
    nbytes = rows * (ranges.c1 - ranges.c0)
    start = ranges.r0 * ranges.pitch + ranges.c0
    counts = np.diff(ranges.ptr)
    owner = np.repeat(np.arange(n, dtype=np.int64), counts)
    split_dst = (rows[owner] > 1) & (ranges.dst_pitch != ranges.c1[owner] - ranges.c0[owner])
    contiguous = ((rows == 1) | ((ranges.c0 == 0) & (ranges.c1 == ranges.pitch))) & (
        np.bincount(owner, split_dst, n) == 0
    )
    order = grid.lex_order(ranges.obj, start)
    first, second = order[:-1], order[1:]
    pair = np.flatnonzero(
        contiguous[first]
        & contiguous[second]
        & (ranges.obj[first] == ranges.obj[second])
        & (start[first] + nbytes[first] == start[second])
        & (counts[first] == counts[second])
    )
    if len(pair):
        p, k = grid.expand_counts(counts[first[pair]])
        a = ranges.ptr[first[pair]][p] + k
        b = ranges.ptr[second[pair]][p] + k
        differs = (
            (ranges.worker[a] != ranges.worker[b])
            | (ranges.region[a] != ranges.region[b])
            | (ranges.dst_offset[a] + nbytes[first[pair]][p] != ranges.dst_offset[b])
        )
        pair = pair[np.bincount(p, differs, len(pair)) == 0]
    if not len(pair):
        return ranges
    joins = np.zeros(n - 1, bool)
    joins[pair] = True
    group = np.concatenate([[0], np.cumsum(~joins)])  # per sorted position
    heads = order[np.flatnonzero(np.concatenate([[True], ~joins]))]
    total = np.bincount(group, nbytes[order]).astype(np.int64)
    ends = start[heads] + total
    single = np.bincount(group, minlength=len(heads)) == 1
    keep = grid.stable_order(heads)  # groups in their head's original order
    heads, total, ends, single = heads[keep], total[keep], ends[keep], single[keep]
    take = ranges.ptr[heads].repeat(counts[heads]) + grid.expand_counts(counts[heads])[1]
    return Ranges(
        obj=ranges.obj[heads],
        r0=np.where(single, ranges.r0[heads], 0),
        r1=np.where(single, ranges.r1[heads], 1),
        c0=np.where(single, ranges.c0[heads], start[heads]),
        c1=np.where(single, ranges.c1[heads], ends),
        pitch=np.where(single, ranges.pitch[heads], ends),
        ptr=np.concatenate([[0], np.cumsum(counts[heads])]).astype(np.int64),
        worker=ranges.worker[take],
        region=ranges.region[take],
        dst_offset=ranges.dst_offset[take],
        dst_pitch=np.where(
            np.repeat(single, counts[heads]),
            ranges.dst_pitch[take],
            np.repeat(total, counts[heads]),
        ),
    )
