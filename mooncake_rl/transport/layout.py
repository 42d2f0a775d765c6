"""Where each full tensor of a generation sits in a non-Store transport's receive buffer.

Broadcast and CPU serialization deliver the generation's full tensors, as VeRL's trainer
reconstructs them, to every rank of every engine. Sender and receivers derive the same
layout from the generation's manifest (a pure function of the manifest and the bucket
size), so nothing about it travels on the wire: a bucket is a byte range of the buffer,
holding whole tensors, and a receiver lands it without being told where anything goes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import rollout_dtype
from mooncake_rl.generations.checksums import CorruptObject, ObjectChecksum
from mooncake_rl.generations.packing import tensor_checksum_key
from mooncake_rl.store import RangeRead

ALIGN = 64
"""Every tensor starts on this boundary, so each is viewable as its dtype in place."""


@dataclass(frozen=True)
class StoredPiece:
    """Bytes ``[within, within + nbytes)`` of a tensor: stored at ``object_offset`` of
    ``object_key`` (its own object, or a pack), checked by ``checksum_key``'s entry."""

    object_key: str
    object_offset: int
    checksum_key: str
    within: int
    nbytes: int


@dataclass(frozen=True)
class ReceivedTensor:
    """One full tensor: its checkpoint name, where its bytes are stored (one piece, or a
    piece per row block of a rank-major pack) and its place in the buffer."""

    name: str
    pieces: tuple[StoredPiece, ...]
    offset: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def __post_init__(self) -> None:
        ends = [0, *(p.within + p.nbytes for p in self.pieces)]
        if (
            self.offset % ALIGN
            or self.nbytes != math.prod(self.shape) * rollout_dtype(self.dtype).itemsize
            or [p.within for p in self.pieces] != ends[:-1]
            or ends[-1] != self.nbytes
        ):
            raise InvariantViolation(f"malformed received tensor {self}")

    def reads(self, start: int) -> list[RangeRead]:
        """Its pieces' ranged reads into a buffer whose byte 0 is layout offset ``start``."""
        at = self.offset - start
        return [
            RangeRead(p.object_key, p.object_offset, at + p.within, p.nbytes) for p in self.pieces
        ]

    def check(self, data: torch.Tensor, checksums: Mapping[str, ObjectChecksum]) -> None:
        """``data`` (its bytes, on the host) against each piece's published checksum."""
        for p in self.pieces:
            checksum = checksums.get(p.checksum_key)
            if checksum is None:
                raise CorruptObject(f"no published checksum for {p.checksum_key}")
            checksum.check(p.checksum_key, data[p.within : p.within + p.nbytes])

    def row(self, region: str) -> dict[str, object]:
        """The compat layout row :func:`engine_ext.landing.staged_tensors` reads."""
        return {
            "name": self.name,
            "region": region,
            "offset": self.offset,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }


@dataclass(frozen=True)
class Bucket:
    """Tensors ``first .. first + count - 1`` of the layout: bytes ``[start, end)``."""

    index: int
    first: int
    count: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.start < self.end:
            raise InvariantViolation(f"malformed bucket {self}")

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ReceiveLayout:
    tensors: tuple[ReceivedTensor, ...]
    buckets: tuple[Bucket, ...]
    total_bytes: int

    def __post_init__(self) -> None:
        covered = [i for b in self.buckets for i in range(b.first, b.first + b.count)]
        if covered != list(range(len(self.tensors))):
            raise InvariantViolation("buckets must hold every tensor once, in order")

    def bucket_tensors(self, bucket: Bucket) -> tuple[ReceivedTensor, ...]:
        return self.tensors[bucket.first : bucket.first + bucket.count]

    def rows(self, region: str) -> list[dict[str, object]]:
        return [t.row(region) for t in self.tensors]


def receive_layout(manifest: WeightManifest, bucket_bytes: int) -> ReceiveLayout:
    """Tensors in manifest order, each aligned; buckets cut at tensor boundaries, at most
    ``bucket_bytes`` each unless one tensor alone is larger (it then fills one bucket)."""
    if bucket_bytes < 1:
        raise InvariantViolation(f"bucket_bytes must be positive, got {bucket_bytes}")
    specs = {t.tensor_id: t for t in manifest.tensors}
    stored: dict[str, list[StoredPiece]] = {}
    for fragment in manifest.fragments:
        row_bytes = fragment.nbytes // fragment.local_shape[0]
        stored.setdefault(fragment.tensor_id, []).append(
            StoredPiece(
                fragment.object_key,
                fragment.object_offset,
                tensor_checksum_key(manifest.group_id, fragment),
                fragment.global_offset[0] * row_bytes,
                fragment.nbytes,
            )
        )
    tensors: list[ReceivedTensor] = []
    offset = 0
    for name, pieces in stored.items():
        spec = specs[name]
        shape = tuple(int(d) for d in spec.global_shape)
        nbytes = math.prod(shape) * rollout_dtype(spec.dtype).itemsize
        offset = -(-offset // ALIGN) * ALIGN
        ordered = tuple(sorted(pieces, key=lambda p: p.within))
        tensors.append(ReceivedTensor(name, ordered, offset, shape, spec.dtype, nbytes))
        offset += nbytes
    buckets: list[Bucket] = []
    first = 0
    for index, tensor in enumerate(tensors):
        following = tensors[index + 1] if index + 1 < len(tensors) else None
        start = tensors[first].offset
        if following is None or following.offset + following.nbytes - start > bucket_bytes:
            end = tensor.offset + tensor.nbytes
            buckets.append(Bucket(len(buckets), first, index + 1 - first, start, end))
            first = index + 1
    return ReceiveLayout(tuple(tensors), tuple(buckets), offset)
