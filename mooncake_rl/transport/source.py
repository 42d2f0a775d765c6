"""Reading one generation for a non-Store transport: every object once, checked, in buckets."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mooncake_rl.generations.catalog import rollout_dtype
from mooncake_rl.generations.registry import ActiveRecord, GenerationRegistry
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.layout import Bucket, ReceiveLayout, receive_layout


@dataclass(frozen=True)
class Source:
    """A generation by its digests, and the bucket size both ends lay it out with."""

    model: str
    generation: int
    manifest_digest: str
    checksums_digest: str
    bucket_bytes: int

    @classmethod
    def of(cls, record: ActiveRecord, bucket_bytes: int) -> Source:
        return cls(
            record.model,
            record.generation,
            record.manifest_digest,
            record.checksums_digest,
            bucket_bytes,
        )


def read_buckets(
    store: StoreClient, source: Source
) -> tuple[ReceiveLayout, Iterator[tuple[Bucket, dict[str, torch.Tensor]]]]:
    """The layout, and the generation's tensors bucket by bucket (by checkpoint name),
    each object read from the Store once and checked against its checksum."""
    registry = GenerationRegistry(store, source.model)
    manifest = registry.load_manifest(source.generation, source.manifest_digest)
    checksums = registry.load_checksums(source.generation, source.checksums_digest).objects
    layout = receive_layout(manifest, source.bucket_bytes)

    def buckets() -> Iterator[tuple[Bucket, dict[str, torch.Tensor]]]:
        for bucket in layout.buckets:
            tensors = {}
            for tensor in layout.bucket_tensors(bucket):
                data = bytearray(store.get_bytes(tensor.object_key))
                checksums[tensor.object_key].check(tensor.object_key, data)
                dtype = rollout_dtype(tensor.dtype)
                tensors[tensor.name] = torch.frombuffer(data, dtype=dtype).view(tensor.shape)
            yield bucket, tensors

    return layout, buckets()
