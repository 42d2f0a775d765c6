"""Vectorized set algebra on strided byte patterns.

Every byte set the planner handles is a *strided run*: ``count`` rows of ``length`` bytes,
row ``k`` starting at ``offset + k * stride`` (``stride >= length`` when ``count > 1``).
A tensor-parallel row shard of a row-major tensor is one such run; lowering it to one byte
range per row would cost millions of Python objects for a 70B model. Instead each *space*
(a Store object, or one destination region of one worker) gets a pitch ``P`` and every run
becomes at most three rectangles ``rows [r0, r1) x cols [c0, c1)`` of the grid where byte
``x`` sits at ``(x // P, x % P)``. Unions, overlaps and the partition into elementary
pieces are then sweeps over sorted numpy arrays, never per-byte or per-row Python.

The pitch of a space is its most common stride among multi-row runs (ties: the smallest);
runs with another stride, or rows that wrap past the pitch, are split into rows first. A
space with no multi-row run uses its extent as pitch, so everything in it is one row.

Each rectangle remembers where its first byte sits inside the run that produced it
(``member``, run row ``k0``, byte ``j0`` within that row) and whether moving down one grid
row moves to the next run row (``strided``) or ``P`` bytes further inside the same run row.
Callers use that to carry per-run mappings (for example the destination address) through
every split without re-deriving them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan.cpu import vectorized_sort_is_slow

I64 = np.int64


def as_i64(values: object) -> np.ndarray:
    """A 1-D int64 copy-free view when possible."""
    return np.ascontiguousarray(np.asarray(values, dtype=I64).reshape(-1))


def expand_counts(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``counts`` per item: (item index, index within item) for every expanded element."""
    counts = as_i64(counts)
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(counts), dtype=I64), counts)
    starts = np.cumsum(counts) - counts
    within = np.arange(total, dtype=I64) - starts[owner]
    return owner, within


def group_starts(*keys: np.ndarray) -> np.ndarray:
    """Boolean mask marking the first element of each run of equal keys (already sorted)."""
    n = len(keys[0])
    first = np.zeros(n, dtype=bool)
    if n:
        first[0] = True
        for key in keys:
            first[1:] |= key[1:] != key[:-1]
    return first


def packed_key(*columns: np.ndarray) -> np.ndarray | None:
    """One int64 per row ordered like the rows of the non-negative ``columns``, or None.

    None means the packed value could overflow; callers then fall back to ``np.lexsort``.
    A single-key sort is several times faster than a multi-key lexsort.
    """
    span = 1
    highs = [int(c.max()) + 1 if len(c) else 1 for c in columns]
    for high in highs:
        span *= high
    if span >= 1 << 62 or any(len(c) and int(c.min()) < 0 for c in columns):
        return None
    key = np.zeros(len(columns[0]), dtype=I64)
    for column, high in zip(columns, highs, strict=True):
        key = key * I64(high) + column
    return key


