"""Where each full tensor of a generation sits in a non-Store transport's receive buffer.

Broadcast and CPU serialization deliver the generation's full tensors, as VeRL's trainer
reconstructs them, to every rank of every engine. Sender and receivers derive the same
layout from the generation's manifest (a pure function of the manifest and the bucket
size), so nothing about it travels on the wire: a bucket is a byte range of the buffer,
holding whole tensors, and a receiver lands it without being told where anything goes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import rollout_dtype
from mooncake_rl.generations.packing import tensor_checksum_key

ALIGN = 64
"""Every tensor starts on this boundary, so each is viewable as its dtype in place."""


@dataclass(frozen=True)
class ReceivedTensor:
    """One full tensor: its checkpoint name, where it is stored (an object, or a pack and
    the offset in it), the checksum-table key of its own bytes, and its place in the buffer."""

    name: str
    object_key: str
    object_offset: int
    checksum_key: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def __post_init__(self) -> None:
        if (
            self.offset % ALIGN
            or self.nbytes != math.prod(self.shape) * rollout_dtype(self.dtype).itemsize
        ):
            raise InvariantViolation(f"malformed received tensor {self}")

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
    tensors: list[ReceivedTensor] = []
    offset = 0
    for fragment in manifest.fragments:
        spec = specs[fragment.tensor_id]
        shape = tuple(int(d) for d in spec.global_shape)
        nbytes = math.prod(shape) * rollout_dtype(spec.dtype).itemsize
        offset = -(-offset // ALIGN) * ALIGN
        tensors.append(
            ReceivedTensor(
                spec.tensor_id,
                fragment.object_key,
                fragment.object_offset,
                tensor_checksum_key(manifest.group_id, fragment),
                offset,
                shape,
                spec.dtype,
                nbytes,
            )
        )
        offset += nbytes
    if len({t.name for t in tensors}) != len(tensors):
        raise InvariantViolation(
            f"generation {manifest.weight_generation} stores a tensor in several fragments; "
            "broadcast and CPU serialization deliver whole tensors only"
        )
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
