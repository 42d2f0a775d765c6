"""Turn declared demands into demanded runs with concrete destinations.

Output (:class:`DemandSet`): *pieces* (a strided source run plus the destination pitch)
and, per piece, its consumers as (worker, region, offset of the piece's first byte in that
region). Instances whose placements are equal form one group that is planned once; the
consumers of a group's piece are the workers holding its slot in every instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import filterfalse, pairwise, repeat
from operator import attrgetter, is_

import numpy as np
from mooncake.reshard.weight import ParallelRank, WeightManifest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan import grid
from mooncake_rl.plan.demand import (
    COMPAT_REGION,
    STAGING_REGION,
    Box,
    CompatDemand,
    CompatLayout,
    Destinations,
    DirectDemand,
    compat_layout,
)
from mooncake_rl.plan.reshard import TargetGroup, plan_group
from mooncake_rl.plan.source import SourceLayout
from mooncake_rl.plan.table import DEMAND_DTYPE
from mooncake_rl.plan.topology import Topology

I64 = np.int64


@dataclass(frozen=True, eq=False)
class DemandSet:
    """Every demanded run and where it lands; the input of merge and of the validator.

    Piece ``p`` reads ``count[p]`` rows of ``length[p]`` bytes at ``src_offset[p] + k *
    src_stride[p]`` of object ``obj[p]``; consumer ``c`` of it (``ptr[p] <= c < ptr[p+1]``)
    receives row ``k`` at ``dst_offset[c] + k * dst_stride[p]`` of region ``region[c]`` of
    worker ``worker[c]``. ``region_worker/region_id/region_size`` declare every region a
    consumer may be written in; ``regions`` names region ids (0 is staging).
    """

    regions: tuple[str, ...]
    obj: np.ndarray
    src_offset: np.ndarray
    length: np.ndarray
    count: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray
    ptr: np.ndarray
    worker: np.ndarray
    region: np.ndarray
    dst_offset: np.ndarray
    region_worker: np.ndarray
    region_id: np.ndarray
    region_size: np.ndarray
    lower_bound_bytes: int
    compat: CompatLayout | None


def demand_set(
    manifest: WeightManifest,
    layout: SourceLayout,
    topology: Topology,
    demand: CompatDemand | DirectDemand,
) -> DemandSet:
    """Plan every distinct placement once and attach each consumer's destination."""
    if isinstance(demand, CompatDemand):
        return _compat(manifest, layout, topology, demand)
    if isinstance(demand, DirectDemand):
        return _direct(manifest, layout, topology, demand)
    raise InvariantViolation(f"unknown demand type {type(demand).__name__}")


def _compat(manifest, layout, topology, demand: CompatDemand) -> DemandSet:
    packed = compat_layout(layout, demand.align)
    n_tensors = len(layout.tensors)
    target = TargetGroup(
        slots=(ParallelRank(),),
        descriptors=layout.tensors,
        geometry=tuple(
            ((0, (0,) * len(t.global_shape), t.global_shape, int(packed.nbytes[i]), None),)
            for i, t in enumerate(layout.tensors)
        ),
        fragment_ptr=np.arange(n_tensors + 1, dtype=I64),
        fragment_key=np.arange(n_tensors, dtype=I64),
        fragment_slot=np.zeros(n_tensors, dtype=I64),
    )
    runs = plan_group(manifest, layout, target)
    n = len(topology.workers)
    workers = np.arange(n, dtype=I64)
    consumers = np.tile(workers, len(runs.obj))
    region = np.full(len(consumers), 1, I64)
    dst = np.repeat(packed.offsets[runs.fkey] + runs.dst_offset, n)
    return DemandSet(
        regions=(STAGING_REGION, COMPAT_REGION),
        obj=runs.obj,
        src_offset=runs.src_offset,
        length=runs.length,
        count=runs.count,
        src_stride=runs.src_stride,
        dst_stride=runs.dst_stride,
        ptr=np.arange(len(runs.obj) + 1, dtype=I64) * n,
        worker=consumers,
        region=region,
        dst_offset=dst,
        region_worker=workers,
        region_id=np.ones(n, I64),
        region_size=np.full(n, packed.total_bytes, I64),
        lower_bound_bytes=n * int(packed.nbytes.sum()),
        compat=packed,
    )


