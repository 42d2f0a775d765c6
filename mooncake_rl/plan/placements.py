"""An engine's described placement, read as direct mode receives it and as the planner
declares it.

One engine's worker descriptions (their boxes) in; out, each worker's receive layout
(:class:`WorkerLayout`, from :func:`engine_layout`: its boxes, regions, stored dtypes and the
full tensors it lands through the engine's ``load_weights``), and from those layouts each
worker's planner part and destinations (:class:`WorkerDemand`, from :func:`engine_parts`).
A 1T MoE's TP8 engine describes a million boxes, so both read them as columns.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import cache
from itertools import chain
from operator import itemgetter, methodcaller, mul
from typing import Any

from mooncake.reshard.weight import (
    OwnershipAxis,
    ParallelRank,
    ReplicatedAxis,
    SplitAxis,
    TensorDescriptor,
    WeightManifest,
)

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan.demand import FALLBACK_REGION, Box, BoxPart, Destinations


@dataclass(frozen=True)
class WorkerLayout:
    """One worker's direct-mode receive layout, read off its description: the boxes it
    receives (``shards``, fallback boxes included), its regions and their stored dtypes,
    and the full tensors it lands through the engine's ``load_weights``. A cache hit needs
    only this; the planner's placement part is built from it on a miss."""

    tp_rank: int
    tp_size: int
    shards: tuple[Mapping[str, Any], ...]
    regions: dict[str, int]
    region_dtypes: dict[str, str]
    fallback: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class WorkerDemand:
    """One worker's direct-mode demand as the planner declares it."""

    part: BoxPart
    destinations: Destinations


def without_fallback(
    workers: Sequence[Mapping[str, Any]], pattern: str | None
) -> Sequence[Mapping[str, Any]]:
    """Worker descriptions with no boxes landing in regions ``pattern`` matches."""
    if pattern is None:
        return workers
    try:
        matches = re.compile(pattern).search
    except re.error as error:
        raise InvariantViolation(f"direct fallback {pattern!r} is not a regex: {error}") from None
    return [{**w, "shards": [s for s in w["shards"] if not matches(s["region"])]} for w in workers]


def engine_layout(
    manifest: WeightManifest, workers: Sequence[Mapping[str, Any]]
) -> dict[str, WorkerLayout]:
    """One engine's TP ranks: which boxes land where.

    A parameter with a box the generation cannot fill (a tensor name it lacks, or another
    global shape: the engine's discovery could not describe it) is not received directly.
    Instead every generation tensor no described box holds is received whole by each worker
    with such a parameter, which lands it through the engine's own loader.

    Every call reads every box (a 1T MoE's TP8 engine describes a million), so the boxes
    are read as columns (tensor, region, global shape) compared in C, and a box at a time
    only where something differs.
    """
    tp_sizes = {int(w["tp_size"]) for w in workers}
    if len(tp_sizes) != 1 or len(workers) != next(iter(tp_sizes)):
        raise InvariantViolation("an engine must describe every TP rank exactly once")
    if {int(w["tp_rank"]) for w in workers} != set(range(len(workers))):
        raise InvariantViolation("an engine must describe every TP rank exactly once")
    tp_size = tp_sizes.pop()
    source = {t.tensor_id: t for t in manifest.tensors}
    shapes = {name: list(t.global_shape) for name, t in source.items()}
    columns = {w["worker_id"]: _BoxColumns.of(w["shards"]) for w in workers}
    # Regions discovery left without boxes, or with a box the generation cannot fill.
    undescribed = {
        w["worker_id"]: columns[w["worker_id"]].unfillable_regions(source, shapes)
        | (set(w["regions"]) - set(columns[w["worker_id"]].regions))
        for w in workers
    }
    direct = {w: c.without(undescribed[w]) for w, c in columns.items()}
    held = set().union(*(c.tensors for c in direct.values()))
    orphans = sorted(set(source) - held)
    needing = [w for w in workers if undescribed[w["worker_id"]]]
    if orphans and not needing:
        raise InvariantViolation(
            f"engine placement lacks tensors the generation has: {orphans[:3]}"
        )
    if needing and not orphans:
        names = sorted(set().union(*undescribed.values()))
        raise InvariantViolation(
            f"no generation tensor can land in engine parameters {names[:3]}: neither a "
            "direct box nor a full tensor for load_weights describes them"
        )
    fallback = _fallback_rows(orphans, source)
    fallback_boxes = [
        {
            "tensor": row["name"],
            "global_shape": row["shape"],
            "global_offset": [0] * len(row["shape"]),
            "local_shape": row["shape"],
            "region": FALLBACK_REGION,
            "region_offset": row["offset"],
        }
        for row in fallback
    ]
    stored = {t.tensor_id: t.dtype for t in manifest.tensors}
    out = {}
    for w in workers:
        worker_id = w["worker_id"]
        described = w["regions"]
        if undescribed[worker_id]:
            described = {k: v for k, v in described.items() if k not in undescribed[worker_id]}
        regions = dict(zip(described, map(int, map(_BYTES, described.values())), strict=True))
        lands_fallback = bool(undescribed[worker_id])
        if lands_fallback and fallback:
            regions[FALLBACK_REGION] = fallback[-1]["offset"] + fallback[-1]["nbytes"]
        mine = direct[worker_id]
        out[worker_id] = WorkerLayout(
            int(w["tp_rank"]),
            tp_size,
            tuple(mine.shards) + (tuple(fallback_boxes) if lands_fallback else ()),
            regions,
            mine.region_dtypes(stored),
            fallback if lands_fallback else (),
        )
    return out


