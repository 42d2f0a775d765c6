"""Entry point: (generation manifest, topology, demand) -> validated, cached routing table."""

from __future__ import annotations

import numpy as np
from mooncake.reshard.weight import WeightManifest

from mooncake_rl.plan.assign import assign_readers
from mooncake_rl.plan.cache import PlanCache, PlanKey
from mooncake_rl.plan.demand import CompatDemand, DirectDemand
from mooncake_rl.plan.merge import merge_demands
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.route import route
from mooncake_rl.plan.source import source_digest, source_layout
from mooncake_rl.plan.table import REGION_DTYPE, RoutingTable
from mooncake_rl.plan.targets import demand_records, demand_set
from mooncake_rl.plan.topology import Topology
from mooncake_rl.plan.validate import validate_routing_table


def plan_key(
    manifest: WeightManifest,
    topology: Topology,
    demand: CompatDemand | DirectDemand,
    params: PlanParams,
) -> PlanKey:
    """The cache key; only the source digest is computed per generation."""
    return PlanKey(source_digest(manifest), demand.digest, topology.digest, params)


def plan_routing(
    manifest: WeightManifest,
    topology: Topology,
    demand: CompatDemand | DirectDemand,
    *,
    params: PlanParams | None = None,
    cache: PlanCache | None = None,
) -> RoutingTable:
    """The routing table for this layout, demand and topology; validated before it is cached.

    The table names objects, not keys: bind it to a generation with
    :func:`mooncake_rl.plan.bind`.
    """
    params = params or PlanParams()
    key = plan_key(manifest, topology, demand, params)
    if cache is not None:
        cached = cache.get(key)
        if cached is not None:
            return cached
    table = build_routing_table(manifest, topology, demand, params, key)
    validate_routing_table(table)
    if cache is not None:
        cache.put(key, table)
    return table


def build_routing_table(
    manifest: WeightManifest,
    topology: Topology,
    demand: CompatDemand | DirectDemand,
    params: PlanParams,
    key: PlanKey,
) -> RoutingTable:
    """Plan without validating or caching (the pure pipeline)."""
    layout = source_layout(manifest, key.source_digest)
    demands = demand_set(manifest, layout, topology, demand)
    ranges = merge_demands(demands)
    chunks = assign_readers(ranges, topology, params)
    routes = route(ranges, chunks, topology, params)
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
        demands=demand_records(demands),
        compat=demands.compat,
        lower_bound_bytes=demands.lower_bound_bytes,
        max_chunk_cost=chunks.max_cost,
    )