def _direct(manifest, layout, topology: Topology, demand: DirectDemand) -> DemandSet:
    parts = dict(demand.parts)
    destinations = dict(demand.destinations)
    unknown = sorted(set(parts) - set(topology.worker_index))
    if unknown:
        raise InvariantViolation(f"placement part for unknown worker {unknown[0]}")
    missing = [w for w in topology.worker_ids if w not in parts]
    if missing:
        raise InvariantViolation(f"worker {missing[0]} declares no placement part")
    fkeys: dict[str, int] = {}
    fkey_nbytes: list[int] = []
    groups: list[tuple[tuple, list[list[int]]]] = []
    for instance, members in topology.instances:
        slots = sorted(members, key=lambda w: _rank_order(parts[topology.worker_ids[w]].rank))
        ranks = [parts[topology.worker_ids[w]].rank for w in slots]
        if len(set(ranks)) != len(ranks):
            raise InvariantViolation(f"instance {instance} has two workers with one rank")
        for w, rank in zip(slots, ranks, strict=True):
            declared = topology.workers[w].tp_rank
            if declared is not None and declared != rank.tp:
                raise InvariantViolation(
                    f"worker {topology.worker_ids[w]}: tp_rank {declared} != part rank {rank}"
                )
        signature = tuple(
            (p.rank, p.tensors, p.fragments) for p in (parts[topology.worker_ids[w]] for w in slots)
        )
        for existing, rows in groups:
            if existing == signature:
                rows.append(slots)
                break
        else:
            groups.append((signature, [slots]))
    planned = []
    for signature, rows in groups:
        target = _target_group(layout, signature, fkeys, fkey_nbytes)
        planned.append((plan_group(manifest, layout, target), target, np.array(rows, I64)))
    return _assemble_direct(topology, planned, fkeys, fkey_nbytes, destinations)


def _rank_order(rank: ParallelRank) -> tuple[int, int, int, int]:
    return (rank.dp, rank.pp, rank.ep, rank.tp)


_PLACED = attrgetter(
    "tensor_id",
    "global_offset",
    "local_shape",
    "nbytes",
    "pipeline_stage_id",
    "placement_fragment_id",
    "aliases",
)


_TENSOR_ID = attrgetter("tensor_id")


def _placed_columns(fragments: Sequence) -> tuple[Sequence, ...]:
    """A part's fragments as columns in ``_PLACED``'s order. Boxes are tuples already, and
    transposed in one C-level pass rather than re-made field by field (a 1T MoE's TP8
    engine has a million)."""
    if not fragments:
        return ((),) * 7
    if set(map(type, fragments)) == {Box}:
        ids, tensors, offsets, shapes, nbytes, stages, aliases = zip(*fragments, strict=True)
        return tensors, offsets, shapes, nbytes, stages, ids, aliases
    return tuple(zip(*map(_PLACED, fragments), strict=True))


