"""Fewer native operations: byte ranges adjacent on both sides merged into one.

    batch reads (key, src, dst, length) --coalesced_reads--> fewer, longer ranged reads
    batch writes (src, dst, length)     --coalesced_writes--> fewer, longer TE writes

Why: Mooncake charges per range, not per byte. On this host's loopback TCP a ranged read
costs ~40 us and a Transfer Engine write ~45 us whatever their size (``bench.ops``), so a
many-tensor batch of thousands of small ranges spends its time in per-range work while a
merged range moves at the link's speed. Two ranges merge only when the second starts where
the first ends in the source *and* in the destination, so the bytes that move, and where
they land, are exactly those of the ranges given.
"""

from __future__ import annotations

from collections.abc import Sequence

from mooncake_rl.engine import Write
from mooncake_rl.store import RangeRead


def coalesced_reads(reads: Sequence[RangeRead]) -> list[RangeRead]:
    """``reads`` with every run of source- and destination-adjacent ranges of one object
    merged (into one buffer: destination offsets share one base)."""
    merged: list[RangeRead] = []
    for read in sorted(reads, key=lambda r: (r.key, r.src_offset, r.dst_offset)):
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.key == read.key
            and last.src_offset + last.length == read.src_offset
            and last.dst_offset + last.length == read.dst_offset
        ):
            merged[-1] = RangeRead(
                last.key, last.src_offset, last.dst_offset, last.length + read.length
            )
        else:
            merged.append(read)
    return merged


def coalesced_writes(writes: Sequence[Write]) -> list[Write]:
    """``writes`` (to one peer) with every run of source- and destination-adjacent ranges
    merged."""
    merged: list[Write] = []
    for write in sorted(writes, key=lambda w: (w.src, w.dst)):
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.src + last.length == write.src
            and (last.dst + last.length == write.dst)
        ):
            merged[-1] = Write(last.src, last.dst, last.length + write.length)
        else:
            merged.append(write)
    return merged
