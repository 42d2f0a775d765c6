"""Strided-run set algebra against brute-force byte sets."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rl.plan import grid

SCALE = 1 << 55  # big enough that packed sort keys overflow and fallbacks run


@st.composite
def runs(draw):
    out = []
    for _ in range(draw(st.integers(1, 8))):
        length = draw(st.integers(1, 9))
        count = draw(st.integers(1, 5))
        stride = max(length, draw(st.sampled_from([length, length + 3, 8, 12, 16])))
        out.append((draw(st.integers(0, 2)), draw(st.integers(0, 40)), length, count, stride))
    return out


def byte_sets(rs):
    return [{o + k * s + j for k in range(c) for j in range(length)} for _, o, length, c, s in rs]


def columns(rs, scale=1):
    space, offset, length, count, stride = (np.array(c, np.int64) for c in zip(*rs, strict=True))
    return space, offset * scale, length * scale, count, stride * scale


@settings(max_examples=300, deadline=None)
@given(runs())
def test_rects_cover_each_run_exactly_with_its_row_mapping(rs):
    rects, _ = grid.to_rects(*columns(rs))
    sets = byte_sets(rs)
    got = [set() for _ in rs]
    for i in range(len(rects)):
        pitch = int(rects.pitch[rects.space[i]])
        m = int(rects.member[i])
        _, o, length, c, s = rs[m]
        for r in range(int(rects.r0[i]), int(rects.r1[i])):
            for col in range(int(rects.c0[i]), int(rects.c1[i])):
                dr, dc = r - int(rects.r0[i]), col - int(rects.c0[i])
                if rects.strided[i]:
                    k, j = int(rects.k0[i]) + dr, int(rects.j0[i]) + dc
                else:
                    k, j = int(rects.k0[i]), int(rects.j0[i]) + dr * pitch + dc
                assert 0 <= j < length and 0 <= k < c
                assert r * pitch + col == o + k * s + j
                assert r * pitch + col not in got[m]
                got[m].add(r * pitch + col)
    assert got == sets


@settings(max_examples=300, deadline=None)
@given(runs())
def test_union_overlap_and_cells_match_brute_force(rs):
    sets = byte_sets(rs)
    spaces = sorted({r[0] for r in rs})
    for scale in (1, SCALE):
        rects, found = grid.to_rects(*columns(rs, scale))
        assert list(found) == spaces
        lanes = grid.to_lanes(rects)
        union = np.bincount(lanes.lane_space, grid.union_bytes(lanes), len(spaces))
        for si, sp in enumerate(spaces):
            want = set().union(*(b for b, r in zip(sets, rs, strict=True) if r[0] == sp))
            assert int(union[si]) == len(want) * scale
        disjoint = all(
            not (sets[i] & sets[j])
            for i in range(len(rs))
            for j in range(i + 1, len(rs))
            if rs[i][0] == rs[j][0]
        )
        hit = grid.first_overlap(lanes)
        assert (hit is None) == disjoint
        if hit is not None:
            a, b = (int(rects.member[x]) for x in hit)
            assert a != b and rs[a][0] == rs[b][0] and sets[a] & sets[b]

    rects, _ = grid.to_rects(*columns(rs))
    lanes = grid.to_lanes(rects)
    cells = grid.elementary_cells(lanes)
    cell_sets = []
    for c in range(len(cells.space)):
        pitch = int(rects.pitch[cells.space[c]])
        rows = range(int(cells.r0[c]), int(cells.r1[c]))
        cols = range(int(cells.c0[c]), int(cells.c1[c]))
        cell_sets.append({r * pitch + col for r in rows for col in cols})
    for si, sp in enumerate(spaces):
        mine = [cs for c, cs in enumerate(cell_sets) if cells.space[c] == si]
        want = set().union(*(b for b, r in zip(sets, rs, strict=True) if r[0] == sp))
        assert sum(map(len, mine)) == len(want) == len(set().union(*mine))
    listed = {}
    for c, entry, j0 in zip(cells.pair_cell, cells.pair_entry, cells.pair_j0, strict=True):
        m = int(rects.member[lanes.rect[entry]])
        listed.setdefault(int(c), set()).add(m)
        _, o, _, _, s = rs[m]
        first = int(cells.r0[c]) * int(rects.pitch[cells.space[c]]) + int(cells.c0[c])
        assert first == o + int(lanes.k0[entry]) * s + int(j0)
    for c, cs in enumerate(cell_sets):
        covering = {m for m, b in enumerate(sets) if spaces[cells.space[c]] == rs[m][0] and cs <= b}
        assert listed[c] == covering


def test_packed_keys_fall_back_to_lexsort_when_they_would_overflow():
    big = np.array([1 << 60, 3, 1 << 60, 5], np.int64)
    small = np.array([2, 1, 1, 0], np.int64)
    assert grid.packed_key(big, big) is None
    assert list(grid.lex_order(big, small)) == list(np.lexsort((small, big)))
    keys, first = grid.dense_pair_keys(big, big)
    assert list(keys) == [2, 0, 2, 1] and sorted(first) == [0, 1, 3]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 6), max_size=60),
    st.sampled_from([1, 1 << 20, 1 << 45, 1 << 59]),
    st.integers(-(1 << 62), 1 << 62),
    st.booleans(),
)
def test_stable_order_and_unique_match_numpy(picks, spread, shift, ordered):
    """Both sorts, packed and for keys too wide to pack with the index (indirect, or
    ranked then packed), give numpy's stable order and unique, ties and keys already in
    order included."""
    key = np.array(sorted(picks) if ordered else picks, np.int64) * np.int64(spread)
    key += np.int64(shift // 2)
    expected_order = list(np.argsort(key, kind="stable"))
    for merge in (None, True, False):
        assert list(grid.stable_order(key, merge=merge)) == expected_order
    values, first, inverse = grid.unique_inverse(key)
    expected = np.unique(key, return_index=True, return_inverse=True)
    for got, want in zip((values, first, inverse), expected, strict=True):
        assert list(got) == list(want)


def test_malformed_runs_are_rejected():
    import pytest

    from mooncake_rl.errors import InvariantViolation

    with pytest.raises(InvariantViolation, match="malformed strided run"):
        grid.to_rects(*(np.array([x]) for x in (0, 0, 4, 2, 3)))  # stride < length
