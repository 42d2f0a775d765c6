"""Local copies: bytes a worker moves between its own regions, without the Transfer Engine.

    a batch's pushes to the worker itself --LocalCopier.plan (at prepare)--> PlannedCopies:
    checked, merged addresses --run (each stage)--> memmoves, or one batched torch copy per
    device --> synchronized before the stage returns

Why: a sieved span (``mooncake_rl.plan.sieve``) lands whole in a worker's staging, and the
worker then copies its pieces out into their destinations. Through the Transfer Engine each
piece would cost a write (~30-45 us, ``bench.ops``); as a batched in-memory copy it costs
about a microsecond: a ``memmove`` on the CPU, one multi-tensor copy of views made from the
addresses (``__cuda_array_interface__``) on CUDA. Regions are only addresses, so this needs
nothing beyond what the worker registered.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mooncake_rl.apply.registration import Region
from mooncake_rl.apply.verify import device_span
from mooncake_rl.engine import Write
from mooncake_rl.errors import InvariantViolation


@dataclass(frozen=True, eq=False)
class PlannedCopies:
    """A batch's local copies as addresses, checked and merged: per device, ``(src, dst,
    length)`` arrays. Planned once (a worker plans its slice at prepare), run every stage."""

    by_device: tuple[tuple[str, np.ndarray, np.ndarray, np.ndarray], ...] = ()

    @property
    def moves(self) -> int:
        """Native copies a run makes: one per run of copies adjacent on both sides."""
        return sum(len(src) for _, src, _, _ in self.by_device)

    @property
    def nbytes(self) -> int:
        return sum(int(length.sum()) for _, _, _, length in self.by_device)

    def run(self) -> int:
        """Move the bytes; returns them once every copy is done (CUDA included)."""
        for device, src, dst, length in self.by_device:
            moves = zip(src.tolist(), dst.tolist(), length.tolist(), strict=True)
            if device.startswith("cuda"):
                _cuda_copy(device, [Write(*move) for move in moves])
            else:
                for s, d, n in moves:
                    ctypes.memmove(d, s, n)
        return self.nbytes


class LocalCopier:
    """Copies between one worker's regions, by name and offset."""

    def __init__(self, regions: Mapping[str, Region]) -> None:
        self.regions = regions

    def copy(self, copies: Sequence[tuple[str, int, str, int, int]]) -> int:
        """Copy each ``(src region, src offset, dst region, dst offset, length)`` now
        (:meth:`plan`, then run); returns the bytes copied."""
        return self.plan(copies).run()

    def plan(self, copies: Sequence[tuple[str, int, str, int, int]]) -> PlannedCopies:
        """Each ``(src region, src offset, dst region, dst offset, length)`` as addresses.
        Copies adjacent on both sides merge. On the CPU each is then one ``memmove``
        (ctypes releases the GIL while it moves bytes); on CUDA they are one multi-tensor
        copy per device. Every copy is checked inside its regions, and on one device, here:
        before any byte moves."""
        if not copies:
            return PlannedCopies()
        src_names, src_offsets, dst_names, dst_offsets, lengths = zip(*copies, strict=True)
        names = list(dict.fromkeys((*src_names, *dst_names)))
        regions = [self.regions[name] for name in names]
        base = np.array([r.base for r in regions], np.int64)
        size = np.array([r.size for r in regions], np.int64)
        devices = sorted({r.device for r in regions})
        device = np.array([devices.index(r.device) for r in regions], np.int64)
        at = {name: i for i, name in enumerate(names)}
        src_region = np.fromiter(map(at.__getitem__, src_names), np.int64, len(copies))
        dst_region = np.fromiter(map(at.__getitem__, dst_names), np.int64, len(copies))
        src_offset = np.array(src_offsets, np.int64)
        dst_offset = np.array(dst_offsets, np.int64)
        length = np.array(lengths, np.int64)
        _check(copies, src_offset, dst_offset, length, size[src_region], size[dst_region])
        crossing = np.flatnonzero(device[src_region] != device[dst_region])
        if len(crossing):
            src, _, dst, _, _ = copies[crossing[0]]
            raise InvariantViolation(f"a local copy from {src} to {dst} crosses devices")
        src = base[src_region] + src_offset
        dst = base[dst_region] + dst_offset
        planned = []
        for index, name in enumerate(devices):
            mine = device[dst_region] == index
            if mine.any():
                planned.append((name, *_coalesced(src[mine], dst[mine], length[mine])))
        return PlannedCopies(tuple(planned))


def _cuda_copy(device: str, writes: Sequence[Write]) -> None:
    targets = [device_span(w.dst, w.length, device) for w in writes]
    sources = [device_span(w.src, w.length, device) for w in writes]
    with torch.inference_mode():
        torch._foreach_copy_(targets, sources)
    torch.cuda.synchronize(device)


def _check(copies, src_offset, dst_offset, length, src_size, dst_size) -> None:
    """Raise naming the first copy that is empty or leaves its source or destination."""
    bad = (
        (length <= 0)
        | (src_offset < 0)
        | (dst_offset < 0)
        | (src_offset + length > src_size)
        | (dst_offset + length > dst_size)
    )
    if bad.any():
        src, src_off, dst, dst_off, n = copies[int(np.flatnonzero(bad)[0])]
        raise InvariantViolation(
            f"local copy of {n} bytes from {src}[{src_off}] to {dst}[{dst_off}] lies outside "
            "its regions"
        )


def _coalesced(src: np.ndarray, dst: np.ndarray, length: np.ndarray):
    """(src, dst, length) arrays with every run adjacent on both sides merged, by source
    (:func:`~mooncake_rl.apply.coalesce.coalesced_writes`, without a Python object per copy)."""
    order = np.lexsort((dst, src))
    src, dst, length = src[order], dst[order], length[order]
    joins = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
    heads = np.flatnonzero(np.concatenate([[True], ~joins]))
    return src[heads], dst[heads], np.add.reduceat(length, heads)