_TENSOR, _REGION = itemgetter("tensor"), itemgetter("region")
_GLOBAL_OFFSET, _LOCAL_SHAPE = itemgetter("global_offset"), itemgetter("local_shape")
_REGION_OFFSET, _BYTES = itemgetter("region_offset"), itemgetter("bytes")
_GLOBAL_SHAPE = methodcaller("get", "global_shape")


@dataclass(frozen=True)
class _BoxColumns:
    """A worker's described boxes, and their tensor and region names as columns."""

    shards: Sequence[Mapping[str, Any]]
    tensors: list[str]
    regions: list[str]

    @classmethod
    def of(cls, shards: Sequence[Mapping[str, Any]]) -> _BoxColumns:
        return cls(shards, list(map(_TENSOR, shards)), list(map(_REGION, shards)))

    def unfillable_regions(
        self, source: Mapping[str, TensorDescriptor], shapes: Mapping[str, list[int]]
    ) -> set[str]:
        """Regions with a box naming a tensor the generation lacks, or another global shape
        (a box without one is placed by the box alone)."""
        expected = list(map(shapes.get, self.tensors))
        if None not in expected and list(map(_GLOBAL_SHAPE, self.shards)) == expected:
            return set()
        return {
            region
            for shard, tensor, region in zip(self.shards, self.tensors, self.regions, strict=True)
            if tensor not in source
            or (
                shard.get("global_shape") is not None
                and tuple(shard["global_shape"]) != source[tensor].global_shape
            )
        }

    def without(self, regions: set[str]) -> _BoxColumns:
        if not regions:
            return self
        keep = [i for i, region in enumerate(self.regions) if region not in regions]
        return _BoxColumns(
            [self.shards[i] for i in keep],
            [self.tensors[i] for i in keep],
            [self.regions[i] for i in keep],
        )

    def region_dtypes(self, stored: Mapping[str, str]) -> dict[str, str]:
        """The stored dtype landing in each region; one region never mixes dtypes."""
        dtypes = list(map(stored.__getitem__, self.tensors))
        by_region = dict(zip(self.regions, dtypes, strict=True))
        if (
            len(by_region) < len(dtypes)
            and list(map(by_region.__getitem__, self.regions)) != dtypes
        ):
            first: dict[str, str] = {}
            for region, dtype in zip(self.regions, dtypes, strict=True):
                if first.setdefault(region, dtype) != dtype:
                    raise InvariantViolation(f"region {region} would receive mixed dtypes")
        return by_region


