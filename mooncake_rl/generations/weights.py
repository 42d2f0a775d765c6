"""Read a model's active generation as ``(checkpoint name, tensor)`` pairs.

This is what ``--load-format mooncake`` feeds an engine's own ``load_weights`` (vLLM and
SGLang alike): a restarted or newly added engine starts from the Store, never from disk.
Every object is checked against the generation's checksum table (its whole XXH3-128) before
its tensor is yielded, so a corrupted object fails the load with ``CorruptObject`` naming it
and an engine never starts on bytes its publisher did not write.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import rollout_dtype
from mooncake_rl.generations.registry import ActiveRecord, GenerationRegistry, require_active
from mooncake_rl.store import StoreClient


def active_weights(
    store: StoreClient, model: str
) -> tuple[ActiveRecord, Iterator[tuple[str, torch.Tensor]]]:
    """The active record and its generation's tensors, read and checked one object at a time."""
    registry = GenerationRegistry(store, model)
    record = require_active(store, model, "cannot load weights from the Store")
    manifest = registry.load_manifest(record.generation, record.manifest_digest)
    checksums = registry.load_checksums(record.generation, record.checksums_digest).objects
    specs = {t.tensor_id: t for t in manifest.tensors}
    unlisted = [f.object_key for f in manifest.fragments if f.object_key not in checksums]
    if unlisted:
        raise InvariantViolation(
            f"generation {record.generation} of {model}: no published checksum for {unlisted[0]}"
        )

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for fragment in manifest.fragments:
            spec = specs[fragment.tensor_id]
            data = bytearray(store.get_bytes(fragment.object_key))
            checksums[fragment.object_key].check(fragment.object_key, data)
            yield (
                spec.tensor_id,
                torch.frombuffer(data, dtype=rollout_dtype(spec.dtype)).view(spec.global_shape),
            )

    return record, tensors()
