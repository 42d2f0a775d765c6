"""Emit reads and two-stage pushes for assigned chunks, cut into byte-bounded batches.

For each chunk: one Store read by its reader, landing in the reader's own destination when
the reader consumes the chunk, else in its ``staging`` region. Stage 1: the reader pushes
to every other consumer on its node and to ONE *relay* on every other consumer node (the
node's delegate if it consumes the chunk, else that node's lowest-index consumer), so a
chunk crosses ``consumer nodes - 1`` NICs however many workers need it. Stage 2 (after the
barrier): each relay copies from its own destination to the other consumers on its node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mooncake_rl.plan import grid
from mooncake_rl.plan.assign import Chunks
from mooncake_rl.plan.merge import Ranges
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.table import PUSH_DTYPE, READ_DTYPE
from mooncake_rl.plan.topology import Topology

I64 = np.int64


@dataclass(frozen=True, eq=False)
class Routes:
    reads: np.ndarray
    pushes: np.ndarray
    staging_bytes: np.ndarray  # per worker


def route(ranges: Ranges, chunks: Chunks, topology: Topology, params: PlanParams) -> Routes:
    node_of = np.array(topology.worker_node, I64)
    delegate = np.array(topology.delegates, I64)
    r = chunks.range_
    pitch = ranges.pitch[r]
    src = (ranges.r0[r] + chunks.dr) * pitch + ranges.c0[r] + chunks.dc
    length, count = chunks.cols.copy(), chunks.rows.copy()
    reader = chunks.reader

    owner, within = grid.expand_counts(ranges.ptr[r + 1] - ranges.ptr[r])
    c = ranges.ptr[r[owner]] + within
    worker = ranges.worker[c]
    region = ranges.region[c]
    dst = ranges.dst_offset[c] + chunks.dr[owner] * ranges.dst_pitch[c] + chunks.dc[owner]
    dst_pitch = ranges.dst_pitch[c].copy()

    # Fuse rows when the source and every destination are contiguous.
    starts = np.flatnonzero(grid.group_starts(owner))
    all_contiguous = np.minimum.reduceat((dst_pitch == length[owner]).astype(I64), starts) > 0
    fuse = (count > 1) & (length == pitch) & all_contiguous
    length = np.where(fuse, length * count, length)
    count = np.where(fuse, 1, count)
    src_stride = np.where(count == 1, length, pitch)
    dst_pitch = np.where(count[owner] == 1, length[owner], dst_pitch)

    # Where each chunk lands at its reader.
    is_reader = worker == reader[owner]
    land_region = np.zeros(len(r), I64)
    land_off = np.zeros(len(r), I64)
    land_pitch = length.copy()
    land_region[owner[is_reader]] = region[is_reader]
    land_off[owner[is_reader]] = dst[is_reader]
    land_pitch[owner[is_reader]] = dst_pitch[is_reader]
    staged = np.ones(len(r), bool)
    staged[owner[is_reader]] = False
    staging_bytes = _allocate_staging(
        staged, reader, length * count, land_off, params.align, topology
    )

    # Read order and batches (per worker: by object, then offset).
    read_order = grid.lex_order(reader, ranges.obj[r], src)
    read_batch = np.zeros(len(r), I64)
    read_batch[read_order] = _pack(reader[read_order], (length * count)[read_order], params)
    rank = np.empty(len(r), I64)
    rank[read_order] = np.arange(len(r))
    reads = np.zeros(len(r), READ_DTYPE)
    for name, value in (
        ("worker", reader),
        ("batch", read_batch),
        ("object", ranges.obj[r]),
        ("src_offset", src),
        ("src_stride", src_stride),
        ("dst_region", land_region),
        ("dst_offset", land_off),
        ("dst_stride", land_pitch),
        ("length", length),
        ("count", count),
    ):
        reads[name] = value[read_order]

    # Pushes: stage 1 from the reader's landing, stage 2 from the node relay's destination.
    node = node_of[worker]
    remote = ~is_reader & (node != node_of[reader[owner]])
    local = ~is_reader & ~remote
    rem = np.flatnonzero(remote)
    prio = (worker[rem] != delegate[node[rem]]).astype(I64)
    rem = rem[grid.lex_order(owner[rem], node[rem], prio, worker[rem])]
    first = grid.group_starts(owner[rem], node[rem])
    relay_of = rem[np.flatnonzero(first)[np.cumsum(first) - 1]]
    stage1 = np.concatenate([np.flatnonzero(local), rem[first]])
    stage2 = rem[~first]
    relay2 = relay_of[~first]
    sender = np.concatenate([reader[owner[stage1]], worker[relay2]])
    pair = np.concatenate([stage1, stage2])
    o = owner[pair]
    stage = np.concatenate([np.ones(len(stage1), I64), np.full(len(stage2), 2, I64)])
    s_region = np.concatenate([land_region[owner[stage1]], region[relay2]])
    s_off = np.concatenate([land_off[owner[stage1]], dst[relay2]])
    s_pitch = np.concatenate([land_pitch[owner[stage1]], dst_pitch[relay2]])
    batch = np.where(stage == 1, read_batch[o], 0)
    two = np.flatnonzero(stage == 2)
    order2 = two[grid.lex_order(sender[two], rank[o[two]], worker[pair[two]])]
    batch[order2] = _pack(sender[order2], (length * count)[o[order2]], params)
    push_order = grid.lex_order(sender, stage, batch, rank[o], worker[pair])
    pushes = np.zeros(len(pair), PUSH_DTYPE)
    for name, value in (
        ("worker", sender),
        ("stage", stage),
        ("batch", batch),
        ("peer", worker[pair]),
        ("src_region", s_region),
        ("src_offset", s_off),
        ("src_stride", s_pitch),
        ("dst_region", region[pair]),
        ("dst_offset", dst[pair]),
        ("dst_stride", dst_pitch[pair]),
        ("length", length[o]),
        ("count", count[o]),
    ):
        pushes[name] = value[push_order]
    return Routes(reads=reads, pushes=pushes, staging_bytes=staging_bytes)


def _allocate_staging(staged, reader, nbytes, land_off, align, topology) -> np.ndarray:
    """Pack staged chunks back to back per reader (``align``-byte aligned); sizes per worker."""
    idx = np.flatnonzero(staged)
    idx = idx[np.argsort(reader[idx], kind="stable")]
    padded = -(-nbytes[idx] // align) * align
    end = np.cumsum(padded)
    first = grid.group_starts(reader[idx])
    group_base = (end - padded)[first]
    offsets = end - padded - group_base[np.cumsum(first) - 1]
    land_off[idx] = offsets
    sizes = np.zeros(len(topology.workers), I64)
    np.add.at(sizes, reader[idx], padded)
    return sizes


def _pack(worker: np.ndarray, nbytes: np.ndarray, params: PlanParams) -> np.ndarray:
    """Greedy byte-bounded batches over records already ordered by worker."""
    out = []
    limit = params.batch_bytes
    current, batch, filled = -1, 0, 0
    for w, b in zip(worker.tolist(), nbytes.tolist(), strict=True):
        if w != current:
            current, batch, filled = w, 0, 0
        elif filled + b > limit and filled > 0:
            batch, filled = batch + 1, 0
        filled += b
        out.append(batch)
    return np.array(out, I64)