def engine_parts(
    manifest: WeightManifest, layouts: Mapping[str, WorkerLayout]
) -> dict[str, WorkerDemand]:
    """One engine's TP ranks as placement parts, and where each fragment lands."""
    source = {t.tensor_id: t for t in manifest.tensors}
    tp_size = next(iter(layouts.values())).tp_size
    # One tuple object per distinct offset or shape: a 1T MoE's boxes repeat a few dozen,
    # and the parts are kept, so 360k equal tuples would outlive the plan and each
    # collector pass would walk them.
    interned: dict[tuple[int, ...], tuple[int, ...]] = {}

    def distinct(rows: Iterable[Sequence[int]]) -> list[tuple[int, ...]]:
        made = list(map(tuple, rows))
        return list(map(interned.setdefault, made, made))

    columns = {
        worker_id: (
            list(map(_TENSOR, layout.shards)),
            distinct(map(_GLOBAL_OFFSET, layout.shards)),
            distinct(map(_LOCAL_SHAPE, layout.shards)),
        )
        for worker_id, layout in layouts.items()
    }
    shapes = [(tensors, local) for tensors, _, local in columns.values()]
    # Each distinct offset and shape spelled once, as ``str`` would (box ids name them), and
    # looked up by identity: ``distinct`` made one object per value.
    spelled = {id(row): str(row) for row in interned.values()}.__getitem__
    descriptors = _target_descriptors(source, shapes, tp_size)
    itemsize = {name: t.itemsize for name, t in source.items()}
    out = {}
    for worker_id, layout in layouts.items():
        rank = ParallelRank(tp=layout.tp_rank)
        # A box's id spells out its rank, tensor and box (planned groups share the ids of
        # equal boxes); mooncake.reshard's canonical id, a SHA-256 of the box's JSON, costs
        # more than the rest of it. Column passes: a 1T MoE's TP8 engine has a million boxes.
        shards = layout.shards
        tensors, offsets, shapes = columns[worker_id]
        ids = list(
            map(
                f"tp{rank.tp}/{{}}@{{}}+{{}}".format,
                tensors,
                map(spelled, map(id, offsets)),
                map(spelled, map(id, shapes)),
            )
        )
        nbytes = map(mul, map(math.prod, shapes), map(itemsize.__getitem__, tensors))
        boxes = Box.columns(ids, tensors, offsets, shapes, nbytes)
        part = BoxPart(rank, tuple(map(descriptors.__getitem__, dict.fromkeys(tensors))), boxes)
        destinations = Destinations(
            tuple(layout.regions),
            tuple(layout.regions.values()),
            tuple(ids),
            tuple(map(_REGION, shards)),
            tuple(map(int, map(_REGION_OFFSET, shards))),
        )
        out[worker_id] = WorkerDemand(part, destinations)
    return out


