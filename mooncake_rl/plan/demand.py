"""What each rollout worker needs: byte ranges of Store objects and where they land.

Objects are named relative to their generation's payload prefix, so demands — and every
plan built from them — are the same for every generation with the same layout.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake.reshard.weight import (
    OwnershipAxis,
    ParallelRank,
    ParallelTopology,
    PlacementFragment,
    ReplicatedAxis,
    SplitAxis,
    TensorDescriptor,
    TopologyParticipant,
    WeightManifest,
    WeightPlacementManifest,
    plan_stored_transfer_to_target_placement,
)

from mooncake_rl.errors import InvariantViolation

ALIGN = 64
COMPAT_REGION = "model"


@dataclass(frozen=True, order=True)
class Demand:
    """Worker ``worker`` needs bytes [src_offset, +length) of ``obj`` at ``region``+dst_offset."""

    obj: str
    src_offset: int
    length: int
    worker: str
    region: str
    dst_offset: int

    def __post_init__(self) -> None:
        if self.src_offset < 0 or self.dst_offset < 0 or self.length <= 0:
            raise InvariantViolation(f"invalid demand {self}")


@dataclass(frozen=True)
class SourceLayout:
    """The generation-independent shape of a published generation."""

    object_sizes: Mapping[str, int]
    tensors: Mapping[str, TensorDescriptor]
    fragment_objects: Mapping[str, tuple[str, int]]  # tensor -> (object, offset) for full tensors
    digest: str


def source_layout(manifest: WeightManifest) -> SourceLayout:
    prefix = f"{manifest.group_id}/payload/"
    sizes: dict[str, int] = {}
    where: dict[str, tuple[str, int]] = {}
    rows = []
    for fragment in manifest.fragments:
        name = fragment.object_key.removeprefix(prefix)
        sizes[name] = max(sizes.get(name, 0), fragment.object_offset + fragment.nbytes)
        where[fragment.tensor_id] = (name, fragment.object_offset)
        rows.append(
            [
                fragment.tensor_id,
                name,
                fragment.object_offset,
                fragment.nbytes,
                list(fragment.global_offset),
                list(fragment.local_shape),
            ]
        )
    tensors = {t.tensor_id: t for t in manifest.tensors}
    for t in manifest.tensors:
        rows.append([t.tensor_id, list(t.global_shape), t.dtype, t.itemsize])
    digest = hashlib.sha256(json.dumps(sorted(map(str, rows))).encode()).hexdigest()
    return SourceLayout(sizes, tensors, where, digest)


@dataclass(frozen=True)
class CompatEntry:
    """Where one full tensor sits in a compat worker's staging region."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "region": COMPAT_REGION,
            "offset": self.offset,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }


def compat_layout(layout: SourceLayout) -> tuple[list[CompatEntry], int]:
    """Every full tensor, in manifest order, 64-byte aligned in one staging region."""
    entries, cursor = [], 0
    for name, descriptor in layout.tensors.items():
        entries.append(CompatEntry(name, cursor, descriptor.global_shape, descriptor.dtype))
        nbytes = math.prod(descriptor.global_shape) * descriptor.itemsize
        cursor += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return entries, cursor


def compat_demands(layout: SourceLayout, workers: Iterable[str]) -> list[Demand]:
    """Compat mode: every worker needs every full tensor (the engine's loader shards it)."""
    entries, _ = compat_layout(layout)
    demands = []
    for worker in sorted(workers):
        for entry in entries:
            obj, offset = layout.fragment_objects[entry.name]
            nbytes = math.prod(entry.shape) * layout.tensors[entry.name].itemsize
            demands.append(Demand(obj, offset, nbytes, worker, COMPAT_REGION, entry.offset))
    return demands


@dataclass(frozen=True)
class Shard:
    """A box of checkpoint tensor ``tensor`` held by ``worker`` at ``region``+``region_offset``."""

    worker: str
    tp_rank: int
    tensor: str
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    region: str
    region_offset: int


