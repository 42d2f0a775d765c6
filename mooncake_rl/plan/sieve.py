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
    none = _unchanged(ranges, n_workers)
    if len(ranges) < 2 or unit < 2:
        return none
    cand, segment = _runs(ranges, np.asarray(worker_node, I64), min(SIEVE_PIECE_BYTES, unit // 2))
    if not len(cand):
        return none
    start = ranges.r0 * ranges.pitch + ranges.c0
    c_start = start[cand]
    c_end = c_start + (ranges.r1 - ranges.r0)[cand] * (ranges.c1 - ranges.c0)[cand]

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
    span_lo, span_hi = lo[heads], np.maximum.reduceat(hi, heads)

    # Each part once per consumer of its range; each span once per consumer worker.
    r = cand[piece]
    p_owner, within = grid.expand_counts(np.diff(ranges.ptr)[r])
    consumer = ranges.ptr[r[p_owner]] + within
    c_worker, c_span = ranges.worker[consumer], span[p_owner]
    pair_key = c_span * n_workers + c_worker
    pairs = np.unique(pair_key)
    pair_span, pair_worker = pairs // n_workers, pairs % n_workers
    size = span_hi[pair_span] - span_lo[pair_span]
    offset, staging = _staging(pair_worker, pair_span, size, params.align, n_workers)

    at = np.searchsorted(pairs, pair_key)
    order = grid.lex_order(c_worker, c_span, lo[p_owner])
    spans = _Spans(
        ranges.obj[r[heads]],
        span_lo,
        span_hi,
        np.minimum.reduceat(r, heads),
        np.searchsorted(pair_span, np.arange(len(heads) + 1)),
        pair_worker,
        offset,
        size,
    )
    return Sieved(
        ranges=_with_spans(ranges, cand, spans),
        copy_worker=c_worker[order],
        copy_src=(offset[at] + lo[p_owner] - span_lo[c_span])[order],
        copy_region=ranges.region[consumer][order],
        copy_dst=(ranges.dst_offset[consumer] + lo[p_owner] - c_start[piece[p_owner]])[order],
        copy_length=(hi - lo)[p_owner][order],
        staging_bytes=staging,
    )


def _runs(ranges: Ranges, worker_node: np.ndarray, piece_limit: int):
    """The ranges to sieve, sorted by (node, object, offset), and the run each is in: small
    ranges contiguous on both sides, consumed on one node, following one another in one
    object, in runs whose pieces outnumber their consumers ``SIEVE_MIN_GAIN`` times (one read
    per piece becomes about one read and one push per consumer and span)."""
    n, n_workers = len(ranges), len(worker_node)
    rows, width = ranges.r1 - ranges.r0, ranges.c1 - ranges.c0
    nbytes, start = rows * width, ranges.r0 * ranges.pitch + ranges.c0
    counts = np.diff(ranges.ptr)
    owner = np.repeat(np.arange(n, dtype=I64), counts)
    split_dst = (rows[owner] > 1) & (ranges.dst_pitch != width[owner])
    contiguous = ((rows == 1) | ((ranges.c0 == 0) & (ranges.c1 == ranges.pitch))) & (
        np.bincount(owner, split_dst, n) == 0
    )
    node, first = worker_node[ranges.worker], ranges.ptr[:-1]
    one_node = np.minimum.reduceat(node, first) == np.maximum.reduceat(node, first)
    cand = np.flatnonzero(contiguous & (nbytes <= piece_limit) & one_node)
    if len(cand) < 2:
        return cand[:0], cand[:0]
    cand = cand[grid.lex_order(node[first[cand]], ranges.obj[cand], start[cand])]
    c_start = start[cand]
    breaks = grid.group_starts(node[first[cand]], ranges.obj[cand])
    breaks[1:] |= c_start[1:] != (c_start + nbytes[cand])[:-1]
    segment = np.cumsum(breaks) - 1
    s_owner, s_within = grid.expand_counts(counts[cand])
    s_worker = ranges.worker[ranges.ptr[cand][s_owner] + s_within]
    consumers = _consumers(segment, s_owner, s_worker, n_workers)
    # A run whose consumers each take one block of it (a rank-major pack, ``pack_order``)
    # is one run per consumer: each reads its own bytes, and nothing is pushed.
    first_worker = ranges.worker[ranges.ptr[cand]]
    turns = np.zeros(len(cand), bool)
    turns[1:] = (first_worker[1:] != first_worker[:-1]) & (segment[1:] == segment[:-1])
    blocked = np.bincount(segment, turns, len(consumers)) == consumers - 1
    if (turns & blocked[segment]).any():
        segment = np.cumsum(breaks | (turns & blocked[segment])) - 1
        consumers = _consumers(segment, s_owner, s_worker, n_workers)
    many = (np.bincount(segment) >= SIEVE_MIN_GAIN * consumers)[segment]
    return cand[many], segment[many]


def _consumers(segment, s_owner, s_worker, n_workers: int) -> np.ndarray:
    """How many workers consume each run's ranges."""
    pairs = np.unique(segment[s_owner] * n_workers + s_worker)
    return np.bincount(pairs // n_workers, minlength=segment[-1] + 1)


def _staging(pair_worker, pair_span, size, align: int, n_workers: int):
    """Each (span, worker) pair's offset in the worker's staging, spans back to back in
    span order, ``align``-byte aligned; and each worker's staging bytes."""
    padded = -(-size // align) * align
    by_worker = grid.lex_order(pair_worker, pair_span)
    end = np.cumsum(padded[by_worker])
    w_first = grid.group_starts(pair_worker[by_worker])
    base = (end - padded[by_worker])[w_first][np.cumsum(w_first) - 1]
    offset = np.empty(len(pair_worker), I64)
    offset[by_worker] = end - padded[by_worker] - base
    return offset, np.bincount(pair_worker, padded, n_workers).astype(I64)


@dataclass(frozen=True, eq=False)
class _Spans:
    """Span ``s``: bytes ``lo..hi`` of object ``obj``, placed where range ``head`` was;
    its consumers are pairs ``ptr[s]..ptr[s+1]`` (``worker``, staging ``offset``, ``size``)."""

    obj: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    head: np.ndarray
    ptr: np.ndarray
    worker: np.ndarray
    offset: np.ndarray
    size: np.ndarray


def _with_spans(ranges: Ranges, sieved: np.ndarray, spans: _Spans) -> Ranges:
    """``ranges`` less the ``sieved`` ones, plus one single-row range per span (consumers:
    its workers, each into its staging), each span where its first piece was."""
    counts = np.diff(ranges.ptr)
    taken = np.zeros(len(ranges), bool)
    taken[sieved] = True
    kept = np.flatnonzero(~taken)
    n_spans = len(spans.head)
    order = grid.stable_order(np.concatenate([kept, spans.head]))
    is_span = (np.arange(len(kept) + n_spans) >= len(kept))[order]
    source = np.concatenate([kept, np.arange(n_spans, dtype=I64)])[order]
    k, s = np.where(is_span, 0, source), np.where(is_span, source, 0)
    entry_counts = np.where(is_span, np.diff(spans.ptr)[s], counts[k])
    e, sub = grid.expand_counts(entry_counts)
    e_span = is_span[e]
    row = np.where(e_span, 0, ranges.ptr[k[e]] + sub)  # a consumer row of a kept range
    pair = np.where(e_span, spans.ptr[s[e]] + sub, 0)  # a (span, worker) pair
    return Ranges(
        obj=np.where(is_span, spans.obj[s], ranges.obj[k]),
        r0=np.where(is_span, 0, ranges.r0[k]),
        r1=np.where(is_span, 1, ranges.r1[k]),
        c0=np.where(is_span, spans.lo[s], ranges.c0[k]),
        c1=np.where(is_span, spans.hi[s], ranges.c1[k]),
        pitch=np.where(is_span, spans.hi[s], ranges.pitch[k]),
        ptr=np.concatenate([[0], np.cumsum(entry_counts)]).astype(I64),
        worker=np.where(e_span, spans.worker[pair], ranges.worker[row]),
        region=np.where(e_span, STAGING, ranges.region[row]),
        dst_offset=np.where(e_span, spans.offset[pair], ranges.dst_offset[row]),
        dst_pitch=np.where(e_span, spans.size[pair], ranges.dst_pitch[row]),
    )


def _unchanged(ranges: Ranges, n_workers: int) -> Sieved:
    empty = np.zeros(0, I64)
    return Sieved(ranges, empty, empty, empty, empty, empty, np.zeros(n_workers, I64))
