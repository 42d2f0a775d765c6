"""Sieve reads: many small ranges of one object read as one span, then copied out locally.

Data flow: merged ranges -> runs of small, adjacent ranges consumed on one node -> one
*span* range per run (its consumers: every worker of the node that needs any of it, each
receiving the whole span into its ``staging`` region) + *local copies* from each consumer's
staging into the destinations the small ranges had.

Why: Mooncake charges per range (``bench.ops``: ~70-110 us a range over TCP), and a
tensor-parallel split of a pack's small tensors leaves each rank thousands of disjoint
ranges: rank 0's half of tensor 1 sits between rank 1's halves of tensors 0 and 1. Read one
by one, a 5,000-tensor pack costs each rank 5,000 ranges; sieved, it is one read per span
for the node, one push of each span per other consumer on the node (over its NVLink), and
one in-memory copy per piece. The Store still serves every byte once (the span is exactly
the union of its pieces), and a span cut at the checksum blocks (``BLOCK_BYTES``) lands a
whole block at its reader, which checks it before anything is pushed or copied.

What it costs: each consumer receives whole spans, up to TP times the bytes it keeps, over
its node's fabric, and holds them in staging until the update ends. Only pieces of at most
``SIEVE_PIECE_BYTES`` are sieved, so this is bounded by the node's small-tensor bytes.

Limits: a run is sieved only where all its consumers sit on one node (every range, with a
pull per node): a span relayed to another node would land there only in stage 2, and its
copies would need a third stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mooncake_rl.generations.checksums import BLOCK_BYTES
from mooncake_rl.plan import grid
from mooncake_rl.plan.merge import Ranges
from mooncake_rl.plan.params import PlanParams

I64 = np.int64
SIEVE_PIECE_BYTES = 64 << 10  # below this, a range costs more as an operation than as bytes
SIEVE_MIN_GAIN = 4  # pieces per consumer a run must have to be sieved
STAGING = 0  # region index of every worker's staging region (``demand.STAGING_REGION``)


@dataclass(frozen=True, eq=False)
class Sieved:
    """Ranges with sieved runs replaced by spans, and the copies that finish the spans.

    Copy ``k``: worker ``copy_worker[k]`` copies ``copy_length[k]`` bytes from offset
    ``copy_src[k]`` of its staging region into ``copy_region[k]`` at ``copy_dst[k]``.
    ``staging_bytes``: per worker, the staging the spans take (offsets ``0..`` of it).
    """

    ranges: Ranges
    copy_worker: np.ndarray
    copy_src: np.ndarray
    copy_region: np.ndarray
    copy_dst: np.ndarray
    copy_length: np.ndarray
    staging_bytes: np.ndarray

    @property
    def copies(self) -> int:
        return len(self.copy_worker)


def span_unit(params: PlanParams) -> int:
    """The span cut: a checksum block, unless chunks or batches are smaller (a span must
    stay one chunk and fit one batch, so its copies have one landing to come from)."""
    return min(BLOCK_BYTES, params.min_chunk_bytes, params.batch_bytes // 2)


def sieve(ranges: Ranges, worker_node: np.ndarray, params: PlanParams) -> Sieved:
    """Replace runs of small adjacent ranges by spans (module docstring); pure."""
    n_workers = len(worker_node)
    unit = span_unit(params)
    piece_limit = min(SIEVE_PIECE_BYTES, unit // 2)  # a span stays under 1.5 units
    none = _unchanged(ranges, n_workers)
    n = len(ranges)
    if n < 2 or unit < 2:
        return none
    rows, width = ranges.r1 - ranges.r0, ranges.c1 - ranges.c0
    nbytes = rows * width
    start = ranges.r0 * ranges.pitch + ranges.c0
    counts = np.diff(ranges.ptr)
    owner = np.repeat(np.arange(n, dtype=I64), counts)
    split_dst = (rows[owner] > 1) & (ranges.dst_pitch != width[owner])
    contiguous = ((rows == 1) | ((ranges.c0 == 0) & (ranges.c1 == ranges.pitch))) & (
        np.bincount(owner, split_dst, n) == 0
    )
    node = np.asarray(worker_node, I64)[ranges.worker]
    first = ranges.ptr[:-1]
    one_node = np.minimum.reduceat(node, first) == np.maximum.reduceat(node, first)
    cand = np.flatnonzero(contiguous & (nbytes <= piece_limit) & one_node)
    if len(cand) < 2:
        return none
    cand = cand[grid.lex_order(node[first[cand]], ranges.obj[cand], start[cand])]
    c_node, c_obj, c_start = node[first[cand]], ranges.obj[cand], start[cand]
    c_end = c_start + nbytes[cand]
    breaks = grid.group_starts(c_node, c_obj)
    breaks[1:] |= c_start[1:] != c_end[:-1]
    segment = np.cumsum(breaks) - 1
    # Worth it where a segment's pieces outnumber its consumers several times over: its
    # reads (one per piece) become about one read and one push per consumer and span.
    c_counts = counts[cand]
    s_owner, s_within = grid.expand_counts(c_counts)
    s_worker = ranges.worker[ranges.ptr[cand][s_owner] + s_within]
    consumers = np.bincount(
        np.unique(segment[s_owner] * n_workers + s_worker) // n_workers, minlength=segment[-1] + 1
    )
    many = np.bincount(segment) >= SIEVE_MIN_GAIN * consumers
    cand, segment = cand[many[segment]], segment[many[segment]]
    if not len(cand):
        return none
    c_obj, c_start = ranges.obj[cand], start[cand]
    c_end = c_start + nbytes[cand]

    # Parts: each piece cut where it crosses a unit boundary of its object (at most once:
    # a piece is at most half a unit), so every span is whole units where pieces are dense.
    cut = (c_end - 1) // unit * unit
    crosses = cut > c_start
    piece = np.repeat(np.arange(len(cand), dtype=I64), 1 + crosses)
    second = np.zeros(len(piece), bool)
    second[1:] = piece[1:] == piece[:-1]
    lo = np.where(second, cut[piece], c_start[piece])
    hi = np.where(crosses[piece] & ~second, cut[piece], c_end[piece])
    span_first = grid.group_starts(segment[piece], lo // unit)
    span = np.cumsum(span_first) - 1
    heads = np.flatnonzero(span_first)
    span_lo = lo[heads]
    span_hi = np.maximum.reduceat(hi, heads)
    span_obj = c_obj[piece[heads]]

    # Each part once per consumer of its range; each span once per consumer worker.
    r = cand[piece]
    p_owner, within = grid.expand_counts(counts[r])
    consumer = ranges.ptr[r[p_owner]] + within
    c_worker = ranges.worker[consumer]
    c_span = span[p_owner]
    pair_key = c_span * n_workers + c_worker
    pairs = np.unique(pair_key)
    pair_span, pair_worker = pairs // n_workers, pairs % n_workers
    size = span_hi[pair_span] - span_lo[pair_span]
    padded = -(-size // params.align) * params.align
    by_worker = grid.lex_order(pair_worker, pair_span)
    end = np.cumsum(padded[by_worker])
    w_first = grid.group_starts(pair_worker[by_worker])
    base = (end - padded[by_worker])[w_first][np.cumsum(w_first) - 1]
    offset = np.empty(len(pairs), I64)
    offset[by_worker] = end - padded[by_worker] - base
    staging = np.bincount(pair_worker, padded, n_workers).astype(I64)

    at = np.searchsorted(pairs, pair_key)
    copy_src = offset[at] + lo[p_owner] - span_lo[c_span]
    copy_dst = ranges.dst_offset[consumer] + lo[p_owner] - c_start[piece[p_owner]]
    copy_order = grid.lex_order(c_worker, c_span, lo[p_owner])

    # New ranges: the untouched ones and one per span, each span where its first piece was.
    sieved = np.zeros(n, bool)
    sieved[cand] = True
    kept = np.flatnonzero(~sieved)
    span_head = np.minimum.reduceat(r, heads)
    span_ptr = np.searchsorted(pair_span, np.arange(len(heads) + 1))
    order = grid.stable_order(np.concatenate([kept, span_head]))
    is_span = (np.arange(len(kept) + len(heads)) >= len(kept))[order]
    source = np.concatenate([kept, np.arange(len(heads), dtype=I64)])[order]
    k, s = np.where(is_span, 0, source), np.where(is_span, source, 0)
    entry_counts = np.where(is_span, np.diff(span_ptr)[s], counts[k])
    e, sub = grid.expand_counts(entry_counts)
    e_span = is_span[e]
    row = np.where(e_span, 0, ranges.ptr[k[e]] + sub)  # a consumer row of a kept range
    pair = np.where(e_span, span_ptr[s[e]] + sub, 0)  # a (span, worker) pair
    out = Ranges(
        obj=np.where(is_span, span_obj[s], ranges.obj[k]),
        r0=np.where(is_span, 0, ranges.r0[k]),
        r1=np.where(is_span, 1, ranges.r1[k]),
        c0=np.where(is_span, span_lo[s], ranges.c0[k]),
        c1=np.where(is_span, span_hi[s], ranges.c1[k]),
        pitch=np.where(is_span, span_hi[s], ranges.pitch[k]),
        ptr=np.concatenate([[0], np.cumsum(entry_counts)]).astype(I64),
        worker=np.where(e_span, pair_worker[pair], ranges.worker[row]),
        region=np.where(e_span, STAGING, ranges.region[row]),
        dst_offset=np.where(e_span, offset[pair], ranges.dst_offset[row]),
        dst_pitch=np.where(e_span, size[pair], ranges.dst_pitch[row]),
    )
    return Sieved(
        ranges=out,
        copy_worker=c_worker[copy_order],
        copy_src=copy_src[copy_order],
        copy_region=ranges.region[consumer][copy_order],
        copy_dst=copy_dst[copy_order],
        copy_length=(hi - lo)[p_owner][copy_order],
        staging_bytes=staging,
    )


def _unchanged(ranges: Ranges, n_workers: int) -> Sieved:
    empty = np.zeros(0, I64)
    return Sieved(ranges, empty, empty, empty, empty, empty, np.zeros(n_workers, I64))
