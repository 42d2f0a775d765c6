"""Reader assignment: exactly one reader per chunk, balancing each node's full-duplex NIC.

A full-duplex NIC's time is ``max(in, out) / bandwidth``, so inbound and outbound bytes are
two budgets, not one sum. A chunk of ``b`` bytes consumed on ``n_c`` nodes is received once
by every consumer node whoever reads it (by its read or by one push), so each node's
inbound bytes are fixed in advance: ``in0`` = bytes its workers consume (each byte once per
node). Only two things move with the reader choice:

* a consumer reader's node sends ``o = b * (n_c - 1)`` (one push per *other* consumer node;
  relays fan out on their own node, off the NIC);
* a non-consumer reader's node sends ``b * n_c`` and receives ``b`` more (into staging).

**Locality.** A read whose object sits in a segment on the reader's node (``home``) stays
on that node: it is not inbound NIC traffic (``in`` drops by ``b``).

Greedy longest-processing-time, chunks in decreasing ``b * n_c``. ``cost_max = max b * n_c``
over chunks (known before the loop), ``low`` = the least outbound load of any node. A
consumer node ``n`` *keeps the bound* if ``o == 0`` or ``out[n] + o <= max(in[n],
low + cost_max)`` (``in[n]``: ``in0`` less local reads so far, plus staging so far): sending
up to what the node receives anyway costs its NIC nothing. Among consumer nodes that keep
it, the consuming worker (GPU) with the least outbound bytes reads (ties: a worker on the
object's home node, then fewer bytes read, the less loaded node, the lowest index), so
each GPU's NIC balances too (choosing the node alone aliases equal-sized TP shards: node
``n`` read only rank ``n mod TP``'s shards). Only when no consumer node keeps the bound does
the node with the least outbound load (the home node among equals) read into staging and
relay; that node is never a consumer (the least-loaded consumer would keep the bound).

**Balance bound** (proof). For every node, ``out <= max(in0 + staged, mean(out) +
cost_max)``, where ``staged`` is what the node read into staging: the chunk that last
raised a node's ``out`` left it at most ``max(in0 + staged, low + cost_max)`` (a consumer
by the rule, since ``in`` never exceeds ``in0 + staged``; a non-consumer was the ``low``
node and added ``b * n_c <= cost_max``), and ``low`` never exceeds the final minimum, hence
the final mean. With ``in = in0 + staged - local reads``, every node's NIC time is at most
``max(in0 + staged, mean(out) + cost_max) / bandwidth``; when nothing is staged the first
term is the bytes the node must receive under any plan. Ranges are chunked so
``cost_max <= balance_slack * (mean in0)`` unless that would make chunks smaller than
``min_chunk_bytes``; chunks also never exceed ``batch_bytes`` (except a single row wider
than it). A contiguous range cut in several chunks is cut at its object's 4 MiB checksum
blocks (whole blocks per chunk, where they fit a batch), so every chunk's reader checks
what it reads; whole rows landing contiguously count as one contiguous range. A block that
several chunks share then goes to one of their readers (:mod:`.blocks`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from mooncake_rl.generations.checksums import BLOCK_BYTES
from mooncake_rl.plan import blocks, grid
from mooncake_rl.plan.merge import Ranges
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.topology import Topology

I64 = np.int64
READ_BITS = blocks.READ_BITS  # a worker's key packs (outbound bytes, bytes read) into one int


@dataclass(frozen=True, eq=False)
class Chunks:
    """Chunk ``j`` is rows ``dr..dr+rows`` x bytes ``dc..dc+cols`` of range ``range_[j]``."""

    range_: np.ndarray
    dr: np.ndarray
    rows: np.ndarray
    dc: np.ndarray
    cols: np.ndarray
    reader: np.ndarray
    max_cost: int  # max over chunks of bytes * consumer nodes: the balance-bound term


def assign_readers(
    ranges: Ranges, topology: Topology, params: PlanParams, homes: np.ndarray | None = None
) -> Chunks:
    """Chunk ranges and pick one reader per chunk (deterministic, see module docstring).

    ``homes``: node index of each object's segment (-1: not on a rollout node, or unknown).
    """
    node_of = np.array(topology.worker_node, I64)
    n_nodes = len(topology.nodes)
    n = len(ranges)
    cons_range = np.repeat(np.arange(n, dtype=I64), np.diff(ranges.ptr))
    rows, cols = _contiguous_as_one_row(ranges, cons_range)
    nbytes = rows * cols

    cons_node = node_of[ranges.worker]
    order = grid.lex_order(cons_range, cons_node, ranges.worker)
    g_first = grid.group_starts(cons_range[order], cons_node[order])
    g_start = np.flatnonzero(g_first)
    g_range = cons_range[order][g_start]
    g_node = cons_node[order][g_start]
    n_c = np.bincount(g_range, minlength=n).astype(I64)
    range_groups = np.searchsorted(g_range, np.arange(n + 1))
    in0 = np.bincount(g_node, nbytes[g_range], n_nodes)  # float64: exact below 2**53
    range_home = np.full(n, -1, I64) if homes is None else np.asarray(homes, I64)[ranges.obj]

    est_mean = max(1.0, float(in0.sum()) / n_nodes)
    cap = params.balance_slack * est_mean
    k_bal = np.ceil(nbytes * n_c / cap).astype(I64)
    k_small = np.maximum(1, nbytes // params.min_chunk_bytes)
    k = np.maximum(_ceil_div(nbytes, params.batch_bytes), np.minimum(k_bal, k_small))
    multi = rows > 1
    per_chunk_rows = np.where(
        multi,
        np.minimum(_ceil_div(rows, k), np.maximum(1, params.batch_bytes // cols)),
        1,
    )
    per_chunk_cols = np.where(
        multi, cols, _ceil_div(_ceil_div(cols, k), params.align) * params.align
    )
    # A contiguous range cut in several chunks is cut at its object's checksum blocks, so each
    # chunk's reader can check every byte it reads (``apply.verify``): chunks grow to whole
    # blocks, the first starting where the range does (``lead``: its offset into its block).
    whole_blocks = _ceil_div(per_chunk_cols, BLOCK_BYTES) * BLOCK_BYTES
    aligned = ~multi & (per_chunk_cols < cols) & (whole_blocks <= params.batch_bytes)
    lead = np.where(aligned, (ranges.r0 * ranges.pitch + ranges.c0) % BLOCK_BYTES, 0)
    per_chunk_cols = np.where(aligned, whole_blocks, per_chunk_cols)
    n_chunks = np.where(
        multi, _ceil_div(rows, per_chunk_rows), _ceil_div(cols + lead, per_chunk_cols)
    )
    owner, within = grid.expand_counts(n_chunks)
    dr = np.where(multi[owner], within * per_chunk_rows[owner], 0)
    c_end = np.minimum((within + 1) * per_chunk_cols[owner] - lead[owner], cols[owner])
    dc = np.where(multi[owner], 0, np.maximum(within * per_chunk_cols[owner] - lead[owner], 0))
    c_rows = np.where(multi[owner], np.minimum(per_chunk_rows[owner], rows[owner] - dr), 1)
    c_cols = np.where(multi[owner], cols[owner], c_end - dc)
    c_bytes = c_rows * c_cols
    cost = c_bytes * n_c[owner]
    max_cost = int(cost.max()) if len(owner) else 0
    lpt = grid.stable_order(max_cost - cost)  # decreasing cost, ties in chunk order

    workers_on: list[list[int]] = [[] for _ in range(n_nodes)]
    for w, node in enumerate(topology.worker_node):
        workers_on[node].append(w)
    g_bounds = np.append(g_start, len(order))
    g_workers = ranges.worker[order]
    g_single = np.where(np.diff(g_bounds) == 1, g_workers[g_start], -1)
    reader, out, inbound, worker_load = _greedy(
        _Loop(
            owner=owner.tolist(),
            c_bytes=c_bytes.tolist(),
            range_groups=range_groups.tolist(),
            range_home=range_home.tolist(),
            g_node=g_node.tolist(),
            g_bounds=g_bounds.tolist(),
            g_workers=g_workers.tolist(),
            g_single=g_single.tolist(),
            range_class=consumer_classes(g_single, range_groups, range_home).tolist(),
            workers_on=workers_on,
            in0=[int(x) for x in in0.tolist()],
            n_workers=len(topology.workers),
            max_cost=max_cost,
        ),
        lpt.tolist(),
    )
    # Where chunks share a checksum block, one of their readers takes all of it (blocks.py),
    # when a batch can hold a block.
    single = (c_rows == 1) & (params.batch_bytes >= BLOCK_BYTES)
    lo = (ranges.r0[owner] + dr) * ranges.pitch[owner] + ranges.c0[owner] + dc
    group = ranges.obj[owner]
    if params.pull == "node":  # each node reads its own copy: its blocks are its own
        group = group * n_nodes + cons_node[ranges.ptr[owner]]
    piece, p_lo, p_hi = blocks.cut_at_shared_blocks(lo, lo + c_cols, group, single)
    p_single = single[piece]
    tied = blocks.tie_readers(
        owner[piece],
        p_lo,
        p_hi,
        group[piece],
        np.array(reader, I64)[piece],
        p_single,
        blocks.Loads(
            out=out,
            inbound=inbound,
            worker_load=worker_load,
            bounds=range_groups.tolist(),
            node=g_node.tolist(),
            home=range_home.tolist(),
            worker_node=node_of.tolist(),
            cost_max=max_cost,
        ),
    )
    return Chunks(
        range_=owner[piece],
        dr=dr[piece],
        rows=c_rows[piece],
        dc=dc[piece] + p_lo - lo[piece],
        cols=np.where(p_single, p_hi - p_lo, c_cols[piece]),
        reader=tied,
        max_cost=max_cost,
    )


def _contiguous_as_one_row(ranges: Ranges, cons_range: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, bytes per row) of each range to chunk, a range of whole rows that every
    consumer lands contiguously taken as one row: its chunks are then cut at checksum
    blocks like any contiguous bytes, not at rows."""
    rows = ranges.r1 - ranges.r0
    cols = ranges.c1 - ranges.c0
    strided_dst = np.bincount(cons_range, ranges.dst_pitch != cols[cons_range], len(ranges)).astype(
        bool
    )
    whole = (rows > 1) & (ranges.c0 == 0) & (cols == ranges.pitch) & ~strided_dst
    return np.where(whole, 1, rows), np.where(whole, rows * cols, cols)