def _target_group(layout: SourceLayout, signature, fkeys, fkey_nbytes) -> TargetGroup:
    """The target view of one distinct placement, with fragment keys registered.

    Runs once per distinct placement over every fragment, so it sticks to C-level passes.
    """
    descriptors: dict[str, object] = {}
    last: tuple = ()  # the last descriptor tuple merged into ``descriptors``
    columns: list[list] = [[] for _ in range(7)]  # in _PLACED's order
    slot_of: list[int] = []
    for slot, (_, tensors, part_fragments) in enumerate(signature):
        for column, values in zip(columns, _placed_columns(part_fragments), strict=True):
            column.extend(values)
        slot_of.extend([slot] * len(part_fragments))
        if tensors == last:  # TP ranks holding every tensor share the same objects, which
            continue  # tuple equality compares by identity first: nothing new to check
        last = tensors
        mine = dict(zip(map(_TENSOR_ID, tensors), tensors, strict=True))
        shared = list(mine.keys() & descriptors.keys())
        firsts = list(map(descriptors.__getitem__, shared))
        others = list(map(mine.__getitem__, shared))
        if not all(map(is_, firsts, others)):  # ranks share descriptor objects, or equal ones
            for tensor_id, first, other in zip(shared, firsts, others, strict=True):
                if first != other:
                    raise InvariantViolation(f"placement tensor descriptor mismatch: {tensor_id}")
        descriptors.update(mine)
    index = layout.tensor_index
    unknown = sorted(descriptors.keys() - index.keys())
    if unknown:
        raise InvariantViolation(f"target manifests contain unknown tensors: {unknown[0]}")
    if len(descriptors) < len(index):
        absent = next(t.tensor_id for t in layout.tensors if t.tensor_id not in descriptors)
        raise InvariantViolation(f"target manifests are missing tensors: {absent}")
    tensor_ids, offsets, shapes, nbytes, stages, fragment_ids, aliases = columns
    if any(aliases):
        fragment_id = fragment_ids[next(i for i, a in enumerate(aliases) if a)]
        raise InvariantViolation(
            f"placement fragment {fragment_id} declares aliases; "
            "aliased tensors are not supported by the planner"
        )
    n = len(slot_of)
    first_key = len(fkeys)
    if not first_key:  # a first placement: one pass when its ids are distinct (the rule)
        fkeys.update(zip(fragment_ids, range(n), strict=True))
        if len(fkeys) < n:  # an id named twice: numbered at its first row, as below
            fkeys.clear()
    if not first_key and len(fkeys) == n:
        new = fragment_ids
    else:
        new = list(dict.fromkeys(fragment_ids))
        if first_key:  # a later placement group: only ids no earlier group registered
            new = list(filterfalse(fkeys.__contains__, new))
        fkeys.update(zip(new, range(first_key, first_key + len(new)), strict=True))
    if len(new) == n:  # every fragment is new (a first placement): keys in row order
        fragment_key = np.arange(first_key, first_key + n, dtype=I64)
        fkey_nbytes.extend(nbytes)
    else:
        fragment_key = np.fromiter(map(fkeys.__getitem__, fragment_ids), I64, n)
        size_of = dict(zip(fragment_ids, nbytes, strict=True))
        fkey_nbytes.extend(map(size_of.__getitem__, new))
        _require_one_size_per_id(fragment_ids, fragment_key, nbytes, fkey_nbytes)
    tensor = np.fromiter(map(index.__getitem__, tensor_ids), I64, n)
    slot = np.array(slot_of, I64)
    order = grid.lex_order(tensor, slot)
    geometry = list(zip(slot_of, offsets, shapes, nbytes, stages, strict=True))
    starts = np.flatnonzero(grid.group_starts(tensor[order], slot[order]))
    ends = np.append(starts[1:], n)
    several = ends - starts > 1  # a tensor cut into several fragments on one rank
    for a, b in zip(starts[several].tolist(), ends[several].tolist(), strict=True):
        order[a:b] = sorted(order[a:b].tolist(), key=lambda k: geometry[k][1:3])
    counts = np.bincount(tensor, minlength=len(index))
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(I64)
    ordered = [geometry[i] for i in order.tolist()]
    return TargetGroup(
        slots=tuple(rank for rank, _, _ in signature),
        descriptors=tuple(map(descriptors.__getitem__, map(_TENSOR_ID, layout.tensors))),
        geometry=tuple(tuple(ordered[a:b]) for a, b in pairwise(ptr.tolist())),
        fragment_ptr=ptr,
        fragment_key=fragment_key[order],
        fragment_slot=slot[order],
    )


def _require_one_size_per_id(fragment_ids, fragment_key, nbytes, fkey_nbytes) -> None:
    """Ranks (or placements) that reuse a box id must mean boxes of one size by it: the id
    names one region per worker, sized by its first box (different boxes of one size are
    fine, each worker gets its own)."""
    declared = np.array(fkey_nbytes, I64)[fragment_key]
    wrong = np.flatnonzero(declared != np.fromiter(nbytes, I64, len(fragment_key)))
    if len(wrong):
        i = int(wrong[0])
        raise InvariantViolation(
            f"placement fragment id {fragment_ids[i]} names boxes of {int(declared[i])} and "
            f"{nbytes[i]} bytes on different ranks; give each rank's boxes their own ids "
            "(for example prefixed with the rank, as engine descriptions are)"
        )