def direct_demands(
    manifest: WeightManifest, engine_shards: Sequence[Shard], tp_size: int
) -> list[Demand]:
    """Direct mode for one engine: its TP ranks' exact shards, planned by mooncake.reshard."""
    layout = source_layout(manifest)
    try:
        placement, destination = _placement(manifest, engine_shards, tp_size)
        plan = plan_stored_transfer_to_target_placement(manifest, placement)
    except ValueError as error:  # mooncake.reshard states the violated contract
        raise InvariantViolation(
            f"engine placement rejected by mooncake.reshard: {error}"
        ) from error
    prefix = f"{manifest.group_id}/payload/"
    demands = []
    for op in plan.operations:
        worker, region, base = destination[op.target.placement_fragment_id]
        obj = op.source.object_key.removeprefix(prefix)
        for src, dst, length in op.iter_segments(
            max_segments=plan.planning_limits.max_segments_per_region
        ):
            demands.append(
                Demand(obj, op.source.object_offset + src, length, worker, region, base + dst)
            )
    if not layout.object_sizes:
        raise InvariantViolation("empty manifest")
    return _coalesce(demands)


def _coalesce(demands: list[Demand]) -> list[Demand]:
    """Merge segments contiguous in both source and destination (row-wise lowering)."""
    merged: list[Demand] = []
    for demand in sorted(demands, key=lambda d: (d.worker, d.region, d.dst_offset)):
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.worker == demand.worker
            and last.region == demand.region
            and last.obj == demand.obj
            and last.dst_offset + last.length == demand.dst_offset
            and last.src_offset + last.length == demand.src_offset
        ):
            merged[-1] = Demand(
                last.obj,
                last.src_offset,
                last.length + demand.length,
                last.worker,
                last.region,
                last.dst_offset,
            )
        else:
            merged.append(demand)
    return merged


def _placement(
    manifest: WeightManifest, shards: Sequence[Shard], tp_size: int
) -> tuple[WeightPlacementManifest, dict[str, tuple[str, str, int]]]:
    source = {t.tensor_id: t for t in manifest.tensors}
    by_tensor: dict[str, list[Shard]] = {}
    for shard in shards:
        if shard.tensor not in source:
            raise InvariantViolation(f"engine holds {shard.tensor!r}, which the generation lacks")
        by_tensor.setdefault(shard.tensor, []).append(shard)
    missing = sorted(set(source) - set(by_tensor))
    if missing:
        raise InvariantViolation(
            f"engine placement lacks tensors the generation has: {missing[:3]}"
        )
    tensors, fragments, destination = [], [], {}
    for name, tensor_shards in by_tensor.items():
        descriptor = source[name]
        split = sorted(
            {
                d
                for s in tensor_shards
                for d, (o, n) in enumerate(zip(s.global_offset, s.local_shape, strict=True))
                if o != 0 or n != descriptor.global_shape[d]
            }
        )
        if len(split) > 1:
            raise InvariantViolation(f"{name} is split along several dimensions {split}")
        holders = {shard.tp_rank for shard in tensor_shards}
        if split:
            axes: tuple[Any, ...] = (SplitAxis("tp", split[0]),)
        elif tp_size == 1:
            axes = ()
        elif len(holders) == tp_size:
            axes = (ReplicatedAxis("tp"),)
        else:
            axes = (OwnershipAxis("tp"),)  # e.g. an expert owned by one rank under EP
        target = TensorDescriptor(
            tensor_id=name,
            global_shape=descriptor.global_shape,
            dtype=descriptor.dtype,
            itemsize=descriptor.itemsize,
            shard_dims=tuple(split),
            layout_fingerprint=descriptor.layout_fingerprint,
            parallel_axes=axes,
        )
        tensors.append(target)
        for shard in tensor_shards:
            fragment = PlacementFragment(
                tensor_id=name,
                global_offset=shard.global_offset,
                local_shape=shard.local_shape,
                nbytes=math.prod(shard.local_shape) * descriptor.itemsize,
                rank=ParallelRank(tp=shard.tp_rank),
            )
            fragments.append(fragment)
            destination[fragment.placement_fragment_id] = (
                shard.worker,
                shard.region,
                shard.region_offset,
            )
    topology = ParallelTopology(
        tp_size=tp_size,
        pp_size=1,
        ep_size=1,
        dp_size=1,
        participants=tuple(
            TopologyParticipant(f"tp{r}", ParallelRank(tp=r)) for r in range(tp_size)
        ),
    )
    placement = WeightPlacementManifest.from_fragments(
        resource_id=manifest.resource_id,
        revision=manifest.revision,
        weight_generation=manifest.weight_generation,
        placement_set_id="mooncake-rl",
        topology=topology,
        tensors=tensors,
        fragments=fragments,
    )
    return placement, destination
