"""Emit reads and two-stage pushes for assigned chunks, cut into byte-bounded batches.

For each chunk: one Store read by its reader, landing in the reader's own destination when
the reader consumes the chunk, else in its ``staging`` region. A reader's reads of one
checksum block share a batch (:mod:`.blocks`), so it checks the block before any push.
Stage 1: the reader pushes to every other consumer on its node and to ONE *relay* on every
other consumer node, so a chunk crosses ``consumer nodes - 1`` NICs however many workers
need it. Stage 2 (after the barrier): each relay copies from its own destination to the
other consumers on its node.

**Relays are spread over a node's GPUs**, not one delegate per node (which fanned the whole
model out of one GPU in compat mode). A node's relayed chunks form *streams*: chunks whose
consumers on the node are the same set of ``k`` workers (compat: every worker of the node).
Within a stream, in chunk order, a chunk goes to the candidate ``i`` whose slice
``[i T / k, (i + 1) T / k)`` of the stream's running byte total ``T`` holds the chunk's
midpoint. **Relay bound** (proof): the chunks a candidate relays have midpoints in one slice
of width ``T / k``, so they lie within ``b_max / 2`` of it on each side: each candidate
relays between ``T / k - b_max`` and ``T / k + b_max`` bytes of the stream (``b_max``: its
largest chunk), i.e. receives that much in stage 1 and sends ``k - 1`` times it in stage 2.

With a pull per node (``PlanParams.pull``) every chunk's consumers sit on its reader's node,
so all its pushes are stage 1 pushes from the read: no relay, no stage 2.

**Local copies** finish sieved spans (:mod:`.sieve`): each consumer of a span copies its
pieces out of its staging once the span has landed there: its reader in the batch of the
read, the others in stage 2 (the span reached them by a stage 1 push). They are pushes from
a worker to itself: the executor runs them as in-memory copies, and the table's traffic
totals leave them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mooncake_rl.generations.checksums import BLOCK_BYTES
from mooncake_rl.plan import grid
from mooncake_rl.plan.assign import Chunks
from mooncake_rl.plan.merge import Ranges
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.sieve import STAGING, Sieved
from mooncake_rl.plan.table import PUSH_DTYPE, READ_DTYPE
from mooncake_rl.plan.topology import Topology

I64 = np.int64


@dataclass(frozen=True, eq=False)
class Routes:
    reads: np.ndarray
    pushes: np.ndarray
    staging_bytes: np.ndarray  # per worker


def route(
    ranges: Ranges,
    chunks: Chunks,
    topology: Topology,
    params: PlanParams,
    sieved: Sieved | None = None,
) -> Routes:
    """``sieved``: where ``ranges`` came from a sieve, its copies join the pushes and its
    spans' staging comes first in every worker's staging region."""
    node_of = np.array(topology.worker_node, I64)
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
    del within, c  # one entry per (chunk, consumer): the largest arrays; free them early

    # Whole rows landing contiguously arrive as one row (``assign``), so count > 1 is strided.
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
    base = sieved.staging_bytes if sieved is not None else np.zeros(len(topology.workers), I64)
    staging_bytes = _allocate_staging(
        staged, reader, length * count, land_off, params.align, topology, base
    )

    # Read order and batches (per worker: by object, then offset).
    read_order = grid.lex_order(
        reader, _read_walk(ranges.obj[r], node_of[reader], len(topology.nodes), params), src
    )
    read_batch = np.zeros(len(r), I64)
    joined = _same_block(reader, ranges.obj[r], src, length, count, read_order)
    read_batch[read_order] = _pack(
        reader[read_order],
        (length * count)[read_order],
        params,
        joined if params.batch_bytes >= BLOCK_BYTES else None,
    )
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
    rem = rem[grid.lex_order(owner[rem], node[rem], worker[rem])]
    is_relay = _relays(owner[rem], node[rem], worker[rem], (length * count)[owner[rem]], topology)
    group = np.cumsum(grid.group_starts(owner[rem], node[rem])) - 1
    relay_of = rem[np.flatnonzero(is_relay)][group]
    stage1 = np.concatenate([np.flatnonzero(local), rem[is_relay]])
    stage2 = rem[~is_relay]
    relay2 = relay_of[~is_relay]
    read1 = owner[stage1]  # a stage 1 push sends its chunk from where the reader landed it
    sender = np.concatenate([reader[read1], worker[relay2]])
    pair = np.concatenate([stage1, stage2])
    o = owner[pair]
    stage = np.concatenate([np.ones(len(stage1), I64), np.full(len(stage2), 2, I64)])
    s_region = np.concatenate([land_region[read1], region[relay2]])
    s_off = np.concatenate([land_off[read1], dst[relay2]])
    s_pitch = np.concatenate([land_pitch[read1], dst_pitch[relay2]])
    del node, remote, local, rem, is_relay, group, relay_of, stage1, stage2, relay2, read1
    batch = np.where(stage == 1, read_batch[o], 0)
    two = np.flatnonzero(stage == 2)
    order2 = two[grid.lex_order(sender[two], rank[o[two]], worker[pair[two]])]
    batch[order2] = _pack(sender[order2], (length * count)[o[order2]], params)
    push_order = grid.lex_order(sender, stage, batch, rank[o], worker[pair])
    pushes = np.zeros(len(pair), PUSH_DTYPE)
    pair, o = pair[push_order], o[push_order]  # per-consumer fields: one gather, in order
    for name, value in (
        ("worker", sender[push_order]),
        ("stage", stage[push_order]),
        ("batch", batch[push_order]),
        ("peer", worker[pair]),
        ("src_region", s_region[push_order]),
        ("src_offset", s_off[push_order]),
        ("src_stride", s_pitch[push_order]),
        ("dst_region", region[pair]),
        ("dst_offset", dst[pair]),
        ("dst_stride", dst_pitch[pair]),
        ("length", length[o]),
        ("count", count[o]),
    ):
        pushes[name] = value
    if sieved is not None and sieved.copies:
        pushes = _with_copies(pushes, reads, sieved, params)
    return Routes(reads=reads, pushes=pushes, staging_bytes=staging_bytes)


def _with_copies(
    pushes: np.ndarray, reads: np.ndarray, sieved: Sieved, params: PlanParams
) -> np.ndarray:
    """The sieve's local copies as pushes of each worker to itself, merged into the pushes'
    (worker, stage, batch) order: a span's reader copies its pieces in the batch of its read
    (stage 1, as soon as the read is checked); the others in stage 2, once the span they
    were pushed has arrived, in batches after their relay batches."""
    worker, src = sieved.copy_worker, sieved.copy_src  # sorted by worker
    landed = np.flatnonzero(reads["dst_region"] == STAGING)
    at, _ = grid.at_or_before(
        reads["worker"][landed].astype(I64),
        reads["dst_offset"][landed].astype(I64),
        worker,
        src,
    )
    read = landed[np.maximum(at, 0)]
    own = (
        (at >= 0)
        & (reads["worker"][read] == worker)
        & (src + sieved.copy_length <= reads["dst_offset"][read] + reads["length"][read])
    )
    relayed = pushes[pushes["stage"] == 2]
    after = np.zeros(int(max(worker.max(), pushes["worker"].max(initial=0))) + 1, I64)
    np.maximum.at(after, relayed["worker"].astype(I64), relayed["batch"].astype(I64) + 1)
    batch = reads["batch"][read].astype(I64)
    late = np.flatnonzero(~own)
    batch[late] = after[worker[late]] + _pack(worker[late], sieved.copy_length[late], params)
    copies = np.zeros(len(worker), PUSH_DTYPE)
    for name, value in (
        ("worker", worker),
        ("stage", np.where(own, 1, 2)),
        ("batch", batch),
        ("peer", worker),
        ("src_region", STAGING),
        ("src_offset", src),
        ("src_stride", sieved.copy_length),
        ("dst_region", sieved.copy_region),
        ("dst_offset", sieved.copy_dst),
        ("dst_stride", sieved.copy_length),
        ("length", sieved.copy_length),
        ("count", 1),
    ):
        copies[name] = value
    merged = np.concatenate([pushes, copies])
    return merged[grid.lex_order(merged["worker"], merged["stage"], merged["batch"])]


def _read_walk(obj: np.ndarray, node: np.ndarray, n_nodes: int, params: PlanParams) -> np.ndarray:
    """The object order a reader walks. With a pull per node every node reads the same
    objects, and its GPUs would take them in the same order as every other node's: each
    object's holder would serve all nodes at once while the others idle. So node ``n`` of
    ``N`` starts ``n / N`` of the way through the objects and wraps around."""
    if params.pull != "node" or not len(obj):
        return obj
    n_obj = int(obj.max()) + 1
    return (obj - node * n_obj // n_nodes) % n_obj


def _relays(
    chunk: np.ndarray, node: np.ndarray, worker: np.ndarray, nbytes: np.ndarray, topology: Topology
) -> np.ndarray:
    """Mark one relay per (chunk, node) group of remote consumers (rows sorted by chunk,
    node, worker), striping each stream's bytes over its candidates (module docstring)."""
    is_relay = np.zeros(len(chunk), bool)
    if not len(chunk):
        return is_relay
    starts = np.flatnonzero(grid.group_starts(chunk, node))
    k = np.diff(np.append(starts, len(chunk)))
    # A lone candidate relays (a TP shard consumed by one GPU per node: most groups of a
    # MoE); only groups of several candidates form streams worth striping.
    is_relay[starts[k == 1]] = True
    several = np.flatnonzero(k > 1)
    if not len(several):
        return is_relay
    # A stream is (node, k, the candidates' positions on their node): a bit set, exact up to
    # 64 workers per node (beyond, positions share bits: streams merge, relays stay valid).
    bit = np.zeros(len(topology.workers), np.uint64)
    for members in _workers_by_node(topology):
        bit[members] = np.uint64(1) << (np.arange(len(members), dtype=np.uint64) % np.uint64(64))
    mask = np.bitwise_or.reduceat(bit[worker], starts)[several]
    starts, k = starts[several], k[several]
    order = grid.lex_order(node[starts], k, mask.view(I64))  # stable: chunk order inside
    kk, size = k[order], nbytes[starts][order]
    s_first = grid.group_starts(node[starts][order], kk, mask[order])
    s_starts, s_id = np.flatnonzero(s_first), np.cumsum(s_first) - 1
    end = np.cumsum(size)
    before = end - size - (end - size)[s_starts][s_id]
    total = np.add.reduceat(size, s_starts)[s_id]
    pick = np.empty(len(starts), I64)
    pick[order] = np.minimum((2 * before + size) * kk // np.maximum(2 * total, 1), kk - 1)
    is_relay[starts + pick] = True
    return is_relay


def _workers_by_node(topology: Topology) -> list[np.ndarray]:
    """Worker indices of each node, in worker order."""
    node_of = np.array(topology.worker_node, I64)
    order = np.argsort(node_of, kind="stable")
    return np.split(order, np.flatnonzero(np.diff(node_of[order])) + 1)


def _allocate_staging(staged, reader, nbytes, land_off, align, topology, base) -> np.ndarray:
    """Pack staged chunks back to back per reader (``align``-byte aligned) after the
    ``base`` bytes each worker's staging already holds; sizes per worker."""
    idx = np.flatnonzero(staged)
    idx = idx[np.argsort(reader[idx], kind="stable")]
    padded = -(-nbytes[idx] // align) * align
    end = np.cumsum(padded)
    first = grid.group_starts(reader[idx])
    group_base = (end - padded)[first]
    offsets = end - padded - group_base[np.cumsum(first) - 1]
    land_off[idx] = offsets + base[reader[idx]]
    sizes = np.asarray(base, I64).copy()
    np.add.at(sizes, reader[idx], padded)
    return sizes


def _same_block(reader, obj, src, length, count, order) -> np.ndarray:
    """For reads in ``order``: whether each continues the previous one's checksum block
    (the same reader, object and block, both contiguous), so the two share a batch and
    the block is checked (``blocks``)."""
    w, o, s, n = reader[order], obj[order], src[order], count[order]
    end = s + length[order]
    joined = np.zeros(len(order), bool)
    joined[1:] = (
        (w[1:] == w[:-1])
        & (o[1:] == o[:-1])
        & (n[1:] == 1)
        & (n[:-1] == 1)
        & ((end[:-1] - 1) // BLOCK_BYTES == s[1:] // BLOCK_BYTES)
    )
    return joined


def _pack(
    worker: np.ndarray, nbytes: np.ndarray, params: PlanParams, joined: np.ndarray | None = None
) -> np.ndarray:
    """Greedy byte-bounded batches over records already ordered by worker; a run of
    ``joined`` records (each joined to the one before) goes whole into one batch, which
    then starts before the run where the run would overflow it."""
    if joined is None:
        joined = np.zeros(len(worker), bool)
    run_bytes = _run_totals(nbytes, joined)
    out = []
    limit = params.batch_bytes
    current, batch, filled = -1, 0, 0
    for w, b, glued, run in zip(
        worker.tolist(), nbytes.tolist(), joined.tolist(), run_bytes.tolist(), strict=True
    ):
        if w != current:
            current, batch, filled = w, 0, 0
        elif not glued and filled + run > limit and filled > 0:
            batch, filled = batch + 1, 0
        filled += b
        out.append(batch)
    return np.array(out, I64)


def _run_totals(nbytes: np.ndarray, joined: np.ndarray) -> np.ndarray:
    """Per record: the bytes of the joined run it starts (its own bytes inside a run)."""
    starts = np.flatnonzero(~joined) if len(joined) else np.zeros(0, I64)
    totals = np.asarray(nbytes, I64).copy()
    if len(starts):
        totals[starts] = np.add.reduceat(np.asarray(nbytes, I64), starts)
    return totals