def _assemble_direct(topology, planned, fkeys, fkey_nbytes, destinations) -> DemandSet:
    """Expand group runs over instances and resolve (worker, fragment) -> (region, base)."""
    # The default region of fragment key f is 1 + f. When every worker has destinations no
    # default is used, so none is named (a 1T MoE's TP8 engine has a million fragments).
    everyone = len(destinations) == len(topology.workers)
    names = [STAGING_REGION] if everyone else [STAGING_REGION, *fkeys]
    region_ids = dict(zip(names, range(len(names)), strict=True)) if destinations else {}
    nbytes = np.array(fkey_nbytes, I64)
    by_dest: dict[int, tuple[Destinations, np.ndarray, np.ndarray]] = {}
    for dest in destinations.values():
        if id(dest) in by_dest:
            continue
        fresh = list(filterfalse(region_ids.__contains__, dest.region_names))
        region_ids.update(zip(fresh, range(len(names), len(names) + len(fresh)), strict=True))
        names.extend(fresh)
        named = np.fromiter(map(region_ids.__getitem__, dest.region_names), I64)
        by_dest[id(dest)] = (dest, *_resolved(dest, fkeys, nbytes, named), named)
    resolver = np.full(len(topology.workers), -1, I64)
    dest_list = list(by_dest.values())
    dest_pos = {id(d): i for i, (d, _, _, _) in enumerate(dest_list)}
    for worker, dest in destinations.items():
        resolver[topology.worker_index[worker]] = dest_pos[id(dest)]

    pieces: list[list[np.ndarray]] = [[] for _ in range(6)]
    consumers: list[list[np.ndarray]] = [[] for _ in range(4)]
    rows: list[list[np.ndarray]] = [[], []]  # (worker, fragment key) of default regions
    lower_bound = 0
    for runs, target, instances in planned:
        n_inst = len(instances)
        for column, value in zip(
            pieces,
            (runs.obj, runs.src_offset, runs.length, runs.count, runs.src_stride, runs.dst_stride),
            strict=True,
        ):
            column.append(value)
        worker = instances[:, runs.slot].T.reshape(-1)
        fkey = np.repeat(runs.fkey, n_inst)
        consumers[0].append(worker)
        consumers[1].append(fkey)
        consumers[2].append(np.repeat(runs.dst_offset, n_inst))
        consumers[3].append(np.full(len(runs.obj), n_inst, I64))
        for s in range(len(target.slots)):
            keys = target.fragment_key[target.fragment_slot == s]
            lower_bound += n_inst * int(nbytes[keys].sum())
            rows[0].append(np.repeat(instances[:, s], len(keys)))
            rows[1].append(np.tile(keys, n_inst))
    worker = np.concatenate(consumers[0])
    fkey = np.concatenate(consumers[1])
    region = 1 + fkey
    dst = np.concatenate(consumers[2])  # a new array: base offsets are added in place
    if dest_list:  # one gather for every consumer with destinations, not a pass per map
        which = resolver[worker]
        mapped = np.flatnonzero(which >= 0)
        at = which[mapped] * len(fkeys) + fkey[mapped]
        region[mapped] = np.concatenate([r for _, r, _, _ in dest_list])[at]
        dst[mapped] += np.concatenate([b for _, _, b, _ in dest_list])[at]
        unmapped = mapped[region[mapped] < 0]
        if len(unmapped):
            c = unmapped[0]
            fragment_id = next(k for k, v in fkeys.items() if v == fkey[c])
            raise InvariantViolation(
                f"worker {topology.worker_ids[worker[c]]} has no destination for placement "
                f"fragment {fragment_id}"
            )
    region_worker = np.concatenate(rows[0])
    region_key = np.concatenate(rows[1])
    if destinations:  # a worker with destinations declares its own regions (below)
        default = resolver[region_worker] < 0
        region_worker, region_key = region_worker[default], region_key[default]
    declared = {  # each distinct destination's (region ids, sizes)
        id(dest): (named, np.array(dest.region_sizes, I64)) for dest, _, _, named in dest_list
    }
    extra_w, extra_r, extra_s = [np.zeros(0, I64)], [np.zeros(0, I64)], [np.zeros(0, I64)]
    for worker_id, dest in destinations.items():
        ids, sizes = declared[id(dest)]
        extra_w.append(np.full(len(ids), topology.worker_index[worker_id], I64))
        extra_r.append(ids)
        extra_s.append(sizes)
    region_id = np.concatenate([1 + region_key, *extra_r])
    regions: tuple[str, ...] = tuple(names)
    if destinations:  # without any, every fragment's own region is used
        regions, region, region_id = _named_regions(names, region, region_id)
    return DemandSet(
        regions=regions,
        obj=np.concatenate(pieces[0]),
        src_offset=np.concatenate(pieces[1]),
        length=np.concatenate(pieces[2]),
        count=np.concatenate(pieces[3]),
        src_stride=np.concatenate(pieces[4]),
        dst_stride=np.concatenate(pieces[5]),
        ptr=np.concatenate([[0], np.cumsum(np.concatenate(consumers[3]))]).astype(I64),
        worker=worker,
        region=region,
        dst_offset=dst,
        region_worker=np.concatenate([region_worker, *extra_w]),
        region_id=region_id,
        region_size=np.concatenate([nbytes[region_key], *extra_s]),
        lower_bound_bytes=lower_bound,
        compat=None,
    )


