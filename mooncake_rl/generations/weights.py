"""Read a model's active generation as ``(checkpoint name, tensor)`` pairs.

This is what ``--load-format mooncake`` feeds an engine's own ``load_weights`` (vLLM and
SGLang alike): a restarted or newly added engine starts from the Store, never from disk.
Each Store object (one tensor, or a pack of small ones) is read once and checked against the
generation's checksum table (its whole XXH3-128) before any of its tensors is yielded, so a
corrupted object fails the load with ``CorruptObject`` naming it and an engine never starts
on bytes its publisher did not write. A manifest whose packed tensors overlap or run past
their object is refused before anything is read.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import rollout_dtype
from mooncake_rl.generations.packing import object_extents
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
    objects = object_extents(manifest, {k: c.nbytes for k, c in checksums.items()})
    unlisted = [key for key in objects if key not in checksums]
    if unlisted:
        raise InvariantViolation(
            f"generation {record.generation} of {model}: no published checksum for {unlisted[0]}"
        )

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key, stored in objects.items():
            data = bytearray(store.get_bytes(key))
            checksums[key].check(key, data)
            for fragment in stored.fragments:
                spec = specs[fragment.tensor_id]
                yield (
                    spec.tensor_id,
                    torch.frombuffer(
                        data,
                        dtype=rollout_dtype(spec.dtype),
                        count=fragment.nbytes // rollout_dtype(spec.dtype).itemsize,
                        offset=fragment.object_offset,
                    ).view(spec.global_shape),
                )

    return record, tensors()
