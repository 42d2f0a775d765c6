"""One update's plan for a set of engines, cached across generations with the same layout.

Adapts the engines' worker descriptions (``GET /mooncake/placement`` replies) to the
planner's declarations (``Worker``/``Topology``, ``CompatDemand`` or ``DirectDemand`` with
one ``WeightPlacementPart`` and ``Destinations`` per worker), and lowers the planner's
routing table to the executor's ops: table stage 1 and 2 are slice stages 0 and 1.

The routing table names objects relative to the generation, so a cache hit replans nothing
and only the group prefix of the new generation is bound when slices are encoded.

Here: the caches and the two entry points (:func:`plan_routing`, :func:`plan_update`). The
steps live beside it: :mod:`~mooncake_rl.plan.reports` (what the engines report: keys,
representatives, boxes read on demand), :mod:`~mooncake_rl.plan.placements` (boxes to
receive layouts and planner parts) and :mod:`~mooncake_rl.plan.slices` (the plan, lowered
to each worker's slice and prepare body). Their names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.layout import SegmentMap
from mooncake_rl.plan.cache import Lru, PlanCache, PlanKey
from mooncake_rl.plan.demand import CompatDemand, DirectDemand
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.placements import (
    WorkerDemand,
    WorkerLayout,
    engine_layout,
    engine_parts,
    placed_like,
    without_fallback,
)
from mooncake_rl.plan.planner import plan_key, planning_mode
from mooncake_rl.plan.planner import plan_routing as plan_table
from mooncake_rl.plan.reports import (
    Boxes,
    Describe,
    DirectKey,
    placement_reports,
    ranked_reports,
    reported_digest,
    representatives,
    require_staging,
    require_true_reports,
    topology_of,
)
from mooncake_rl.plan.slices import (
    RoutingPlan,
    UpdatePlan,
    compat_rows,
    encode_workers,
    planned_regions,
)
from mooncake_rl.plan.stored import StoredTables
from mooncake_rl.protocol import has_boxes
from mooncake_rl.store import StoreClient

__all__ = [
    "LAYOUTS_KEPT",
    "PLANS_KEPT",
    "Describe",
    "PartsCache",
    "RoutingCache",
    "RoutingPlan",
    "UpdatePlan",
    "WorkerDemand",
    "WorkerLayout",
    "encode_workers",
    "placement_reports",
    "plan_routing",
    "plan_update",
    "ranked_reports",
    "reported_digest",
    "representatives",
    "require_staging",
    "require_true_reports",
    "topology_of",
]

# A plan reads an engine's placement through these names, so that a test can spy on them
# here (tests/plan/test_update.py, test_planning_mode.py); tests also reach the other two.
_engine_layout, _engine_parts = engine_layout, engine_parts
_planned_regions, _placed_like = planned_regions, placed_like

# What a worker declares before its layout is read (compat mode: none).
_NO_REGIONS: Mapping[str, int] = MappingProxyType({})

LAYOUTS_KEPT = 4
"""Distinct placements whose receive layouts (without boxes) a routing cache keeps."""
PLANS_KEPT = 2
"""Routing plans a routing cache keeps whole: a hit on one reads no layout and merges no
region (a 1T MoE's table names a region row per worker and tensor)."""


class RoutingCache:
    """Routing tables by (source layout, demand, topology, params) digests.

    Wraps the planner's ``PlanCache``: a hit returns the very same table and replans
    nothing; the per-worker regions and layout rows are re-derived from it (cheap). With a
    Store client, tables are also kept in the Store (:mod:`mooncake_rl.plan.stored`), so a
    fresh process loads what an earlier one planned. Beside the tables it keeps each
    distinct placement's planner parts (for a fleet change) and its receive layout without
    boxes, so a hit reads no boxes at all (:meth:`boxes_wanted`).
    """

    def __init__(self, store: StoreClient | None = None) -> None:
        self.tables = PlanCache(backing=None if store is None else StoredTables(store))
        self.parts = PartsCache()
        self.layouts: Lru[tuple, dict[int, WorkerLayout]] = Lru(LAYOUTS_KEPT)
        self.plans: Lru[PlanKey, RoutingPlan] = Lru(PLANS_KEPT)

    @property
    def hits(self) -> int:
        return self.tables.hits

    @property
    def loads(self) -> int:
        return self.tables.loads

    @property
    def misses(self) -> int:
        return self.tables.misses

    def boxes_wanted(
        self,
        manifest: WeightManifest,
        engines: Mapping[str, Sequence[Mapping[str, Any]]],
        mode: str,
        batch_bytes: int,
        layout_digest: str | None = None,
        direct_fallback: str | None = None,
        segments: SegmentMap | None = None,
        *,
        pull: str = "single",
    ) -> list[str]:
        """The engines whose boxes a plan of ``engines`` would read, of those described
        without them (``GET /mooncake/placement?boxes=false``): none when this cache holds
        the table and every distinct placement's layout in memory; otherwise one engine per
        distinct placement (its representative). Asked before the engines are drained, so
        that reading boxes never lengthens a pause."""
        bare = [url for url, workers in engines.items() if not all(map(has_boxes, workers))]
        if mode != "direct" or not bare:
            return []
        known = DirectKey.of(
            manifest,
            engines,
            PlanParams(batch_bytes=batch_bytes, pull=pull),
            layout_digest,
            direct_fallback,
            segments,
        )
        held = self.tables.holds(known.key) and (
            known.key in self.plans
            or all(known.layout_key(rep) in self.layouts for rep in known.distinct)
        )
        return [] if held else [rep for rep in known.distinct if rep in bare]

    def get_or_plan(
        self,
        manifest: WeightManifest,
        engines: Mapping[str, Sequence[Mapping[str, Any]]],
        mode: str,
        batch_bytes: int,
        *args: Any,
        **kwargs: Any,
    ) -> RoutingPlan:
        """:func:`plan_routing` with this cache (the rest of its arguments as it takes them)."""
        return plan_routing(manifest, engines, mode, batch_bytes, self, *args, **kwargs)


class PartsCache:
    """The planner's parts of each distinct engine placement, kept across misses.

    A miss that changes only the fleet (an engine added, removed, or restarted under new
    worker ids) keeps every distinct placement, so its parts are reused: a 1T MoE's TP8
    engine is a million mooncake.reshard contract objects, half a minute to build. The key
    is the source layout digest, the direct fallback and the placement's reports rank by
    rank; the reports are checked true (:func:`require_true_reports`) before it is used.
    """

    def __init__(self, max_entries: int = 2) -> None:
        self.built = 0
        self._parts: Lru[tuple, dict[int, WorkerDemand]] = Lru(max_entries)

    def get_or_build(
        self, key: tuple, build: Callable[[], dict[int, WorkerDemand]]
    ) -> dict[int, WorkerDemand]:
        """``key``'s parts by TP rank, built (and kept) when they are not here."""
        parts = self._parts.get(key)
        if parts is None:
            parts = build()
            self._parts.put(key, parts)
            self.built += 1
        return parts


def plan_routing(
    manifest: WeightManifest,
    engines: Mapping[str, Sequence[Mapping[str, Any]]],
    mode: str,
    batch_bytes: int,
    cache: RoutingCache | None = None,
    layout_digest: str | None = None,
    direct_fallback: str | None = None,
    segments: SegmentMap | None = None,
    describe: Describe | None = None,
    *,
    pull: str = "single",
) -> RoutingPlan:
    """``engines``: each engine's worker descriptions, with or without their boxes.
    ``direct_fallback``: a regex of parameter (region) names direct mode lands through
    the engines' ``load_weights`` whatever their discovery says (the operator's way around
    a discovery that is wrong for a model). ``segments``: the generation's locality hints
    (each worker description's ``segment`` says which segment is on its node).
    ``describe``: reads the boxes of engines described without them, when a plan needs
    them (:meth:`RoutingCache.boxes_wanted`). ``pull``: read each byte once for the fleet
    or once per node (:class:`~mooncake_rl.plan.params.PlanParams`)."""
    if mode not in ("compat", "direct"):
        raise InvariantViolation(f"unknown mode {mode!r}")
    cache = cache if cache is not None else RoutingCache()
    topology = topology_of(engines)
    params = PlanParams(batch_bytes=batch_bytes, pull=pull)
    declared: dict[str, Mapping[str, int]] = {
        w["worker_id"]: _NO_REGIONS for ws in engines.values() for w in ws
    }
    region_dtypes: dict[str, dict[str, str]] = {}
    fallback: dict[str, tuple[dict[str, Any], ...]] = {}
    known = None
    if mode == "compat":
        key = plan_key(
            manifest, topology, CompatDemand().digest, params, layout_digest, segments=segments
        )
    else:
        known = DirectKey.of(manifest, engines, params, layout_digest, direct_fallback, segments)
        key = known.key
    table = cache.tables.get(key)
    kept = cache.plans.get(key)
    if kept is not None and kept.table is table:  # the key determines the whole plan
        return kept
    demand: CompatDemand | DirectDemand = CompatDemand()
    # One hold from the boxes to the table: each hold's end costs a pass of the collector
    # over what it made (about 0.4 s for a 1T MoE's placement).
    with planning_mode():
        if known is not None:
            boxes = Boxes(engines, describe)
            layouts = _direct_layouts(manifest, known, cache, boxes, table is None)
            for engine_layouts in layouts.values():
                for worker_id, layout in engine_layouts.items():
                    declared[worker_id] = layout.regions
                    region_dtypes[worker_id] = layout.region_dtypes
                    fallback[worker_id] = layout.fallback
            if table is None:  # only a miss builds the planner's demand (1T MoE: ~1M boxes)
                demand = _direct_demand(manifest, known, cache.parts, layouts)
        if table is None:
            table = plan_table(
                manifest,
                topology,
                demand,
                params=params,
                layout_digest=layout_digest,
                segments=segments,
            )
            cache.tables.put(key, table)
        regions = planned_regions(table, declared)
    totals = table.totals
    plan = RoutingPlan(
        mode,
        topology,
        table,
        regions,
        compat_rows(manifest, table) if mode == "compat" else (),
        region_dtypes,
        totals.unique_demand_bytes,
        {n: int(b) for n, b in zip(table.nodes, totals.node_nic_bytes.tolist(), strict=True)},
        fallback,
        dict(known.reports) if known is not None else {},
    )
    cache.plans.put(key, plan)
    return plan


def _direct_layouts(
    manifest: WeightManifest,
    known: DirectKey,
    cache: RoutingCache,
    boxes: Boxes,
    planning: bool,
) -> dict[str, dict[str, WorkerLayout]]:
    """Each engine's workers' receive layouts, read once per distinct placement: from the
    cache on a hit (no box read), else off its representative's boxes. ``planning`` (a
    miss) reads every representative's and checks their reports before a table is planned."""
    by_rank: dict[str, dict[int, WorkerLayout]] = {}
    if not planning:
        for rep in known.distinct:
            held = cache.layouts.get(known.layout_key(rep))
            if held is not None:
                by_rank[rep] = held
    unread = [rep for rep in known.distinct if rep not in by_rank]
    described = boxes.of(unread)  # one read of every distinct placement
    for rep in unread:
        read = _engine_layout(manifest, without_fallback(described[rep], known.direct_fallback))
        by_rank[rep] = {layout.tp_rank: layout for layout in read.values()}
        cache.layouts.put(
            known.layout_key(rep), {r: replace(lay, shards=()) for r, lay in by_rank[rep].items()}
        )
    if planning:
        require_true_reports(described)
    return {
        url: {
            w["worker_id"]: by_rank[known.representative[url]][int(w["tp_rank"])] for w in workers
        }
        for url, workers in known.engines.items()
    }


def _direct_demand(
    manifest: WeightManifest,
    known: DirectKey,
    parts_cache: PartsCache,
    layouts: Mapping[str, Mapping[str, WorkerLayout]],
) -> DirectDemand:
    """The planner's direct demand: each distinct placement's parts (kept across misses)."""
    parts: dict[str, dict[int, WorkerDemand]] = {}  # per representative, by rank
    wanted = {}
    for url, engine_layouts in layouts.items():
        rep = known.representative[url]
        if rep not in parts:
            parts[rep] = parts_cache.get_or_build(
                known.layout_key(rep), lambda rep=rep: _parts_by_rank(manifest, layouts[rep])
            )
        for worker_id, layout in engine_layouts.items():
            wanted[worker_id] = parts[rep][layout.tp_rank]
    return DirectDemand.of(
        {w: d.part for w, d in wanted.items()},
        {w: d.destinations for w, d in wanted.items()},
        reported_digest(known.reports, known.direct_fallback),
    )


def _parts_by_rank(
    manifest: WeightManifest, layouts: Mapping[str, WorkerLayout]
) -> dict[int, WorkerDemand]:
    return {layouts[w].tp_rank: d for w, d in _engine_parts(manifest, layouts).items()}


def plan_update(
    manifest: WeightManifest,
    engines: Mapping[str, Sequence[Mapping[str, Any]]],
    mode: str,
    batch_bytes: int,
    cache: RoutingCache,
    *args: Any,
    **kwargs: Any,
) -> UpdatePlan:
    """Plan (or reuse) the update of ``engines`` to ``manifest``'s generation: the rest of
    the arguments are :func:`plan_routing`'s, after ``cache``.

    ``layout_digest``: the generation record's ``ActiveRecord.layout_digest``, so that a
    cache hit does not re-hash the manifest (see :func:`mooncake_rl.plan.plan_routing`).
    ``describe``: reads boxes the plan needs of engines described without them.
    ``pull``: ``single`` or ``node`` (:class:`~mooncake_rl.plan.params.PlanParams`).
    """
    routing = cache.get_or_plan(manifest, engines, mode, batch_bytes, *args, **kwargs)
    by_engine = {url: tuple(w["worker_id"] for w in ws) for url, ws in engines.items()}
    return UpdatePlan(routing, manifest.group_id, by_engine)
