"""Check ranged reads against the generation's checksum table as they land.

A worker reads byte ranges of objects, not whole objects, so it checks what its ranges
cover: every 4 MiB block (``checksums.BLOCK_BYTES``; a rank-major pack's blocks are also cut
where each rank's run starts) that the reads of one batch cover entirely, against the
block's XXH3-64; an object of at most one block is checked against
its whole XXH3-128 when the batch covers all of it. Coverage is the union of the batch's
reads of that object, wherever in the worker's regions they landed, so a block read as many
strided rows (a column shard) is still checked. Bytes of a block that the batch covers only
in part land unchecked: ``docs/generations.md#checksums`` states that exception.
"""

from __future__ import annotations

import bisect
import ctypes
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import xxhash

from mooncake_rl.apply.registration import Region
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.checksums import CorruptObject, ObjectChecksum


@dataclass(frozen=True)
class Landed:
    """``length`` bytes at ``src_offset`` of an object, now at ``address`` on ``device``."""

    src_offset: int
    length: int
    address: int
    device: str = "cpu"

    @property
    def end(self) -> int:
        return self.src_offset + self.length


@dataclass
class VerifyStats:
    verified_bytes: int = 0
    unverified_bytes: int = 0
    seconds: float = 0.0

    def add(self, other: VerifyStats) -> None:
        self.verified_bytes += other.verified_bytes
        self.unverified_bytes += other.unverified_bytes
        self.seconds += other.seconds


class _CudaBytes:
    """A raw device span as an object torch can wrap (``__cuda_array_interface__``)."""

    def __init__(self, address: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def device_span(address: int, length: int, device: str) -> torch.Tensor:
    """``length`` bytes of CUDA memory at ``address`` as a uint8 tensor sharing them."""
    return torch.as_tensor(_CudaBytes(address, length), device=device)


def host_bytes(address: int, length: int, device: str = "cpu") -> memoryview:
    """The landed bytes as a host buffer (a view for host memory, a copy for device memory)."""
    if device == "cpu":
        return memoryview((ctypes.c_char * length).from_address(address)).cast("B")
    return memoryview(device_span(address, length, device).cpu().numpy())


def checkable_units(checksum: ObjectChecksum) -> list[tuple[int, int, str]]:
    """(start, end, expected hash) of every unit a read can be checked against."""
    if not checksum.blocks:
        return [(0, checksum.nbytes, checksum.whole)]
    return [(s, e, h) for (s, e), h in zip(checksum.spans(), checksum.blocks, strict=True)]


def _runs(pieces: Sequence[Landed]) -> Iterator[tuple[int, int]]:
    """Maximal contiguous source spans covered by ``pieces`` (sorted by source offset)."""
    start = end = None
    for piece in pieces:
        if end is not None and piece.src_offset <= end:
            end = max(end, piece.end)
            continue
        if start is not None and end is not None:
            yield start, end
        start, end = piece.src_offset, piece.end
    if start is not None and end is not None:
        yield start, end


def _disjoint(pieces: Sequence[Landed]) -> list[Landed]:
    """Sorted pieces with any overlap clipped off the later one (the bytes are the same)."""
    out: list[Landed] = []
    for piece in pieces:
        reach = out[-1].end if out else 0
        if piece.end <= reach:
            continue
        if piece.src_offset < reach:
            cut = reach - piece.src_offset
            piece = Landed(reach, piece.length - cut, piece.address + cut, piece.device)
        out.append(piece)
    return out


def verify_object(key: str, checksum: ObjectChecksum, pieces: Sequence[Landed]) -> VerifyStats:
    """Check every unit of ``key`` that ``pieces`` cover entirely; raise CorruptObject."""
    started = time.perf_counter()
    pieces = _disjoint(sorted(pieces, key=lambda p: p.src_offset))
    if pieces and pieces[-1].end > checksum.nbytes:
        raise InvariantViolation(
            f"a read of {key} ends at {pieces[-1].end}, past its {checksum.nbytes} bytes"
        )
    starts = [p.src_offset for p in pieces]
    units = checkable_units(checksum)
    unit_starts = [start for start, _, _ in units]
    verified = 0
    for run_start, run_end in _runs(pieces):
        for unit in range(bisect.bisect_left(unit_starts, run_start), len(units)):
            start, end, expected = units[unit]
            if start < run_start:
                continue
            if end > run_end:
                break
            hasher = xxhash.xxh3_64() if checksum.blocks else xxhash.xxh3_128()
            cursor = start
            index = max(bisect.bisect_right(starts, start) - 1, 0)
            while cursor < end:
                piece = pieces[index]
                index += 1
                if piece.end <= cursor:
                    continue
                take = min(piece.end, end) - cursor
                offset = piece.address + (cursor - piece.src_offset)
                hasher.update(host_bytes(offset, take, piece.device))
                cursor += take
            if hasher.hexdigest() != expected:
                where = f" (block {unit}, bytes [{start}, {end}))" if checksum.blocks else ""
                raise CorruptObject(
                    f"object {key} does not match its published checksum{where}: the Store "
                    "holds corrupted bytes; republish, or `mooncake-rl activate` an older "
                    "generation that `mooncake-rl verify` passes"
                )
            verified += end - start
    landed = sum(p.length for p in pieces)
    return VerifyStats(verified, max(landed - verified, 0), time.perf_counter() - started)


@dataclass(frozen=True)
class RangeVerifier:
    """Checks one worker's landed reads; ``checksums`` covers every key the worker reads."""

    checksums: Mapping[str, ObjectChecksum]

    def verify(self, reads: Sequence[tuple[str, int, int, Region, int]]) -> VerifyStats:
        """``reads``: (key, src_offset, length, destination region, dst_offset) of one batch."""
        return self.check(self.landed(reads))

    def landed(self, reads: Sequence[tuple[str, int, int, Region, int]]) -> dict[str, list[Landed]]:
        """The reads of one batch by object, as addresses: what :meth:`check` hashes (a
        worker resolves its slice's once, at prepare). Refuses a key with no checksum."""
        by_key: dict[str, list[Landed]] = defaultdict(list)
        for key, src, length, region, dst in reads:
            by_key[key].append(Landed(src, length, region.address(dst, length), region.device))
        missing = next((key for key in by_key if key not in self.checksums), None)
        if missing is not None:
            raise InvariantViolation(f"no published checksum for {missing}; refusing its bytes")
        return dict(by_key)

    def check(self, landed: Mapping[str, Sequence[Landed]]) -> VerifyStats:
        """Check what one batch landed, by object (:meth:`landed`); raises CorruptObject."""
        stats = VerifyStats()
        for key, pieces in landed.items():
            stats.add(verify_object(key, self.checksums[key], pieces))
        return stats
