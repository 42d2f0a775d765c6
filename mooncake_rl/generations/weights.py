"""Read a model's active generation as ``(checkpoint name, tensor)`` pairs.

This is what ``--load-format mooncake`` feeds an engine's own ``load_weights`` (vLLM and
SGLang alike): a restarted or newly added engine starts from the Store, never from disk.
Each Store object (one tensor, or a pack of small ones) is read once and checked against the
generation's checksum table (its whole XXH3-128) before any of its tensors is yielded (a
tensor stored in row blocks, :mod:`.pack_order`, once its last block is read), so a
corrupted object fails the load with ``CorruptObject`` naming it and an engine never starts
on bytes its publisher did not write. A manifest whose packed tensors overlap or run past
their object is refused before anything is read.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import rollout_dtype
from mooncake_rl.generations.chain import object_reader
from mooncake_rl.generations.packing import object_extents
from mooncake_rl.generations.registry import (
    ActiveRecord,
    GenerationInfo,
    GenerationRegistry,
    require_active,
)
from mooncake_rl.store import StoreClient


def active_weights(
    store: StoreClient, model: str
) -> tuple[ActiveRecord, Iterator[tuple[str, torch.Tensor]]]:
    """The active record and its generation's tensors, read and checked one object at a time."""
    record = require_active(store, model, "cannot load weights from the Store")
    return record, generation_weights(store, model, record.info())


def generation_weights(
    store: StoreClient, model: str, info: GenerationInfo
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the announced generation ``info`` names (active or not), read and
    checked one object at a time."""
    registry = GenerationRegistry(store, model)
    manifest = registry.load_manifest(info.generation, info.digest)
    checksums = registry.load_checksums(info.generation, info.checksums_digest).objects
    specs = {t.tensor_id: t for t in manifest.tensors}
    objects = object_extents(manifest, {k: c.nbytes for k, c in checksums.items()})
    unlisted = [key for key in objects if key not in checksums]
    if unlisted:
        raise InvariantViolation(
            f"generation {info.generation} of {model}: no published checksum for {unlisted[0]}"
        )

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        assembling: dict[str, tuple[torch.Tensor, int]] = {}  # rows of a rank-major pack
        read = object_reader(store, model, info.generation)  # a delta: through its chain
        for key, stored in objects.items():
            data = read(key)
            checksums[key].check(key, data)
            for fragment in stored.fragments:
                spec = specs[fragment.tensor_id]
                dtype = rollout_dtype(spec.dtype)
                piece = torch.frombuffer(
                    data,
                    dtype=dtype,
                    count=fragment.nbytes // dtype.itemsize,
                    offset=fragment.object_offset,
                ).view(fragment.local_shape)
                if tuple(fragment.local_shape) == tuple(spec.global_shape):
                    yield spec.tensor_id, piece
                    continue
                full, rows = assembling.get(spec.tensor_id) or (
                    torch.empty(spec.global_shape, dtype=dtype),
                    0,
                )
                first = fragment.global_offset[0]
                full[first : first + fragment.local_shape[0]] = piece
                rows += fragment.local_shape[0]
                if rows < spec.global_shape[0]:
                    assembling[spec.tensor_id] = (full, rows)
                else:
                    assembling.pop(spec.tensor_id, None)
                    yield spec.tensor_id, full

    return tensors()
