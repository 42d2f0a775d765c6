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
than it).
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
READ_BITS = 64  # a worker's key packs (outbound bytes, bytes read) into one int


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
    rows = ranges.r1 - ranges.r0
    cols = ranges.c1 - ranges.c0
    nbytes = rows * cols

    cons_range = np.repeat(np.arange(n, dtype=I64), np.diff(ranges.ptr))
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
    max_cost = int(cost.max()) if len(owner) else 0
    lpt = grid.stable_order(max_cost - cost)  # decreasing cost, ties in chunk order

    workers_on: list[list[int]] = [[] for _ in range(n_nodes)]
    for w, node in enumerate(topology.worker_node):
        workers_on[node].append(w)
    g_bounds = np.append(g_start, len(order))
    g_workers = ranges.worker[order]
    reader = _greedy(
        _Loop(
            owner=owner.tolist(),
            c_bytes=c_bytes.tolist(),
            range_groups=range_groups.tolist(),
            range_home=range_home.tolist(),
            g_node=g_node.tolist(),
            g_bounds=g_bounds.tolist(),
            g_workers=g_workers.tolist(),
            g_single=np.where(np.diff(g_bounds) == 1, g_workers[g_start], -1).tolist(),
            workers_on=workers_on,
            in0=[int(x) for x in in0.tolist()],
            n_workers=len(topology.workers),
            max_cost=max_cost,
        ),
        lpt.tolist(),
    )
    return Chunks(
        range_=owner,
        dr=dr,
        rows=c_rows,
        dc=dc,
        cols=c_cols,
        reader=np.array(reader, I64),
        max_cost=max_cost,
    )


def _ceil_div(a, b):
    return -(-a // b)


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
    workers_on: list[list[int]]
    in0: list[int]
    n_workers: int
    max_cost: int


def _greedy(loop: _Loop, lpt: list[int]) -> list[int]:
    """The LPT loop (see the module docstring for the rule and its bound).

    It runs once per chunk over every consumer node (2M node visits for a 1T MoE on 16
    nodes), so the candidate key ``(GPU key, not home, node out, node)`` is compared field
    by field instead of built as a tuple, and a node's one consuming worker (a TP shard)
    skips the ``min``."""
    n_nodes = len(loop.in0)
    inbound = list(loop.in0)
    out = [0] * n_nodes
    wkey = [0] * loop.n_workers  # (outbound bytes << READ_BITS) + bytes read
    by_key = wkey.__getitem__
    heap = [(0, node) for node in range(n_nodes)]
    reader = [0] * len(loop.owner)
    g_node, g_bounds, g_workers = loop.g_node, loop.g_bounds, loop.g_workers
    g_single = loop.g_single  # -1: the least-loaded of the group's workers reads
    owner, c_bytes, range_groups, range_home = (
        loop.owner,
        loop.c_bytes,
        loop.range_groups,
        loop.range_home,
    )
    max_cost = loop.max_cost
    for j in lpt:
        r = owner[j]
        b = c_bytes[j]
        home = range_home[r]
        gs, ge = range_groups[r], range_groups[r + 1]
        o = b * (ge - gs - 1)
        while heap[0][0] != out[heap[0][1]]:
            heapq.heappop(heap)
        low, low_node = heap[0]
        limit = low + max_cost
        w = node = best_key = -1
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
            heapq.heappush(heap, (out[node], node))
    return reader
