"""Decoding delta entries for a worker's reads (``mooncake_rl.apply.delta.decode``) and
scattering them: any read of an object, element-aligned or cutting elements, lands exactly
generation N's bytes inside the read and leaves every other byte of its region alone."""

from __future__ import annotations

from itertools import pairwise
from operator import attrgetter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rl.apply.delta import DeltaRead, check, check_windows, decode, scatter
from mooncake_rl.generations.chain import DeltaTable, delta_object
from mooncake_rl.generations.checksums import CorruptObject, ObjectChecksum
from mooncake_rl.plan.delta import entry_blocks, entry_offsets

KEY = "g/payload/pack"


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, list[tuple[int, int]], int]:
    itemsize = draw(st.sampled_from([1, 2, 4]))
    numel = draw(st.integers(1, 600))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, numel * itemsize, dtype=np.uint8)
    new = base.copy()
    changed = rng.random(numel) < draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
    words = new.view(f"u{itemsize}")
    words[changed] ^= 1
    nbytes = numel * itemsize
    cuts = sorted({draw(st.integers(1, numel)) * itemsize for _ in range(draw(st.integers(0, 3)))})
    reads = [
        (start, draw(st.integers(1, nbytes - start)))
        for start in (draw(st.integers(0, nbytes - 1)) for _ in range(draw(st.integers(1, 3))))
    ]
    return base, new, itemsize, reads, cuts[-1] if cuts and cuts[-1] < nbytes else 0


@settings(max_examples=200, deadline=None)
@given(cases(), st.integers(0, 7))
def test_a_decoded_read_lands_exactly_its_bytes_of_n(
    case: tuple[np.ndarray, np.ndarray, int, list[tuple[int, int]], int], pad: int
) -> None:
    base, new, itemsize, spans, cut = case
    data, row = delta_object(base, new, itemsize, (cut,) if cut else ())
    table = DeltaTable(2, 1, {KEY: row})
    reads = [
        DeltaRead(KEY, offset, length, f"r{i}", pad, "ck", "t")
        for i, (offset, length) in enumerate(spans)
    ]
    blocks = entry_blocks(table, [(r.key, r.offset, r.length) for r in reads])
    buffer = np.zeros(max(entry_offsets(blocks)[-1], 1), np.uint8)
    for block, at in zip(blocks, entry_offsets(blocks)[:-1], strict=True):
        buffer[at : at + block.length] = np.frombuffer(data, np.uint8)[block.start : block.end]

    def region(source: np.ndarray, read: DeltaRead) -> np.ndarray:
        """The read's bytes of ``source`` at ``pad`` in its region (whole 8-byte words, as
        a parameter's are), other bytes 7."""
        inside = source[read.offset : read.offset + read.length]
        tail = 8 + (-(pad + read.length)) % 8
        return np.concatenate([np.full(pad, 7, np.uint8), inside, np.full(tail, 7, np.uint8)])

    regions = {r.region: torch.from_numpy(region(base, r)) for r in reads}
    scatter(decode(buffer, blocks, table, reads), regions)
    for r in reads:
        assert np.array_equal(regions[r.region].numpy(), region(new, r))


@st.composite
def box_reads(draw: st.DrawFn) -> list[DeltaRead]:
    """Disjoint boxes in two regions, in no particular order (as a worker's boxes come)."""
    reads = []
    for region in ("r0", "r1"):
        at = 0
        for k in range(draw(st.integers(0, 12))):
            at += draw(st.integers(0, 40))
            length = draw(st.integers(1, 90))
            reads.append(DeltaRead(KEY, 0, length, region, at, f"{region}/{k}", f"{region}.{k}"))
            at += length
    return draw(st.permutations(reads))


@settings(max_examples=300, deadline=None)
@given(box_reads(), st.integers(1, 200))
def test_check_windows_hold_every_box_once_within_the_budget(
    reads: list[DeltaRead], window_bytes: int
) -> None:
    windows = check_windows(reads, window_bytes)
    key = attrgetter("region", "dst_offset")
    assert sorted((r for w in windows for r in w.reads), key=key) == sorted(reads, key=key)
    for window in windows:
        starts = [r.dst_offset for r in window.reads]
        assert starts == sorted(starts) and window.start == starts[0]
        assert window.end == max(r.dst_offset + r.length for r in window.reads)
        assert window.end - window.start <= window_bytes or len(window.reads) == 1
    # Windows of a region never overlap (each byte is brought to the host at most once).
    for a, b in pairwise(windows):
        assert a.region < b.region or (a.region == b.region and a.end <= b.start)


@settings(max_examples=100, deadline=None)
@given(box_reads(), st.integers(1, 200), st.data())
def test_the_windowed_check_names_the_box_that_differs(
    reads: list[DeltaRead], window_bytes: int, data: st.DataObject
) -> None:
    """Each box's checksum against the bytes the window brings: every box passes, and one
    flipped byte fails exactly its box's check, whatever the window size."""
    end = max([r.dst_offset + r.length for r in reads], default=0)
    rng = np.random.default_rng(0)
    regions = {r: torch.from_numpy(rng.integers(0, 256, end, dtype=np.uint8)) for r in ("r0", "r1")}
    sums = {
        r.checksum_key: ObjectChecksum.of(
            regions[r.region][r.dst_offset : r.dst_offset + r.length].numpy().tobytes()
        )
        for r in reads
    }
    assert check(reads, regions, sums, window_bytes) == sum(r.length for r in reads)
    if reads:
        bad = data.draw(st.sampled_from(reads))
        regions[bad.region][bad.dst_offset + data.draw(st.integers(0, bad.length - 1))] ^= 1
        with pytest.raises(CorruptObject, match=f"object {bad.checksum_key} "):
            check(reads, regions, sums, window_bytes)
