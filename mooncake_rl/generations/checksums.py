"""Content checksums of a generation's objects: a hash per object and per fixed-size block.

Why both: compat readers and the engines' Store loader read whole objects and check the
object hash on the fly; direct mode reads byte ranges, so every block a range covers whole
is checked against its block hash (``docs/generations.md`` says which bytes are not).

Why xxHash (XXH3): measured on this machine, 12.6 GB/s on one core against 9.0 GB/s for
BLAKE3 on every core and 1.3 GB/s for SHA-256. The threat is corruption (a torn write, a
reused segment, a bit flip), not an adversary who can write the Store: anyone who can do
that can also rewrite the manifest. The table itself is sealed by the manifest's digest
chain: its digest travels in the active record.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import xxhash

from mooncake_rl.errors import InvariantViolation, MooncakeRLError

BLOCK_BYTES = 4 << 20
"""Block size of the per-block hashes; objects up to one block have only the whole hash."""


class CorruptObject(MooncakeRLError):
    """An object's bytes differ from the checksum its publisher recorded."""


def _buffer(data: bytes | bytearray | memoryview | torch.Tensor) -> memoryview:
    if isinstance(data, torch.Tensor):
        flat = data.detach().contiguous().reshape(-1)
        return memoryview(flat.view(torch.uint8).numpy())
    return memoryview(data).cast("B")


def object_hash(data: bytes | bytearray | memoryview | torch.Tensor) -> str:
    """XXH3-128 of the whole object, hex."""
    return xxhash.xxh3_128_hexdigest(_buffer(data))


def block_spans(nbytes: int, cuts: Sequence[int] = ()) -> Iterator[tuple[int, int]]:
    """(start, end) of every block of an object of ``nbytes``: ``BLOCK_BYTES`` apart, also
    cut at ``cuts`` (a rank-major pack's rank runs, so no block straddles two readers)."""
    bounds = sorted({*range(0, nbytes, BLOCK_BYTES), *cuts, nbytes})
    yield from itertools.pairwise(bounds)


def block_hash(data: memoryview) -> str:
    """XXH3-64 of one block, hex (16 characters keep a 1 TB model's table near 8 MB)."""
    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class ObjectChecksum:
    """One object's size, whole hash and (for objects over one block, or cut at ``cuts``)
    block hashes."""

    nbytes: int
    whole: str
    blocks: tuple[str, ...] = ()
    cuts: tuple[int, ...] = ()
    """Block boundaries besides every ``BLOCK_BYTES``: where a rank-major pack's rank runs
    start (:mod:`.pack_order`), so each rank checks every block of its run."""

    def __post_init__(self) -> None:
        if (
            self.nbytes <= 0
            or len(self.whole) != 32
            or list(self.cuts) != sorted(set(self.cuts))
            or any(not 0 < c < self.nbytes for c in self.cuts)
        ):
            raise InvariantViolation(f"malformed object checksum {self}")
        expected = len(self.spans()) if self.nbytes > BLOCK_BYTES or self.cuts else 0
        if len(self.blocks) != expected:
            raise InvariantViolation(
                f"an object of {self.nbytes} bytes has {expected} block hashes, not "
                f"{len(self.blocks)}"
            )

    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of each block hash's bytes."""
        return list(block_spans(self.nbytes, self.cuts))

    @classmethod
    def of(
        cls, data: bytes | bytearray | memoryview | torch.Tensor, cuts: Sequence[int] = ()
    ) -> ObjectChecksum:
        view = _buffer(data)
        cuts = tuple(sorted({c for c in cuts if 0 < c < len(view)}))
        blocks: tuple[str, ...] = ()
        if len(view) > BLOCK_BYTES or cuts:
            blocks = tuple(block_hash(view[s:e]) for s, e in block_spans(len(view), cuts))
        return cls(len(view), object_hash(view), blocks, cuts)

    def check(self, key: str, data: bytes | bytearray | memoryview | torch.Tensor) -> None:
        """Raise :class:`CorruptObject` naming ``key`` unless ``data`` is this object."""
        view = _buffer(data)
        if len(view) != self.nbytes or object_hash(view) != self.whole:
            raise CorruptObject(
                f"object {key} does not match its published checksum ({len(view)} bytes read, "
                f"{self.nbytes} published): the Store holds corrupted bytes; republish, or "
                "`mooncake-rl activate` an older generation that `mooncake-rl verify` passes"
            )


def _row(checksum: ObjectChecksum) -> list[Any]:
    """A table row: (nbytes, whole, blocks), and cuts where there are any (older tables
    have none, and stay byte-identical)."""
    row = [checksum.nbytes, checksum.whole, list(checksum.blocks)]
    return [*row, list(checksum.cuts)] if checksum.cuts else row


def _checksum(
    nbytes: int, whole: str, blocks: list[str], cuts: Sequence[int] = ()
) -> ObjectChecksum:
    return ObjectChecksum(nbytes, whole, tuple(blocks), tuple(cuts))


@dataclass(frozen=True)
class ChecksumTable:
    """Every object key of one generation and its checksum."""

    objects: Mapping[str, ObjectChecksum] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "objects", MappingProxyType(dict(self.objects)))

    def encode(self) -> bytes:
        rows = {key: _row(c) for key, c in sorted(self.objects.items())}
        return json.dumps(rows, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> ChecksumTable:
        try:
            rows: dict[str, Any] = json.loads(data)
            return cls({k: _checksum(*row) for k, row in rows.items()})
        except (ValueError, TypeError, AttributeError) as error:
            raise CorruptObject(f"checksum table is not valid ({error})") from error

    @staticmethod
    def digest_of(encoded: bytes) -> str:
        return xxhash.xxh3_128_hexdigest(encoded)

    def merged(self, other: Mapping[str, ObjectChecksum]) -> ChecksumTable:
        clash = sorted(k for k in other if k in self.objects and other[k] != self.objects[k])
        if clash:
            raise InvariantViolation(f"two checksums recorded for {clash[0]}")
        return ChecksumTable({**self.objects, **other})
