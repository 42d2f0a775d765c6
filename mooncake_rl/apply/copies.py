"""Local copies: bytes a worker moves between its own regions, without the Transfer Engine.

    a stage's pushes to the worker itself --LocalCopier.copy--> byte views of its regions
    --> one planned landing (batched torch copies) --> synchronized before the stage returns

Why: a sieved span (``mooncake_rl.plan.sieve``) lands whole in a worker's staging, and the
worker then copies its pieces out into their destinations. Through the Transfer Engine each
piece would cost a write (~30-45 us, ``bench.ops``); as a batched in-memory copy it costs
about a microsecond: a ``memmove`` on the CPU, one multi-tensor copy of views made from the
addresses (``__cuda_array_interface__``) on CUDA. Regions are only addresses, so this needs
nothing beyond what the worker registered.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch

from mooncake_rl.apply.coalesce import coalesced_writes
from mooncake_rl.apply.registration import Region
from mooncake_rl.apply.verify import device_span
from mooncake_rl.engine import Write
from mooncake_rl.errors import InvariantViolation


class LocalCopier:
    """Copies between one worker's regions, by name and offset."""

    def __init__(self, regions: Mapping[str, Region]) -> None:
        self.regions = regions

    def copy(self, copies: Sequence[tuple[str, int, str, int, int]]) -> int:
        """Copy each ``(src region, src offset, dst region, dst offset, length)``; returns the
        bytes copied once every copy is done (CUDA included). Copies adjacent on both sides
        merge first. On the CPU each is one ``memmove`` (ctypes releases the GIL while it
        moves bytes); on CUDA they are one multi-tensor copy per device."""
        writes: dict[str, list[Write]] = defaultdict(list)
        for src, src_off, dst, dst_off, length in copies:
            device = self.regions[dst].device
            if self.regions[src].device != device:
                raise InvariantViolation(f"a local copy from {src} to {dst} crosses devices")
            writes[device].append(
                Write(
                    self.regions[src].address(src_off, length),
                    self.regions[dst].address(dst_off, length),
                    length,
                )
            )
        total = 0
        for device, found in writes.items():
            merged = coalesced_writes(found)
            if device.startswith("cuda"):
                self._cuda(device, merged)
            else:
                for write in merged:
                    ctypes.memmove(write.dst, write.src, write.length)
            total += sum(w.length for w in merged)
        return total

    def _cuda(self, device: str, writes: Sequence[Write]) -> None:
        targets = [device_span(w.dst, w.length, device) for w in writes]
        sources = [device_span(w.src, w.length, device) for w in writes]
        with torch.inference_mode():
            torch._foreach_copy_(targets, sources)
        torch.cuda.synchronize(device)