def _named_regions(
    names: list[str], *ids: np.ndarray
) -> tuple[tuple[str, ...], *tuple[np.ndarray, ...]]:
    """The region names some id in ``ids`` uses, and the ids renumbered densely in the same
    order (staging stays 0). With destinations, the default names (one per fragment: a
    million for a 1T MoE's TP8 engine) name nothing, and a table keeps only what it uses.
    Marked, not sorted: the ids are millions (a 1T MoE on 16 TP8 engines: 4.8M), and
    ``np.unique`` sorted them all to find which of the names they use."""
    used = np.zeros(len(names), bool)
    used[0] = True
    for column in ids:
        used[column] = True
    if used.all():
        return (tuple(names), *ids)
    dense = np.cumsum(used) - 1
    kept = np.flatnonzero(used).tolist()
    return (tuple(map(names.__getitem__, kept)), *(dense[column] for column in ids))


def _resolved(
    dest: Destinations, fkeys: dict[str, int], nbytes: np.ndarray, region_id: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each fragment key's (region id, base offset) in ``dest`` (-1: it lands none there),
    refusing a fragment that overruns its region. ``region_id``: the id of each of
    ``dest.region_names``. In array passes: a 1T MoE's TP worker maps some 140k fragments,
    so each fragment's region name is looked up once, as its place among the regions."""
    region = np.full(len(fkeys), -1, I64)
    base = np.zeros(len(fkeys), I64)
    ids, where, offsets = dest.fragment_ids, dest.fragment_regions, dest.fragment_bases
    if not ids:
        return region, base
    n = len(ids)
    key = np.fromiter(map(fkeys.get, ids, repeat(-1)), I64, n)
    offset = np.array(offsets, I64)
    place = dict(zip(dest.region_names, range(len(dest.region_names)), strict=True))
    at = np.fromiter(map(place.__getitem__, where), I64, n)
    size = np.array(dest.region_sizes, I64)[at]
    known = key >= 0
    overruns = known & (offset + nbytes[np.where(known, key, 0)] > size)
    if overruns.any():
        i = int(np.argmax(overruns))
        f = int(key[i])
        raise InvariantViolation(
            f"fragment {ids[i]} ({int(nbytes[f])} bytes at {offsets[i]}) does not fit "
            f"region {where[i]} ({int(size[i])} bytes)"
        )
    region[key[known]] = region_id[at[known]]
    base[key[known]] = offset[known]
    return region, base


def demand_records(demands: DemandSet) -> np.ndarray:
    """One DEMAND_DTYPE record per (piece, consumer): what each worker must end up holding."""
    piece, _ = grid.expand_counts(np.diff(demands.ptr))
    out = np.zeros(len(piece), DEMAND_DTYPE)
    for name, value in (
        ("worker", demands.worker),
        ("dst_region", demands.region),
        ("dst_offset", demands.dst_offset),
        ("dst_stride", demands.dst_stride[piece]),
        ("object", demands.obj[piece]),
        ("src_offset", demands.src_offset[piece]),
        ("src_stride", demands.src_stride[piece]),
        ("length", demands.length[piece]),
        ("count", demands.count[piece]),
    ):
        out[name] = value
    return out


def joined_demand_records(records: np.ndarray) -> np.ndarray:
    """``records`` with every run of demands that continue one another (same worker, region
    and object, contiguous, each starting where the last ends in the object and in the
    region) as one record: the same bytes to the same places.

    Why: ranges joined across tensors (:func:`~mooncake_rl.plan.merge.join_adjacent`) are
    read and pushed as one write, and the validator wants every write inside one demand.
    Records that join nothing keep their order.
    """
    if len(records) < 2:
        return records
    nbytes = records["length"] * records["count"]
    contiguous = (records["count"] == 1) | (
        (records["src_stride"] == records["length"]) & (records["dst_stride"] == records["length"])
    )
    order = grid.lex_order(records["worker"], records["dst_region"], records["dst_offset"])
    a, b = order[:-1], order[1:]
    joins = (
        contiguous[a]
        & contiguous[b]
        & (records["worker"][a] == records["worker"][b])
        & (records["dst_region"][a] == records["dst_region"][b])
        & (records["object"][a] == records["object"][b])
        & (records["dst_offset"][a] + nbytes[a] == records["dst_offset"][b])
        & (records["src_offset"][a] + nbytes[a] == records["src_offset"][b])
    )
    if not joins.any():
        return records
    group = np.concatenate([[0], np.cumsum(~joins)])
    heads = order[np.flatnonzero(np.concatenate([[True], ~joins]))]
    total = np.bincount(group, nbytes[order]).astype(np.int64)
    single = np.bincount(group) == 1
    keep = grid.stable_order(heads)
    heads, total, single = heads[keep], total[keep], single[keep]
    out = records[heads].copy()
    joined = ~single
    for name in ("length", "src_stride", "dst_stride"):
        out[name][joined] = total[joined]
    out["count"][joined] = 1
    return out
