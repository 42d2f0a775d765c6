"""Tie each checksum block to one reader, so a block's bytes are checked before they move.

Data flow: chunks with readers (:mod:`.assign`) -> a chunk that enters or leaves a block
another chunk also touches is cut there -> each shared block's pieces go to one of their
readers, where that keeps the balance bound -> :mod:`.route`, which keeps one reader's
pieces of a block in one batch.

Why: a worker checks a 4 MiB block (``checksums.BLOCK_BYTES``) only when one batch of its
reads covers the block entirely (``apply.verify``). Range boundaries fall inside blocks
wherever two consumer sets meet: a TP row split of a tensor stored alone (rank 0's half
ends mid-block), tensors packed one after another, a replicated tensor next to a split
one. Read by two workers, such a block is never checked, and on a 4-worker, 2-node update
of 32 tensors that was 72 % of the bytes read. Read by one, its reader checks all of it,
lands its own part and pushes the others theirs, as it pushes any chunk.

Only single-row chunks take part (contiguous bytes of the object): a strided chunk (rows
of a column shard) reads a different slice of every row a block holds, and stays as it
was. Blocks are cut every ``BLOCK_BYTES`` from the object's start; a rank-major pack's
blocks are cut at its rank runs too (``pack_order``), which only splits these cells, so a
cell read whole is a block read whole.

**The bound holds.** A cell's pieces move only to a reader on a node that consumes every
one of them, so no node receives a byte it does not consume and the total sent stays as
the greedy left it (each piece still leaves its reader's node once per other consumer
node). The move is made only where the candidate's node then sends at most
``max(in, mean(out) + cost_max)``, ``assign``'s bound, which the nodes that lose pieces
keep too; a cell no candidate can take keeps its readers and is left unchecked. Pieces
of one cell are at most one block, so the table grows by at most two records per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mooncake_rl.generations.checksums import BLOCK_BYTES
from mooncake_rl.plan import grid

I64 = np.int64
READ_BITS = 64  # a worker's load packs (outbound bytes, bytes read) into one int


@dataclass(frozen=True, eq=False)
class Loads:
    """What ``assign``'s greedy left: each node's outbound and inbound NIC bytes, and the
    per-range facts a move needs (consumer nodes ``node[bounds[r]:bounds[r + 1]]``,
    sorted; the object's home node, -1 for none)."""

    out: list[int]
    inbound: list[int]
    worker_load: list[int]
    """Per worker: (bytes it sends << 64) + bytes it reads, the greedy's GPU key."""
    bounds: list[int]
    node: list[int]
    home: list[int]
    worker_node: list[int]
    cost_max: int


def cut_at_shared_blocks(
    chunk_lo: np.ndarray, chunk_hi: np.ndarray, group: np.ndarray, single: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chunk, lo, hi) of every piece: ``single`` chunks cut where they enter or leave a
    block cell (``group``: the object, and the node with a pull per node) that another
    single chunk touches; other chunks whole. Pure."""
    head = chunk_lo // BLOCK_BYTES
    tail = (chunk_hi - 1) // BLOCK_BYTES
    shared_head, shared_tail = _shared(group, head, tail, single)
    spans = single & (tail > head)
    cut_head = spans & shared_head & (chunk_lo % BLOCK_BYTES != 0)
    cut_tail = spans & shared_tail & (chunk_hi % BLOCK_BYTES != 0)
    first_cut = (head + 1) * BLOCK_BYTES
    last_cut = tail * BLOCK_BYTES
    # Boundaries per chunk: lo, the head cut, the tail cut (unless it is the head cut), hi.
    bounds = np.stack([chunk_lo, first_cut, last_cut, chunk_hi], axis=1)
    keep = np.stack(
        [
            np.ones(len(chunk_lo), bool),
            cut_head,
            cut_tail & ~(cut_head & (last_cut == first_cut)),
            np.ones(len(chunk_lo), bool),
        ],
        axis=1,
    )
    flat = bounds[keep]
    owner = np.repeat(np.arange(len(chunk_lo), dtype=I64), keep.sum(axis=1))
    starts = np.flatnonzero(owner[1:] == owner[:-1])  # consecutive bounds of one chunk
    return owner[starts], flat[starts], flat[starts + 1]


def _shared(group, head, tail, single) -> tuple[np.ndarray, np.ndarray]:
    """Whether each chunk's head cell and tail cell are touched by another single chunk."""
    n = len(head)
    two = tail != head
    who = np.concatenate([np.arange(n, dtype=I64), np.flatnonzero(two)])
    cell = np.concatenate([head, tail[two]])
    grp = group[who]
    on = single[who]
    who, cell, grp = who[on], cell[on], grp[on]
    order = grid.lex_order(grp, cell)
    first = grid.group_starts(grp[order], cell[order])
    run = np.cumsum(first) - 1
    many = (np.bincount(run) > 1)[run]
    marked = np.zeros(len(who), bool)
    marked[order] = many
    shared_head = np.zeros(n, bool)
    shared_tail = np.zeros(n, bool)
    is_head = cell == head[who]
    shared_head[who[is_head & marked]] = True
    shared_tail[who[(cell == tail[who]) & marked]] = True
    return shared_head, shared_tail


def tie_readers(
    range_of: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    group: np.ndarray,
    reader: np.ndarray,
    single: np.ndarray,
    loads: Loads,
) -> np.ndarray:
    """Readers after giving each block cell's single-row pieces to one of their readers
    (the least loaded GPU first, as ``assign`` picks) where that keeps the bound (module
    docstring); the cell's pieces lie within it (:func:`cut_at_shared_blocks`)."""
    inside = single & ((hi - 1) // BLOCK_BYTES == lo // BLOCK_BYTES)
    idx = np.flatnonzero(inside)
    cell = lo[idx] // BLOCK_BYTES
    order = grid.lex_order(group[idx], cell)
    idx, cell = idx[order], cell[order]
    first = np.flatnonzero(grid.group_starts(group[idx], cell))
    ends = np.append(first[1:], len(idx))
    mixed = (
        np.flatnonzero(
            np.minimum.reduceat(reader[idx], first) != np.maximum.reduceat(reader[idx], first)
        )
        if len(idx)
        else np.zeros(0, I64)
    )
    out, inbound, load = list(loads.out), list(loads.inbound), list(loads.worker_load)
    mean = sum(out) / len(out)  # moves between consumer nodes keep the total sent
    nbytes = (hi - lo).tolist()
    ranges = range_of.tolist()
    readers = reader.tolist()
    node_of, home = loads.worker_node, loads.home
    for c in mixed.tolist():
        pieces = idx[first[c] : ends[c]].tolist()
        for w in sorted({readers[p] for p in pieces}, key=lambda w: (_nic_bytes(load[w]), w)):
            node = node_of[w]
            moved = [p for p in pieces if readers[p] != w]
            if any(node not in _consumer_nodes(loads, ranges[p]) for p in moved):
                continue  # its node would receive bytes it does not consume
            arriving = [p for p in moved if node_of[readers[p]] != node]
            sent = out[node] + sum(_sends(loads, ranges[p], nbytes[p]) for p in arriving)
            local = sum(nbytes[p] for p in arriving if home[ranges[p]] == node)
            if sent > out[node] and sent > max(inbound[node] - local, mean + loads.cost_max):
                continue
            for p in moved:
                was, b = node_of[readers[p]], nbytes[p]
                o = _sends(loads, ranges[p], b)
                if was != node:
                    out[was] -= o
                    out[node] += o
                    inbound[was] += b if home[ranges[p]] == was else 0
                    inbound[node] -= b if home[ranges[p]] == node else 0
                load[readers[p]] -= (o << READ_BITS) + b
                load[w] += (o << READ_BITS) + b
                readers[p] = w
            break
    return np.array(readers, I64)


def _consumer_nodes(loads: Loads, range_: int) -> list[int]:
    return loads.node[loads.bounds[range_] : loads.bounds[range_ + 1]]


def _sends(loads: Loads, range_: int, nbytes: int) -> int:
    """Bytes a consumer node of range ``range_`` sends when one of its workers reads
    ``nbytes`` of it: one push to every other consumer node (``assign``'s accounting)."""
    return nbytes * (len(_consumer_nodes(loads, range_)) - 1)


def _nic_bytes(load: int) -> int:
    """A worker's reads plus sends, from its packed load: what its own NIC carries."""
    return (load >> READ_BITS) + (load & ((1 << READ_BITS) - 1))
