"""What ``mooncake-rl publish``, ``status`` and ``gc`` do, over a Store client."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open

from mooncake_rl.errors import ConfigurationError, MooncakeRLError, ObjectNotFound
from mooncake_rl.generations.chain import (
    DEFAULT_DELTA_FRACTION,
    CorruptDelta,
    DeltaPolicy,
    chain_of,
    load_delta_table,
    object_reader,
)
from mooncake_rl.generations.gc import collect_garbage
from mooncake_rl.generations.packing import DEFAULT_PACK_BYTES, object_extents
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import (
    ActiveRecord,
    GenerationRegistry,
    no_active_message,
)
from mooncake_rl.store import StoreClient


def checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a local safetensors checkpoint, files and names in sorted order."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigurationError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as checkpoint:
            for name in sorted(checkpoint.keys()):
                yield name, checkpoint.get_tensor(name)


def checkpoint_bytes(model_dir: Path) -> int:
    """Tensor bytes of a local safetensors checkpoint, from the files' headers alone."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as file:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
        total += sum(
            end - start
            for key, row in header.items()
            if key != "__metadata__"
            for start, end in [row["data_offsets"]]
        )
    return total


def publish_checkpoint(
    store: StoreClient,
    model: str,
    model_dir: Path,
    dtype: str,
    replicas: int = 1,
    keep: int = 2,
    pack_bytes: int = DEFAULT_PACK_BYTES,
    published: Callable[[int], None] | None = None,
    delta_every: int | None = None,
    delta_max_fraction: float = DEFAULT_DELTA_FRACTION,
) -> ActiveRecord:
    """``published(nbytes)`` after each checkpoint tensor is handed to the publisher;
    ``delta_every``: publish a delta against the newest generation, with a keyframe at least
    every that many (:class:`~.chain.DeltaPolicy`); its base is read back from the Store."""
    tensors = checkpoint_tensors(model_dir)
    if published is not None:
        tensors = _counted(tensors, published)
    delta = None if delta_every is None else DeltaPolicy(delta_every, delta_max_fraction)
    return publish_local(
        store,
        model,
        tensors,
        dtype=dtype,
        replica_num=replicas,
        keep=keep,
        pack_bytes=pack_bytes,
        delta=delta,
    )


def _counted(
    tensors: Iterator[tuple[str, torch.Tensor]], published: Callable[[int], None]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name, tensor
        published(tensor.nbytes)


def generation_status(
    store: StoreClient, model: str, with_segments: bool = True
) -> dict[str, object]:
    """Active generation and every indexed generation: bytes, tensors, digest, whether every
    object is readable (a lost segment holder makes a generation unreadable), placement."""
    registry = GenerationRegistry(store, model)
    active = registry.active()
    incarnation = registry.incarnation()
    rows = []
    for info in registry.generations():
        row: dict[str, object] = {
            **asdict(info),
            "active": bool(active and active.generation == info.generation),
        }
        try:
            manifest = registry.load_manifest(info.generation, info.digest)
            problems = registry.unreadable(info.generation, info.digest)
        except MooncakeRLError as error:
            manifest, problems = None, [f"manifest unreadable: {error}"]
        row["readable"] = not problems
        row["unreadable_objects"] = problems
        if with_segments and manifest is not None:
            per_segment: Counter[str] = Counter()
            objects = object_extents(manifest)
            for key, stored in objects.items():
                with contextlib.suppress(ObjectNotFound):
                    for segment in store.replica_segments(key):
                        per_segment[segment] += stored.nbytes
            row["bytes_per_segment"] = dict(sorted(per_segment.items()))
            row["objects"] = len(objects)
        rows.append(row)
    return {
        "model": model,
        "problem": None if active else no_active_message(store, model, "nothing to serve"),
        "incarnation": incarnation.id if incarnation else None,
        "active": active.generation if active else None,
        "fence": active.fence if active else None,
        "generations": rows,
    }


def activate_generation(store: StoreClient, model: str, generation: int) -> dict[str, object]:
    """Move the active record to an older, fully readable generation (a new fence)."""
    record = GenerationRegistry(store, model).activate(generation)
    return {"model": model, "active": record.generation, "fence": record.fence}


def gc_generations(store: StoreClient, model: str, keep: int) -> dict[str, object]:
    report = collect_garbage(store, model, keep)
    return {
        "model": model,
        "kept": list(report.kept),
        "deleted": list(report.deleted),
        "removed_objects": report.removed_objects,
        "failures": dict(report.failures),
    }


def verify_generation(
    store: StoreClient, model: str, generation: int | None = None
) -> dict[str, object]:
    """Is a generation whole and intact? Manifest digest, every payload present with its exact
    size, the checksum table sealed by its digest, and every object's bytes read back and
    compared with its published XXH3-128 (each corrupted object is one problem)."""
    from mooncake_rl.generations.checksums import CorruptObject  # this function's own import

    registry = GenerationRegistry(store, model)
    active = registry.active()
    if generation is None:
        if active is None:
            problem = no_active_message(store, model, "nothing to verify")
            return {"model": model, "ok": False, "problems": [problem]}
        generation = active.generation
    if active is not None and active.generation == generation:
        digest, checksums_digest = active.manifest_digest, active.checksums_digest
    else:
        info = next((i for i in registry.generations() if i.generation == generation), None)
        digest = info.digest if info else None
        checksums_digest = info.checksums_digest if info else None
    manifest = registry.load_manifest(generation, digest)
    table = load_delta_table(store, model, generation)
    chain = chain_of(store, model, generation)
    problems = registry.unreadable(generation, digest)
    read = object_reader(store, model, generation)
    checked = 0
    if checksums_digest is None:
        problems.append(f"generation {generation} is not in the index: no checksum table to check")
    else:
        try:
            table = registry.load_checksums(generation, checksums_digest).objects
        except MooncakeRLError as error:
            table, problems = {}, [*problems, f"checksum table unreadable: {error}"]
        objects = object_extents(manifest)
        sizes = store.complete_sizes(list(objects)) if not chain.deltas else [None] * len(objects)
        unreadable = {
            key
            for (key, stored), size in zip(objects.items(), sizes, strict=True)
            if size != stored.nbytes and not chain.deltas
        }
        for key, stored in objects.items() if table else ():
            if key in unreadable:
                continue
            if key not in table:
                problems.append(f"no checksum for {key}")
                continue
            try:
                table[key].check(key, read(key))
                checked += stored.nbytes
            except CorruptObject:
                problems.append(f"corrupted {key}: its bytes differ from the published checksum")
            except CorruptDelta as error:
                problems.append(f"corrupted delta: {error}")
            except MooncakeRLError as error:
                problems.append(f"unreadable {key}: {error}")
    return {
        "model": model,
        "generation": generation,
        "ok": not problems,
        "tensors": len(manifest.tensors),
        "objects": len({f.object_key for f in manifest.fragments}),
        "bytes": sum(f.nbytes for f in manifest.fragments),
        "checked_bytes": checked,
        "digest": manifest.manifest_digest,
        "chain": list(chain.generations) if table is not None else None,
        "problems": problems,
    }
