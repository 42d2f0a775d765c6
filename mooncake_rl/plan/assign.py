"""Reader assignment: exactly one reader per chunk, balancing each node's NIC load.

A node's NIC load is the bytes its workers read from the Store plus the bytes they push to
other nodes (intra-node pushes are free). A chunk of ``b`` bytes consumed on ``n_c`` nodes
costs its reader's node ``b * n_c`` if the reader is on a consumer node (one read, one
push per *other* consumer node; relays fan out on their own node for free) and
``b * (n_c + 1)`` otherwise.

Greedy longest-processing-time: chunks in decreasing cost order. A chunk may go to any
consumer node that it would leave at most ``min_load + cost_max`` (``min_load`` over all
nodes, ``cost_max = max b * (n_c + 1)`` over all chunks, known before the loop); among
those, the consuming worker (GPU) with the least load so far reads it (ties: the less
loaded node, then the lowest index), so each GPU's NIC balances, not only each node's
(choosing the node alone aliases equal-sized TP shards: node ``n`` read only rank
``n mod TP``'s shards). When no consumer node qualifies, the least-loaded node reads into
staging and relays. **Balance bound** (proof): the chunk that last raised the maximum node
left it at most ``min_load + cost_max`` either way (a non-consumer adds ``b * (n_c + 1)``
to ``min_load``), so ``max <= mean + cost_max`` (loads only grow, the minimum never exceeds
the final mean). Ranges are chunked so ``cost_max <= balance_slack * (estimated mean)``
unless that would make chunks smaller than ``min_chunk_bytes``; chunks also never exceed
``batch_bytes`` (except a single row wider than it).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from mooncake_rl.plan import grid
from mooncake_rl.plan.merge import Ranges
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.topology import Topology

I64 = np.int64


@dataclass(frozen=True, eq=False)
class Chunks:
    """Chunk ``j`` is rows ``dr..dr+rows`` x bytes ``dc..dc+cols`` of range ``range_[j]``."""

    range_: np.ndarray
    dr: np.ndarray
    rows: np.ndarray
    dc: np.ndarray
    cols: np.ndarray
    reader: np.ndarray
    consumer_nodes: np.ndarray  # distinct consumer nodes of the chunk's range
    max_cost: int  # max over chunks of bytes * (consumer nodes + 1): the balance-bound term


def assign_readers(ranges: Ranges, topology: Topology, params: PlanParams) -> Chunks:
    """Chunk ranges and pick one reader per chunk (deterministic, see module docstring)."""
    node_of = np.array(topology.worker_node, I64)
    n_nodes = len(topology.nodes)
    n = len(ranges)
    rows = ranges.r1 - ranges.r0
    cols = ranges.c1 - ranges.c0
    nbytes = rows * cols

    cons_range = np.repeat(np.arange(n, dtype=I64), np.diff(ranges.ptr))
    cons_node = node_of[ranges.worker]
    order = np.lexsort((ranges.worker, cons_node, cons_range))
    g_first = grid.group_starts(cons_range[order], cons_node[order])
    g_start = np.flatnonzero(g_first)
    g_range = cons_range[order][g_start]
    g_node = cons_node[order][g_start]
    n_c = np.bincount(g_range, minlength=n).astype(I64)
    range_groups = np.searchsorted(g_range, np.arange(n + 1))

    est_mean = max(1.0, float((nbytes * n_c).sum()) / n_nodes)
    cap = params.balance_slack * est_mean
    k_bal = np.ceil(nbytes * (n_c + 1) / cap).astype(I64)
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
    n_chunks = np.where(multi, _ceil_div(rows, per_chunk_rows), _ceil_div(cols, per_chunk_cols))
    owner, within = grid.expand_counts(n_chunks)
    dr = np.where(multi[owner], within * per_chunk_rows[owner], 0)
    dc = np.where(multi[owner], 0, within * per_chunk_cols[owner])
    c_rows = np.where(multi[owner], np.minimum(per_chunk_rows[owner], rows[owner] - dr), 1)
    c_cols = np.where(
        multi[owner], cols[owner], np.minimum(per_chunk_cols[owner], cols[owner] - dc)
    )
    c_bytes = c_rows * c_cols
    cost = c_bytes * n_c[owner]
    lpt = np.lexsort((np.arange(len(owner)), -cost))

    max_cost = int((c_bytes * (n_c[owner] + 1)).max()) if len(owner) else 0
    workers_on: list[list[int]] = [[] for _ in range(n_nodes)]
    for w, node in enumerate(topology.worker_node):
        workers_on[node].append(w)
    reader = _greedy(
        lpt.tolist(),
        owner.tolist(),
        c_bytes.tolist(),
        range_groups.tolist(),
        g_node.tolist(),
        [*g_start.tolist(), len(order)],
        ranges.worker[order].tolist(),
        workers_on,
        n_nodes,
        len(topology.workers),
        max_cost,
    )
    return Chunks(
        range_=owner,
        dr=dr,
        rows=c_rows,
        dc=dc,
        cols=c_cols,
        reader=np.array(reader, I64),
        consumer_nodes=n_c[owner],
        max_cost=max_cost,
    )


def _ceil_div(a, b):
    return -(-a // b)


def _greedy(
    lpt,
    owner,
    c_bytes,
    range_groups,
    g_node,
    g_bounds,
    g_workers,
    workers_on,
    n_nodes,
    n_w,
    max_cost,
):
    """The LPT loop; plain lists because it runs once per chunk."""
    load = [0] * n_nodes
    wload = [0] * n_w
    heap = [(0, node) for node in range(n_nodes)]
    reader = [0] * len(owner)
    for j in lpt:
        r = owner[j]
        b = c_bytes[j]
        gs, ge = range_groups[r], range_groups[r + 1]
        cost = b * (ge - gs)
        while heap[0][0] != load[heap[0][1]]:
            heapq.heappop(heap)
        low, low_node = heap[0]
        # Consumer nodes this chunk leaves within cost_max of the least-loaded node keep the
        # balance bound; among them the least-loaded consuming GPU reads.
        best: tuple[int, int, int] | None = None  # (GPU load, node load, node)
        reader_of_best = -1
        for g in range(gs, ge):
            node = g_node[g]
            if load[node] + cost > low + max_cost:
                continue
            w = min(g_workers[g_bounds[g] : g_bounds[g + 1]], key=wload.__getitem__)
            key = (wload[w], load[node], node)
            if best is None or key < best:
                best, reader_of_best = key, w
        if best is None:  # every consumer node is busier: a non-consumer node reads and relays
            node, cost = low_node, cost + b
            w = min(workers_on[node], key=wload.__getitem__)
        else:
            w, node = reader_of_best, best[2]
        reader[j] = w
        wload[w] += cost
        load[node] += cost
        heapq.heappush(heap, (load[node], node))
    return reader