def _fallback_rows(
    names: Sequence[str], source: Mapping[str, TensorDescriptor], align: int = 64
) -> tuple[dict[str, Any], ...]:
    """Where each full fallback tensor sits in the fallback region (aligned, name order)."""
    rows, offset = [], 0
    for name in names:
        tensor = source[name]
        nbytes = math.prod(tensor.global_shape) * tensor.itemsize
        rows.append(
            {
                "name": name,
                "region": FALLBACK_REGION,
                "offset": offset,
                "shape": list(tensor.global_shape),
                "dtype": tensor.dtype,
                "nbytes": nbytes,
            }
        )
        offset += -(-nbytes // align) * align
    return tuple(rows)


def _target_descriptors(
    source: Mapping[str, TensorDescriptor],
    ranks: Iterable[tuple[list[str], list[tuple[int, ...]]]],
    tp_size: int,
) -> dict[str, TensorDescriptor]:
    """Each described tensor as the engine places it: split along one dim, replicated, or
    owned. ``ranks``: each rank's boxes as (tensor, local shape) columns. A box cuts the
    dims where its shape is not the tensor's (an offset elsewhere would put it out of
    bounds, which its part refuses).

    mooncake.reshard's constructor takes ~20 us a descriptor, 3 s for the 140k tensors of
    a 1T MoE, to check the manifest's own descriptor (already checked) with a placement
    that repeats. So it runs once per distinct placement (dims, split dims, axes), and
    every other tensor takes that checked placement. Descriptors are made in the order
    the boxes name their tensors, the order later passes read them in: made in a set's
    order they lie scattered in memory and those passes ran twice as slow."""
    shaped: set[tuple[str, tuple[int, ...]]] = set()
    held: list[dict[str, None]] = []  # each rank's tensors, in box order (docstring)
    for tensors, shapes in ranks:
        shaped.update(zip(tensors, shapes, strict=True))
        held.append(dict.fromkeys(tensors))
    holders = Counter(chain.from_iterable(held))  # counted in C, first-seen order
    split_dims = cache(_split_dims)
    cut: dict[str, tuple[int, ...]] = {}  # the dims some box of the tensor cuts
    for tensor, shape in shaped:
        dims = split_dims(source[tensor].global_shape, shape)
        if dims and cut.setdefault(tensor, dims) != dims:
            cut[tensor] = tuple(sorted({*cut[tensor], *dims}))
    checked: dict[tuple, TensorDescriptor] = {}
    out = {}
    for name, held_by in holders.items():
        descriptor = source[name]
        split = cut.get(name, ())
        if len(split) > 1:
            raise InvariantViolation(f"{name} is split along several dimensions")
        if split:
            kind = "split"
        elif tp_size == 1:
            kind = "whole"
        else:  # on every rank, or owned by fewer (an expert under EP)
            kind = "replicated" if held_by == tp_size else "owned"
        placement = (len(descriptor.global_shape), split, kind, descriptor.expert_id is None)
        like = checked.get(placement)
        if like is None:
            like = checked[placement] = out[name] = replace(
                descriptor, shard_dims=split, parallel_axes=_AXES[kind](split)
            )
        else:
            out[name] = placed_like(descriptor, like)
    return out


_AXES: dict[str, Callable[[tuple[int, ...]], tuple[Any, ...]]] = {
    "split": lambda split: (SplitAxis("tp", split[0]),),
    "whole": lambda split: (),
    "replicated": lambda split: (ReplicatedAxis("tp"),),
    "owned": lambda split: (OwnershipAxis("tp"),),
}


def _split_dims(global_shape: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """Not strict: a box of another rank than its tensor is refused by its part."""
    pairs = zip(shape, global_shape, strict=False)
    return tuple(d for d, (n, whole) in enumerate(pairs) if n != whole)


def placed_like(descriptor: TensorDescriptor, like: TensorDescriptor) -> TensorDescriptor:
    """``descriptor`` with ``like``'s checked placement (shard dims, axes), built without
    the constructor: every field it would check is one it already checked. A copy of its
    fields with the placement's two set: four times faster than setting each field (0.04
    against 0.16 s for a 1T MoE's 140k tensors), for 60 B more per descriptor. Only the
    declared fields: anything else an instance holds (a cached value) may depend on the
    placement."""
    placed = object.__new__(TensorDescriptor)
    own = descriptor.__dict__
    fields_of = own.copy() if len(own) == len(_FIELDS) else {f: own[f] for f in _FIELDS}
    fields_of["shard_dims"], fields_of["parallel_axes"] = like.shard_dims, like.parallel_axes
    object.__setattr__(placed, "__dict__", fields_of)
    return placed


_FIELDS = tuple(f.name for f in fields(TensorDescriptor))
