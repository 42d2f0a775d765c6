"""In-place delta landing: a worker serving exactly a delta generation's base takes only
the entries of the blocks its boxes cover, and writes their changed elements into the live
regions that already hold the base.

    manifest, checksum table and delta table of N + the worker's boxes
        --delta_reads (pure)--> one DeltaRead per box: its bytes of a payload object, where
        they sit in a live region, and the checksum covering exactly them
    delta objects --the blocks' entries, into a buffer: a planned fetch (read once, pushed
        to every worker that needs them, :mod:`mooncake_rl.plan.delta`) or :func:`fetch`
        alone--> --decode (each entry hash-checked)--> DeltaChanges: per region, the byte
        positions and new bytes
    DeltaChanges --scatter--> the live regions (one indexed write per region, on its device)
    --check (a window of boxes per host copy)--> each box's bytes against N's checksum: the
        region now holds N, exactly

Why a box must be a checksummed unit (a tensor stored alone, or one packed fragment): the
check after the scatter proves the result equal to N's published bytes, not just to the base
plus what the delta says. A box that is not one (a row shard of a tensor stored alone) makes
the worker take the full path: :class:`DeltaUnavailable` says why.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from mooncake.reshard.weight import StoredFragment, WeightManifest

from mooncake_rl.apply.coalesce import coalesced_reads
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.chain import DeltaTable, block_tensors, checked_entry, delta_key
from mooncake_rl.generations.checksums import ObjectChecksum
from mooncake_rl.generations.packing import tensor_checksum_key
from mooncake_rl.plan.delta import EntryBlock, entry_blocks, entry_offsets
from mooncake_rl.store import RangeRead, StoreClient


class DeltaUnavailable(InvariantViolation):
    """This worker cannot take the delta in place; it takes the full path instead."""


class Box(Protocol):
    """What a worker holds of one checkpoint tensor (``engine_ext.shards.ShardSpec``)."""

    tensor: str
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    region: str
    region_offset: int


@dataclass(frozen=True)
class DeltaRead:
    """Bytes ``offset``..``offset + length`` of payload ``key`` are region ``region``'s
    bytes from ``dst_offset`` on, ``checksum_key`` checks exactly them, and they are bytes
    of ``tensor`` (what a refused entry names)."""

    key: str
    offset: int
    length: int
    region: str
    dst_offset: int
    checksum_key: str
    tensor: str


def delta_reads(
    manifest: WeightManifest,
    checksums: Mapping[str, ObjectChecksum],
    table: DeltaTable,
    boxes: Sequence[Box],
    in_place: frozenset[str] | set[str],
) -> list[DeltaRead]:
    """The reads that rewrite every box, or :class:`DeltaUnavailable` naming the first box
    that cannot take the delta in place: its region is not a live receiver, or no stored
    fragments tile it (a box is one fragment, or the rows of several: a whole tensor packed
    rank by rank for another engine's cut)."""
    fragments = defaultdict(list)
    for fragment in manifest.fragments:
        fragments[fragment.tensor_id].append(fragment)
    reads = []
    for box in boxes:
        if box.region not in in_place:
            raise DeltaUnavailable(
                f"parameter {box.region} is processed after loading (not served as loaded)"
            )
        for fragment, dst_offset in _tiling(box, fragments.get(box.tensor, ())):
            check_key = tensor_checksum_key(manifest.group_id, fragment)
            if fragment.object_key not in table.objects or check_key not in checksums:
                raise DeltaUnavailable(
                    f"{box.tensor}: no delta or checksum for {fragment.object_key}"
                )
            reads.append(
                DeltaRead(
                    fragment.object_key,
                    fragment.object_offset,
                    fragment.nbytes,
                    box.region,
                    dst_offset,
                    check_key,
                    box.tensor,
                )
            )
    return reads


def _tiling(box: Box, fragments: Sequence[StoredFragment]) -> list[tuple[StoredFragment, int]]:
    """The fragments whose rows tile ``box`` (same extent in every other dimension), each
    with where its bytes start in the box's region."""
    first, rows = (box.global_offset[0], box.local_shape[0]) if box.local_shape else (0, 1)
    inner = (tuple(box.global_offset[1:]), tuple(box.local_shape[1:]))
    tiles = sorted(
        (
            f
            for f in fragments
            if (tuple(f.global_offset[1:]), tuple(f.local_shape[1:])) == inner
            and (not f.local_shape or first <= f.global_offset[0] < first + rows)
        ),
        key=lambda f: f.global_offset[0] if f.local_shape else 0,
    )
    at, placed = first, []
    for fragment in tiles:
        start = fragment.global_offset[0] if fragment.local_shape else 0
        extent = fragment.local_shape[0] if fragment.local_shape else 1
        if start != at:
            break
        placed.append((fragment, box.region_offset + (start - first) * (fragment.nbytes // extent)))
        at += extent
    if at != first + rows or not placed:
        raise DeltaUnavailable(
            f"{box.tensor} at {tuple(box.global_offset)} is a shard no checksum covers alone"
        )
    return placed


@dataclass(frozen=True)
class DeltaChanges:
    """What the scatter writes: per (region, element size), element positions in the region
    and their new elements as raw words (bytes, where a read is not element-aligned)."""

    positions: Mapping[tuple[str, int], np.ndarray]
    values: Mapping[tuple[str, int], np.ndarray]
    entry_bytes: int
    """Delta bytes read from the Store for them."""

    @property
    def changed_bytes(self) -> int:
        return sum(v.nbytes for v in self.values.values())


def fetch(store: StoreClient, table: DeltaTable, reads: Sequence[DeltaRead]) -> DeltaChanges:
    """One worker alone: read the entries of every block the reads cover into a buffer laid
    out by :func:`~mooncake_rl.plan.delta.entry_blocks` (the executor merges adjacent
    ranges), then :func:`decode` them. Engines that share entries read them once through a
    planned fetch instead (:func:`~mooncake_rl.plan.delta.plan_delta_fetch`)."""
    blocks = entry_blocks(table, [(r.key, r.offset, r.length) for r in reads])
    offsets = entry_offsets(blocks)
    buffer = torch.empty(max(offsets[-1], 1), dtype=torch.uint8)
    plan = coalesced_reads(
        [
            RangeRead(delta_key(b.key), b.start, at, b.length)
            for b, at in zip(blocks, offsets[:-1], strict=True)
        ]
    )
    if plan:
        store.register(buffer.data_ptr(), buffer.numel())
        try:
            store.read_ranges(buffer.data_ptr(), plan)
        finally:
            store.unregister(buffer.data_ptr())
    return decode(buffer.numpy(), blocks, table, reads)


def decode(
    buffer: np.ndarray,
    blocks: Sequence[EntryBlock],
    table: DeltaTable,
    reads: Sequence[DeltaRead],
) -> DeltaChanges:
    """The entries in ``buffer`` (laid out by ``blocks``), each checked against its hash and
    its declared extent, and decoded (:class:`CorruptDelta` names the first that is not
    what the table says: corrupt in the Store, or never delivered), keeping the changes
    that fall inside each read."""
    pieces = [(r.tensor, r.key, r.offset, r.length) for r in reads]
    # Per object and element size, block by block: changed elements' indices in the object,
    # and their new elements as raw words.
    changed: dict[tuple[str, int], list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
    spans = {key: table.objects[key].spans() for key in {b.key for b in blocks}}
    for block, at in zip(blocks, entry_offsets(blocks)[:-1], strict=True):
        row = table.objects[block.key]
        span = spans[block.key][block.block]
        entry = buffer[at : at + block.length]
        tensors = block_tensors(pieces, block.key)
        delta, positions = checked_entry(entry, block.key, row, block.block, span, tensors)
        words = np.frombuffer(delta.values, f"u{delta.itemsize}")
        if delta.encoding == "whole":
            words = words[positions]
        changed[block.key, delta.itemsize].append((span[0] // delta.itemsize + positions, words))
    # One sorted array per object (blocks come in object order): one search per read, not
    # one per block of the object (a pack's reads would cost reads x blocks).
    merged: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = defaultdict(list)
    for (key, itemsize), parts in changed.items():
        merged[key].append(
            (itemsize, np.concatenate([p for p, _ in parts]), np.concatenate([w for _, w in parts]))
        )
    positions: dict[tuple[str, int], list[np.ndarray]] = defaultdict(list)
    values: dict[tuple[str, int], list[np.ndarray]] = defaultdict(list)
    for read in reads:
        end, shift = read.offset + read.length, read.dst_offset - read.offset
        for itemsize, elements, words in merged[read.key]:
            # The elements the read overlaps (whole ones, where it is element-aligned).
            lo, hi = np.searchsorted(elements, (read.offset // itemsize, -(-end // itemsize)))
            if lo == hi:
                continue
            if read.offset % itemsize == 0 == end % itemsize == shift % itemsize:  # words
                positions[read.region, itemsize].append(elements[lo:hi] + shift // itemsize)
                values[read.region, itemsize].append(words[lo:hi])
            else:  # bytes, those inside the read: it cuts elements (never a box's read)
                at = elements[lo:hi, None] * itemsize + np.arange(itemsize)
                inside = (at >= read.offset) & (at < end)
                positions[read.region, 1].append((at + shift)[inside])
                values[read.region, 1].append(
                    words[lo:hi].view(np.uint8).reshape(-1, itemsize)[inside]
                )
    return DeltaChanges(
        {r: np.concatenate(p) for r, p in positions.items()},
        {r: np.concatenate(v) for r, v in values.items()},
        sum(b.length for b in blocks),
    )


WORDS = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}
WORDS[8] = (torch.int64, np.int64)
"""Signed views of an element's raw bits (torch indexes no unsigned wider than a byte)."""


def scatter(changes: DeltaChanges, regions: Mapping[str, torch.Tensor]) -> int:
    """Write the changes into the regions (flat uint8 views of live parameters), one
    indexed write per region and element size, on the region's own device; the bytes
    written. On the host the write is numpy's (a third faster than torch's indexed write
    here: it is most of a delta's pause on a CPU engine)."""
    for (name, itemsize), positions in changes.positions.items():
        torch_words, numpy_words = WORDS[itemsize]
        region = regions[name].view(torch_words)
        words = changes.values[name, itemsize].view(numpy_words)
        if region.device.type == "cpu":
            region.detach().numpy()[positions] = words
            continue
        index = torch.from_numpy(positions.astype(np.int64, copy=False)).to(region.device)
        region[index] = torch.from_numpy(words).to(region.device)
    return changes.changed_bytes


CHECK_WINDOW_BYTES = 256 << 20
"""The most region bytes the check brings to the host at once (beyond one box larger than
that): the host buffer it needs, and few copies."""


@dataclass(frozen=True)
class CheckWindow:
    """Bytes ``start``..``end`` of region ``region``, brought to the host in one copy to check
    ``reads``, which lie inside it."""

    region: str
    start: int
    end: int
    reads: tuple[DeltaRead, ...]

    def __post_init__(self) -> None:
        if not self.reads or not all(
            self.start <= r.dst_offset
            and r.dst_offset + r.length <= self.end
            and r.region == self.region
            for r in self.reads
        ):
            raise ValueError(f"a check window must hold its reads: {self}")


def check_windows(reads: Sequence[DeltaRead], window_bytes: int) -> list[CheckWindow]:
    """The reads grouped, per region in offset order, into spans of at most
    ``window_bytes`` (a read longer than that alone in its own). Why: on a GPU, one
    device-to-host copy per box is thousands of small synchronous copies inside the pause;
    one per window is a few large ones, into a host buffer of bounded size."""
    if window_bytes < 1:
        raise ValueError(f"window_bytes must be positive, got {window_bytes}")
    windows: list[CheckWindow] = []
    in_order = sorted(reads, key=lambda r: (r.region, r.dst_offset))
    group: list[DeltaRead] = []
    for read in in_order:
        end = read.dst_offset + read.length
        if group and (read.region != group[0].region or end - group[0].dst_offset > window_bytes):
            windows.append(_window(group))
            group = []
        group.append(read)
    if group:
        windows.append(_window(group))
    return windows


def _window(reads: list[DeltaRead]) -> CheckWindow:
    start = reads[0].dst_offset
    end = max(r.dst_offset + r.length for r in reads)
    return CheckWindow(reads[0].region, start, end, tuple(reads))


def check(
    reads: Sequence[DeltaRead],
    regions: Mapping[str, torch.Tensor],
    checksums: Mapping[str, ObjectChecksum],
    window_bytes: int = CHECK_WINDOW_BYTES,
) -> int:
    """Every box's bytes against N's checksum of exactly them (``CorruptObject`` naming the
    first that differs, in region and offset order); the bytes checked. Device regions
    come to the host a window at a time (:func:`check_windows`), into one pinned buffer."""
    windows = check_windows(reads, window_bytes)
    host: torch.Tensor | None = None
    for window in windows:
        span = regions[window.region][window.start : window.end]
        if span.device.type != "cpu":
            if host is None:
                largest = max(w.end - w.start for w in windows)
                host = torch.empty(largest, dtype=torch.uint8, pin_memory=True)
            span = host[: window.end - window.start].copy_(span)
        for read in window.reads:
            at = read.dst_offset - window.start
            checksums[read.checksum_key].check(read.checksum_key, span[at : at + read.length])
    return sum(read.length for read in reads)


def land(
    changes: DeltaChanges,
    reads: Sequence[DeltaRead],
    regions: Mapping[str, torch.Tensor],
    checksums: Mapping[str, ObjectChecksum],
) -> dict[str, Any]:
    """The landing of a delta (an engine's pause): :func:`scatter`, then :func:`check` every
    box against N; the seconds of each, and the bytes written and checked."""
    started = time.perf_counter()
    written = scatter(changes, regions)
    if any(r.is_cuda for r in regions.values()):
        torch.cuda.synchronize()
    scattered = time.perf_counter()
    checked = check(reads, regions, checksums)
    return {
        "scatter_seconds": scattered - started,
        "check_seconds": time.perf_counter() - scattered,
        "written_bytes": written,
        "checked_bytes": checked,
    }
