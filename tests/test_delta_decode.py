"""Decoding delta entries for a worker's reads (``mooncake_rl.apply.delta.decode``) and
scattering them: any read of an object, element-aligned or cutting elements, lands exactly
generation N's bytes inside the read and leaves every other byte of its region alone."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rl.apply.delta import DeltaRead, decode, scatter
from mooncake_rl.generations.chain import DeltaTable, delta_object
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