def _ceil_div(a, b):
    return -(-a // b)


def consumer_classes(
    g_single: np.ndarray, range_groups: np.ndarray, range_home: np.ndarray
) -> np.ndarray:
    """Number the ranges whose candidates are alike: the same consuming workers, one per
    consumer node, and no home node (-1: scanned one candidate at a time instead).

    A 1T MoE on 16 TP8 engines has 145k ranges but 8 classes (one per TP rank), so the
    greedy keeps one queue per class instead of visiting all 16 candidates of every chunk.
    Rows are hashed to one int each and then checked against their class's first row, so a
    hash collision costs an exact (slower) pass, never a wrong class.
    """
    n_c = np.diff(range_groups)  # every range has a consumer, so at least one group
    classes = np.full(len(n_c), -1, I64)
    if not len(n_c):
        return classes
    shared = np.add.reduceat((g_single < 0).astype(I64), range_groups[:-1])
    alike = (range_home < 0) & (shared == 0)
    numbered = 0
    for k in np.flatnonzero(np.bincount(n_c[alike])).tolist():
        ranges = np.flatnonzero(alike & (n_c == k))
        rows = g_single[range_groups[ranges][:, None] + np.arange(k, dtype=I64)]
        _, first, inverse = np.unique(rows @ _mix(k), return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        if not (rows == rows[first][inverse]).all():
            _, inverse = np.unique(rows, axis=0, return_inverse=True)
            inverse = inverse.reshape(-1)
        classes[ranges] = numbered + inverse
        numbered += int(inverse.max()) + 1
    return classes


def _mix(k: int) -> np.ndarray:
    """Odd multipliers that hash a row of ``k`` worker indices (wrapping int64 products)."""
    return np.random.default_rng(k).integers(1, 1 << 62, k, dtype=I64) | 1


@dataclass(frozen=True)
class _Loop:
    """What the greedy loop reads, as plain lists (it runs once per chunk)."""

    owner: list[int]
    c_bytes: list[int]
    range_groups: list[int]  # consumer-node groups of range r: range_groups[r]..[r+1]
    range_home: list[int]
    g_node: list[int]
    g_bounds: list[int]  # consuming workers of group g: g_workers[g_bounds[g]:g_bounds[g+1]]
    g_workers: list[int]
    g_single: list[int]  # the group's worker when it has one, else -1
    range_class: list[int]  # consumer_classes: ranges whose candidates share one queue
    workers_on: list[list[int]]
    in0: list[int]
    n_workers: int
    max_cost: int


def _greedy(loop: _Loop, lpt: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The LPT loop (see the module docstring for the rule and its bound): each chunk's
    reader, each node's outbound and inbound NIC bytes, and each worker's key.

    A chunk's candidates are its consumer nodes, ordered by the key ``(GPU key, not home,
    node out, node)``; the first that keeps the bound reads. Two ways to find it, with the
    same answer:

    - A range of a consumer class (:func:`consumer_classes`: no home, one worker per node)
      takes candidates from its class's queue, a heap of ``(GPU key, node out, node,
      worker)``. Keys only grow, so an entry whose values are out of date is refreshed when
      it reaches the top, and the top is then the least (a 1T MoE on 16 TP8 engines: 145k
      chunks in 0.2 s, against 0.46 s for visiting all 16 candidates of every chunk).
    - Any other range visits each consumer node, compares the key field by field rather
      than as a built tuple, and skips the ``min`` where a node has one consuming worker.
    """
    n_nodes = len(loop.in0)
    inbound = list(loop.in0)
    out = [0] * n_nodes
    wkey = [0] * loop.n_workers  # (outbound bytes << READ_BITS) + bytes read
    by_key = wkey.__getitem__
    heap = [(0, node) for node in range(n_nodes)]
    queues: dict[int, list[tuple[int, int, int, int]]] = {}
    reader = [0] * len(loop.owner)
    g_node, g_bounds, g_workers = loop.g_node, loop.g_bounds, loop.g_workers
    g_single = loop.g_single  # -1: the least-loaded of the group's workers reads
    owner, c_bytes, range_groups, range_home, range_class = (
        loop.owner,
        loop.c_bytes,
        loop.range_groups,
        loop.range_home,
        loop.range_class,
    )
    max_cost = loop.max_cost
    heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
    for j in lpt:
        r = owner[j]
        b = c_bytes[j]
        home = range_home[r]
        gs, ge = range_groups[r], range_groups[r + 1]
        o = b * (ge - gs - 1)
        while heap[0][0] != out[heap[0][1]]:
            heappop(heap)
        low, low_node = heap[0]
        limit = low + max_cost
        w = node = best_key = -1
        consumer_class = range_class[r]
        queue = queues.get(consumer_class) if consumer_class >= 0 else None
        if queue is None and consumer_class >= 0:  # the class's first chunk
            queue = queues[consumer_class] = [
                (wkey[g_single[g]], out[g_node[g]], g_node[g], g_single[g]) for g in range(gs, ge)
            ]
            heapq.heapify(queue)
        if queue is not None:
            refused = []  # candidates over the bound, back in the queue after the choice
            while queue:
                key, sent, candidate_node, candidate = queue[0]
                if key != wkey[candidate] or sent != out[candidate_node]:
                    heapreplace(
                        queue, (wkey[candidate], out[candidate_node], candidate_node, candidate)
                    )
                    continue
                sent += o
                if o and sent > limit and sent > inbound[candidate_node]:
                    refused.append(heappop(queue))
                    continue
                w, node = candidate, candidate_node
                break
            for entry in refused:
                heappush(queue, entry)
        else:
            for g in range(gs, ge):
                candidate_node = g_node[g]
                if o:
                    sent = out[candidate_node] + o
                    if sent > limit and sent > inbound[candidate_node]:
                        continue
                candidate = g_single[g]
                if candidate < 0:
                    candidate = min(g_workers[g_bounds[g] : g_bounds[g + 1]], key=by_key)
                key = wkey[candidate]
                if (
                    w < 0
                    or key < best_key
                    or (
                        key == best_key
                        and (candidate_node != home, out[candidate_node], candidate_node)
                        < (node != home, out[node], node)
                    )
                ):
                    w, node, best_key = candidate, candidate_node, key
        if w >= 0:
            if node == home:
                inbound[node] -= b  # read inside the node: off the NIC
        else:  # no consumer node keeps the bound: the least-loaded node reads and relays
            node = home if 0 <= home < n_nodes and out[home] == low else low_node
            o = b * (ge - gs)
            if node != home:
                inbound[node] += b
            w = min(loop.workers_on[node], key=by_key)
        reader[j] = w
        wkey[w] += (o << READ_BITS) + b
        if o:
            out[node] += o
            heappush(heap, (out[node], node))
    return reader, out, inbound, wkey
