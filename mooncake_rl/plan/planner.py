"""Entry point: (generation manifest, topology, demand) -> validated, cached routing table."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import numpy as np
from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.layout import SegmentMap, is_digest, located_digest
from mooncake_rl.plan import heap
from mooncake_rl.plan.assign import assign_readers
from mooncake_rl.plan.cache import PlanCache, PlanKey
from mooncake_rl.plan.demand import CompatDemand, DirectDemand
from mooncake_rl.plan.merge import join_adjacent, merge_demands, split_by_node
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.route import route
from mooncake_rl.plan.sieve import sieve
from mooncake_rl.plan.source import source_digest, source_layout
from mooncake_rl.plan.table import REGION_DTYPE, RoutingTable
from mooncake_rl.plan.targets import demand_records, demand_set, joined_demand_records
from mooncake_rl.plan.topology import Topology
from mooncake_rl.plan.validate import validate_routing_table


def plan_key(
    manifest: WeightManifest,
    topology: Topology,
    demand_digest: str,
    params: PlanParams,
    layout_digest: str | None = None,
    *,
    segments: SegmentMap | None = None,
) -> PlanKey:
    """The cache key. ``demand_digest`` is the demand's ``digest`` (declared by the engine
    workers, or hashed once per demand object), the topology's is cached on it; the source
    digest is ``layout_digest`` when the generation's record carries one, else it is
    computed from the manifest (the only per-generation work of a hit). Segment hints that
    put objects on a rollout node change the plan, so their digest joins the source digest."""
    if layout_digest is None:
        layout_digest = source_digest(manifest)
    elif not is_digest(layout_digest):
        raise InvariantViolation(f"layout digest {layout_digest!r} is not a SHA-256 hex digest")
    if segments is not None and not set(segments.segments).isdisjoint(topology.segment_node):
        layout_digest = located_digest(layout_digest, segments.digest)
    return PlanKey(layout_digest, demand_digest, topology.digest, params)


def plan_routing(
    manifest: WeightManifest,
    topology: Topology,
    demand: CompatDemand | DirectDemand,
    *,
    params: PlanParams | None = None,
    cache: PlanCache | None = None,
    layout_digest: str | None = None,
    segments: SegmentMap | None = None,
) -> RoutingTable:
    """The routing table for this layout, demand and topology; validated before it is cached.

    ``layout_digest``: the manifest's layout digest as sealed into its active-generation
    record at announce (``ActiveRecord.layout_digest``). A hit then touches nothing of the
    manifest; a miss recomputes the digest and refuses a record that does not match, so no
    table is ever cached under another layout's key. The table names objects, not keys:
    bind it to a generation with :func:`mooncake_rl.plan.bind`. ``segments``: the
    announce's segment map (``GenerationRegistry.load_segments``); objects in a segment that
    a worker declares (``Worker.segment``) are preferably read on that node, off the NIC.
    """
    params = params or PlanParams()
    key = plan_key(manifest, topology, demand.digest, params, layout_digest, segments=segments)
    if cache is not None:
        cached = cache.get(key)
        if cached is not None:
            return cached
    # The digest too: its tuples rescan a large caller's heap.
    with _PLANNING.held(keep_heap=True, warm_bytes=working_set(manifest, topology, demand)):
        if layout_digest is not None and source_digest(manifest) != layout_digest:
            raise InvariantViolation(
                f"the recorded layout digest of {manifest.group_id} does not match its manifest"
            )
        table = build_routing_table(manifest, topology, demand, params, key, segments=segments)
        validate_routing_table(table)
    if cache is not None:
        cache.put(key, table)
    return table


class _PlanningMode:
    """Process-wide settings a plan runs faster under, held while any plan runs.

    - The cyclic garbage collector is paused. The pipeline makes no reference cycles but
      allocates millions of short-lived tuples and lists; with the caller's heap holding a
      1T MoE's manifest and placement (1.6M objects) those allocations trigger collections
      that rescan it, one full pass alone costing over a second here. Reference counting
      still frees everything. What a plan leaves behind (its table, the kept parts) would
      still cost one pass when the collector resumes: every object made while it was paused
      sits in the youngest generation, so the first collection after it rescans them all
      (0.3-0.4 s after a 1T MoE's plan). The last hold to leave moves them to the oldest
      generation instead (``gc.freeze`` then ``gc.unfreeze``, two list splices), where
      they wait for the next full collection like any long-lived object.
    - numpy stops asking for transparent huge pages (``madvise``). A plan makes hundreds of
      fresh multi-megabyte arrays that live for one step; on the VMs this runs on a first
      touch of a huge page costs ~3x the same bytes in small pages (a 1T fp8 MoE on
      16 x TP8: 3.3-3.9 s of system time with them, 1.2-1.8 s without). This is numpy's own
      switch (what ``NUMPY_MADVISE_HUGEPAGE=0`` sets at import); a numpy without it is left
      alone.
    - While a table is planned (``keep_heap``), glibc's malloc keeps what the plan frees for
      its next arrays instead of unmapping it (:mod:`mooncake_rl.plan.heap`): the kernel no
      longer zeroes and maps the same memory again for every array (fp8 Kimi-K2 on
      16 x TP8: 1.7-2.0 s of system time without, 0.7-0.9 s with). The last such hold gives
      the free pages back. Other holds (the coordinator holds the mode once per engine
      body) leave malloc alone: giving back walks every free chunk, 0.5-3 ms a time.
      The first such hold also faults in about the plan's working set on another thread
      (``warm_bytes``, :func:`mooncake_rl.plan.heap.warm`), while the plan's first steps
      run; the last joins that thread before it gives memory back.

    All three are process-wide, so plans in several threads share one hold: the first to enter
    saves the previous settings, the last to leave restores them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._heap_holders = 0
        self._gc_was_enabled = False
        self._huge_pages_were: bool | None = None
        self._heap_kept = False
        self._warming: threading.Thread | None = None

    @contextmanager
    def held(self, *, keep_heap: bool = False, warm_bytes: int = 0) -> Iterator[None]:
        switch = getattr(np._core.multiarray, "_set_madvise_hugepage", None)
        with self._lock:
            if self._holders == 0:
                self._gc_was_enabled = gc.isenabled()
                gc.disable()
                self._huge_pages_were = switch(False) if switch is not None else None
            self._holders += 1
            if keep_heap:
                if self._heap_holders == 0:
                    self._heap_kept = heap.keep_freed_memory()
                    if self._heap_kept:
                        self._warming = heap.warm(warm_bytes)
                self._heap_holders += 1
        try:
            yield
        finally:
            with self._lock:
                if keep_heap:
                    self._heap_holders -= 1
                    if self._heap_holders == 0 and self._heap_kept:
                        if self._warming is not None:
                            self._warming.join()
                            self._warming = None
                        heap.give_back_freed_memory()
                self._holders -= 1
                if self._holders == 0:
                    if self._gc_was_enabled:
                        _age_survivors()
                        gc.enable()
                    if switch is not None and self._huge_pages_were is not None:
                        switch(self._huge_pages_were)


def _age_survivors() -> None:
    """Move every tracked object to the oldest generation without scanning any. Left
    alone when something else has frozen objects (``gc.freeze`` after a server's start):
    unfreezing would hand those back to the collector."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


_PLANNING = _PlanningMode()


def planning_mode() -> AbstractContextManager[None]:
    """Hold :class:`_PlanningMode` around other work that builds a plan's inputs by the
    million (``plan.update`` reading a 1T MoE's boxes); holds nest and may overlap."""
    return _PLANNING.held()


def build_routing_table(
    manifest: WeightManifest,
    topology: Topology,
    demand: CompatDemand | DirectDemand,
    params: PlanParams,
    key: PlanKey,
    *,
    segments: SegmentMap | None = None,
) -> RoutingTable:
    """Plan without validating or caching (the pure pipeline)."""
    layout = source_layout(manifest, key.source_digest)
    demands = demand_set(manifest, layout, topology, demand)
    ranges = join_adjacent(merge_demands(demands))
    worker_node = np.array(topology.worker_node, np.int64)
    if params.pull == "node":
        ranges = split_by_node(ranges, worker_node)
    sieved = sieve(ranges, worker_node, params)
    chunks = assign_readers(
        sieved.ranges, topology, params, object_homes(layout.objects, topology, segments)
    )
    routes = route(sieved.ranges, chunks, topology, params, sieved)
    staging = np.flatnonzero(routes.staging_bytes)
    regions = np.zeros(len(demands.region_worker) + len(staging), REGION_DTYPE)
    regions["worker"] = np.concatenate([demands.region_worker, staging])
    regions["region"] = np.concatenate([demands.region_id, np.zeros(len(staging), np.int64)])
    regions["size"] = np.concatenate([demands.region_size, routes.staging_bytes[staging]])
    return RoutingTable(
        mode="compat" if isinstance(demand, CompatDemand) else "direct",
        source_digest=key.source_digest,
        target_digest=key.target_digest,
        topology_digest=key.topology_digest,
        params=params,
        workers=topology.worker_ids,
        nodes=topology.nodes,
        worker_node=np.array(topology.worker_node, np.int64),
        objects=layout.objects,
        object_sizes=layout.object_sizes,
        regions=demands.regions,
        region_sizes=regions,
        reads=routes.reads,
        pushes=routes.pushes,
        demands=joined_demand_records(demand_records(demands)),
        compat=demands.compat,
        lower_bound_bytes=demands.lower_bound_bytes,
        max_chunk_cost=chunks.max_cost,
    )


# Bytes of fresh memory a cold plan touches per demanded fragment (a 1T fp8 MoE on
# 16 x TP8 engines: 1.6 GB for 2.4M fragments, a dense 70B or a bf16 MoE somewhat less).
WORKING_SET_PER_FRAGMENT = 512


def working_set(
    manifest: WeightManifest, topology: Topology, demand: CompatDemand | DirectDemand
) -> int:
    """About the memory a plan works in, from what is known before it starts: the
    fragments every worker demands (compat: every tensor on every worker)."""
    if isinstance(demand, DirectDemand):
        fragments = sum(len(part.fragments) for _, part in demand.parts)
    else:
        fragments = len(topology.workers) * len(manifest.tensors)
    return fragments * WORKING_SET_PER_FRAGMENT


def object_homes(
    objects: tuple[str, ...], topology: Topology, segments: SegmentMap | None
) -> np.ndarray | None:
    """Node index of each object's segment (-1: not on a rollout node), or None (no hints)."""
    nodes = topology.segment_node
    if segments is None or set(segments.segments).isdisjoint(nodes):
        return None
    return np.array([nodes.get(segments.segment(name) or "", -1) for name in objects], np.int64)