def stable_order(key: np.ndarray, *, merge: bool | None = None) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` of an integer array, 2-20x faster.

    Keys already in order (a plan's columns often are) cost one comparison pass. Otherwise
    rows are sorted as packed ``(key, index)`` values, all distinct, so any sort gives
    exactly the stable order. ``merge`` picks the sort: numpy's timsort, which merges the
    ordered runs it finds (a plan's keys are mostly ordered runs), or its vectorized
    quicksort. ``None`` picks per CPU: the quicksort, except where it is the slow one
    (:mod:`mooncake_rl.plan.cpu`; there the timsort is 1.3-3x faster on a plan's keys). When
    ``key - min`` leaves no room for the index in 63 bits, the timsort sorts the keys
    indirectly; the quicksort first ranks them densely (ranks are at most ``len(key)``).
    """
    n = len(key)
    if not n:
        return np.zeros(0, I64)
    if not (key[1:] < key[:-1]).any():
        return np.arange(n, dtype=I64)
    if merge is None:
        merge = vectorized_sort_is_slow()
    low, high = int(key.min()), int(key.max())
    bits = max(n - 1, 1).bit_length()
    mask = I64((1 << bits) - 1)
    if bits > 31:  # ranks and indices would not fit together
        return np.argsort(key, kind="stable")
    if (high - low) >> (63 - bits):
        if merge:
            return np.argsort(key, kind="stable")
        order = np.argsort(key)
        packed = np.cumsum(group_starts(key[order]), dtype=I64)
        packed <<= bits
        packed |= order
    else:
        packed = key.astype(I64)
        packed -= low
        packed <<= bits
        packed |= np.arange(n, dtype=I64)
    packed.sort(kind="stable" if merge else None)
    packed &= mask
    return packed


def unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(values, return_index=True, return_inverse=True)`` of an integer array:
    (sorted distinct values, index of each one's first occurrence, rank of every value)."""
    order = stable_order(values)
    ordered = values[order]
    first = group_starts(ordered)
    rank = np.empty(len(values), I64)
    rank[order] = np.cumsum(first) - 1
    return ordered[first], order[first], rank


def lex_order(*columns: np.ndarray) -> np.ndarray:
    """Stable argsort by ``columns`` (first column most significant)."""
    key = packed_key(*columns)
    if key is None:
        return np.lexsort(columns[::-1])
    return stable_order(key)


def dense_pair_keys(major: np.ndarray, minor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rank (major, minor) pairs lexicographically.

    Returns the sorted unique pair index of every input pair and, for each unique pair,
    the index of one input that produced it. Ranks are dense, so they never overflow.
    """
    combined = packed_key(major, minor)
    if combined is None:  # rank both sides first; ranks are < len(input)
        major_rank = unique_inverse(major)[2]
        minor_values, _, minor_rank = unique_inverse(minor)
        combined = major_rank * I64(len(minor_values)) + minor_rank
    _, first, inverse = unique_inverse(combined)
    return inverse, first


def search(
    sorted_values: np.ndarray,
    queries: np.ndarray,
    side: str = "left",
    order: np.ndarray | None = None,
) -> np.ndarray:
    """``np.searchsorted`` with the queries visited in sorted order: millions of scattered
    queries into millions of values otherwise miss the cache on every probe (10x slower).
    ``order``: one that sorts ``queries``, when the caller has it already."""
    if order is None and len(queries) < 1 << 14:
        return np.searchsorted(sorted_values, queries, side=side)
    if order is None:
        order = stable_order(queries)
    out = np.empty(len(queries), I64)
    out[order] = np.searchsorted(sorted_values, queries[order], side=side)
    return out


def _pair_keys(
    ref_major: np.ndarray, ref_minor: np.ndarray, q_major: np.ndarray, q_minor: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One int64 per (major, minor) pair of both sets, ordered like the pairs: packed in
    place when it fits (no concatenated copy of millions of rows), else dense ranks."""
    columns = (ref_major, ref_minor, q_major, q_minor)
    if all(len(c) for c in columns) and min(int(c.min()) for c in columns) >= 0:
        high = max(int(ref_minor.max()), int(q_minor.max())) + 1
        if (max(int(ref_major.max()), int(q_major.max())) + 1) * high < 1 << 62:
            return ref_major * I64(high) + ref_minor, q_major * I64(high) + q_minor
    major = np.concatenate([ref_major, q_major])
    key = packed_key(major, np.concatenate([ref_minor, q_minor]))
    if key is None:
        key = dense_pair_keys(major, np.concatenate([ref_minor, q_minor]))[0]
    return key[: len(ref_major)], key[len(ref_major) :]


def at_or_before(
    ref_major: np.ndarray,
    ref_minor: np.ndarray,
    q_major: np.ndarray,
    q_minor: np.ndarray,
    *,
    ref_order: np.ndarray | None = None,
    query_order: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """For each query pair: the reference with the greatest pair <= it (-1 if none), and
    whether the pairs are equal. References with equal pairs: the last one wins.

    ``ref_order`` (the stable order of the reference pairs, ``lex_order(ref_major,
    ref_minor)``) and ``query_order`` (any order sorting the query pairs) save their sorts
    where the caller has them already."""
    n = len(ref_major)
    ref, query = _pair_keys(*map(as_i64, (ref_major, ref_minor, q_major, q_minor)))
    order = stable_order(ref) if ref_order is None else ref_order
    pos = search(ref[order], query, side="right", order=query_order) - 1
    found = np.where(pos >= 0, order[np.maximum(pos, 0)], -1)
    exact = (found >= 0) & (ref[np.maximum(found, 0)] == query) if n else found >= 0
    return found, exact


@dataclass(frozen=True)
class Rects:
    """Rectangles of strided runs on per-space grids (see module docstring)."""

    space: np.ndarray  # dense space index
    r0: np.ndarray
    r1: np.ndarray
    c0: np.ndarray
    c1: np.ndarray
    member: np.ndarray  # index of the input run
    k0: np.ndarray  # run row of the first byte
    j0: np.ndarray  # byte within that run row
    strided: np.ndarray  # bool: one grid row down == one run row down
    pitch: np.ndarray  # per dense space

    def __len__(self) -> int:
        return len(self.space)


def check_runs(offset: np.ndarray, length: np.ndarray, count: np.ndarray, stride: np.ndarray):
    """Reject malformed runs before any geometry is derived from them."""
    if len(offset) and (
        (length <= 0).any()
        or (count <= 0).any()
        or (offset < 0).any()
        or ((count > 1) & (stride < length)).any()
    ):
        bad = np.flatnonzero(
            (length <= 0) | (count <= 0) | (offset < 0) | ((count > 1) & (stride < length))
        )[0]
        raise InvariantViolation(
            f"malformed strided run #{bad}: offset={offset[bad]} length={length[bad]} "
            f"count={count[bad]} stride={stride[bad]}"
        )


def run_ends(offset: np.ndarray, length: np.ndarray, count: np.ndarray, stride: np.ndarray):
    """One past the last byte of each run."""
    return offset + (count - 1) * np.where(count > 1, stride, 0) + length


def to_rects(
    space: np.ndarray,
    offset: np.ndarray,
    length: np.ndarray,
    count: np.ndarray,
    stride: np.ndarray,
) -> tuple[Rects, np.ndarray]:
    """Lay strided runs out as grid rectangles; also returns the distinct space ids."""
    space, offset, length, count, stride = map(as_i64, (space, offset, length, count, stride))
    check_runs(offset, length, count, stride)
    spaces, _, sidx = unique_inverse(space)
    ends = run_ends(offset, length, count, stride)
    extent = np.zeros(len(spaces), dtype=I64)
    np.maximum.at(extent, sidx, ends)
    pitch = extent.copy()
    multi = count > 1
    if multi.any():
        pair, first = dense_pair_keys(sidx[multi], stride[multi])
        votes = np.bincount(pair)
        pair_space = sidx[multi][first]
        pair_stride = stride[multi][first]
        order = np.lexsort((pair_stride, -votes, pair_space))
        chosen = order[group_starts(pair_space[order])]
        pitch[pair_space[chosen]] = pair_stride[chosen]
    p = pitch[sidx]
    phase = offset % p
    conform = multi & (stride == p) & (phase + length <= p)

    # Conforming multi-row runs: one rectangle each.
    ci = np.flatnonzero(conform)
    parts = [
        (
            sidx[ci],
            offset[ci] // p[ci],
            offset[ci] // p[ci] + count[ci],
            phase[ci],
            phase[ci] + length[ci],
            ci,
            np.zeros(len(ci), I64),
            np.zeros(len(ci), I64),
            np.ones(len(ci), bool),
        )
    ]
    # Everything else becomes contiguous rows: run row k of member m.
    single = np.flatnonzero(~conform)
    rep_counts = np.where(multi[single], count[single], 1)
    owner, k = expand_counts(rep_counts)
    m = single[owner]
    start = offset[m] + k * np.where(count[m] > 1, stride[m], 0)
    parts.append(_contiguous_rects(sidx[m], start, length[m], pitch[sidx[m]], m, k))
    cols = [np.concatenate(col) for col in zip(*parts, strict=True)]
    return Rects(*cols, pitch=pitch), spaces


def _contiguous_rects(space, start, length, p, member, k):
    """Split contiguous ranges into a head row, a block of full rows and a tail row."""
    end = start + length
    ra, ca = start // p, start % p
    rb, cb = end // p, end % p
    same_row = ra == rb
    pieces = []
    # Single-row ranges.
    s = same_row
    pieces.append((s, ra, ra + 1, ca, cb, np.zeros_like(ca)))
    # Head: partial first row.
    h = ~same_row & (ca > 0)
    pieces.append((h, ra, ra + 1, ca, p, np.zeros_like(ca)))
    # Body: full rows.
    body_r0 = ra + (ca > 0)
    b = ~same_row & (rb > body_r0)
    pieces.append((b, body_r0, rb, np.zeros_like(ca), p, np.where(ca > 0, p - ca, 0)))
    # Tail: partial last row.
    t = ~same_row & (cb > 0)
    pieces.append((t, rb, rb + 1, np.zeros_like(ca), cb, (rb - ra) * p - ca))
    out = []
    for mask, r0, r1, c0, c1, j0 in pieces:
        idx = np.flatnonzero(mask)
        out.append(
            (
                space[idx],
                r0[idx],
                r1[idx],
                c0[idx],
                c1[idx],
                member[idx],
                k[idx],
                j0[idx],
                np.zeros(len(idx), bool),
            )
        )
    return tuple(np.concatenate(col) for col in zip(*out, strict=True))


@dataclass(frozen=True)
class Lanes:
    """Rectangles cut at every row breakpoint of their space: within a lane all share rows."""

    lane: np.ndarray  # lane id: index of the lane's first row breakpoint (space, row order)
    c0: np.ndarray
    c1: np.ndarray
    rect: np.ndarray  # index into the Rects this came from
    k0: np.ndarray
    j0: np.ndarray
    # Per breakpoint id; rows lane_r0..lane_r1 are meaningful only for ids that are lanes.
    lane_space: np.ndarray
    lane_r0: np.ndarray
    lane_r1: np.ndarray


def cut_at_breakpoints(
    group: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut each interval ``[lo, hi)`` of its ``group`` at every bound of every interval of
    that group: ``(owner, piece, bp_group, bp_value)``, where piece ``i`` of interval
    ``owner[i]`` starts at breakpoint ``piece[i]`` (``bp_group``/``bp_value`` per breakpoint,
    sorted; a piece ends at the next breakpoint)."""
    n = len(group)
    both_group = np.concatenate([group, group])
    both_value = np.concatenate([lo, hi])
    key, first = dense_pair_keys(both_group, both_value)
    k_start, k_end = key[:n], key[n:]
    owner, within = expand_counts(k_end - k_start)
    return owner, k_start[owner] + within, both_group[first], both_value[first]


def to_lanes(rects: Rects) -> Lanes:
    """Cut rectangles so that rectangles sharing a lane share their row range exactly."""
    owner, lane_key, bp_space, bp_row = cut_at_breakpoints(rects.space, rects.r0, rects.r1)
    lane_r0 = bp_row[lane_key]
    shift = lane_r0 - rects.r0[owner]
    strided = rects.strided[owner]
    k0 = rects.k0[owner] + np.where(strided, shift, 0)
    j0 = rects.j0[owner] + np.where(strided, 0, shift * rects.pitch[rects.space[owner]])
    return Lanes(
        lane=lane_key,
        c0=rects.c0[owner],
        c1=rects.c1[owner],
        rect=owner,
        k0=k0,
        j0=j0,
        lane_space=bp_space,
        lane_r0=bp_row,
        lane_r1=np.append(bp_row[1:], bp_row[-1:]),
    )


def _sorted_by_lane(lanes: Lanes) -> np.ndarray:
    return lex_order(lanes.lane, lanes.c0, lanes.c1)


def _previous_reach(lane: np.ndarray, c1: np.ndarray) -> np.ndarray:
    """For sorted intervals: the largest end among earlier intervals of the same lane, or -1.

    A running maximum of ``lane * big + end`` never mixes lanes because lanes are sorted.
    """
    out = np.full(len(lane), -1, dtype=I64)
    if not len(lane):
        return out
    values, ends = None, c1 + 1
    if packed_key(lane, ends) is None:  # huge coordinates: work on their ranks
        values, rank = np.unique(c1, return_inverse=True)
        ends = rank.astype(I64) + 1
    big = I64(int(ends.max()) + 1)
    reach = np.maximum.accumulate(lane * big + ends)
    prev = np.full(len(lane), -1, dtype=I64)
    prev[1:] = reach[:-1]
    same_lane = (prev >= 0) & (prev // big == lane)
    end = prev[same_lane] % big - 1
    out[same_lane] = end if values is None else values[end]
    return out


def union_bytes(lanes: Lanes) -> np.ndarray:
    """Bytes covered per lane: rows times the union of its column intervals."""
    order = _sorted_by_lane(lanes)
    lane, c0, c1 = lanes.lane[order], lanes.c0[order], lanes.c1[order]
    reach = _previous_reach(lane, c1)
    gained = np.clip(c1 - np.maximum(c0, reach), 0, None)
    per_lane = np.bincount(lane, weights=gained, minlength=len(lanes.lane_space))
    rows = lanes.lane_r1 - lanes.lane_r0
    return per_lane.astype(I64) * rows


def first_overlap(lanes: Lanes) -> tuple[int, int] | None:
    """Two rect indices whose byte sets intersect, or None when all are pairwise disjoint."""
    order = _sorted_by_lane(lanes)
    lane, c0, c1 = lanes.lane[order], lanes.c0[order], lanes.c1[order]
    reach = _previous_reach(lane, c1)
    hits = np.flatnonzero(c0 < reach)
    if not len(hits):
        return None
    i = int(hits[0])
    earlier = np.flatnonzero((lane[:i] == lane[i]) & (c1[:i] > c0[i]))
    return int(lanes.rect[order[earlier[0]]]), int(lanes.rect[order[i]])


@dataclass(frozen=True)
class Cells:
    """Disjoint pieces of the union: each cell is a rectangle every covering run fully covers."""

    space: np.ndarray
    r0: np.ndarray
    r1: np.ndarray
    c0: np.ndarray
    c1: np.ndarray
    # One entry per (cell, covering lane entry), sorted by cell.
    pair_cell: np.ndarray
    pair_entry: np.ndarray  # index into the Lanes arrays
    pair_j0: np.ndarray  # j0 of the entry, moved to the cell's first column


def elementary_cells(lanes: Lanes) -> Cells:
    """Partition the union into cells at every column breakpoint of every lane."""
    owner, cell_key, bp_lane, bp_col = cut_at_breakpoints(lanes.lane, lanes.c0, lanes.c1)
    order = stable_order(cell_key)
    owner, cell_key = owner[order], cell_key[order]
    first = group_starts(cell_key)
    cell = np.cumsum(first) - 1
    used = cell_key[first]
    lane_of_cell = bp_lane[used]
    return Cells(
        space=lanes.lane_space[lane_of_cell],
        r0=lanes.lane_r0[lane_of_cell],
        r1=lanes.lane_r1[lane_of_cell],
        c0=bp_col[used],
        c1=bp_col[used + 1],
        pair_cell=cell,
        pair_entry=owner,
        pair_j0=lanes.j0[owner] + (bp_col[cell_key] - lanes.c0[owner]),
    )
