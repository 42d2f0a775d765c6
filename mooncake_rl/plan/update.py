"""One update's plan for a set of engines, cached across generations with the same layout.

The routing table is a pure function of (source layout digest, engines' placement, mode,
batch size): it names objects relative to the generation, so a cache hit replans nothing and
only the group prefix of the new generation is bound when slices are encoded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.apply.executor import Batch, ReadOp
from mooncake_rl.apply.wire import WorkerSlice, encode_slice
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan.assign import Topology, assign_readers, nic_bytes
from mooncake_rl.plan.demand import (
    COMPAT_REGION,
    Demand,
    Shard,
    compat_demands,
    compat_layout,
    direct_demands,
    source_layout,
)
from mooncake_rl.plan.merge import merge_demands, unique_bytes
from mooncake_rl.plan.routing import RoutingTable, build_routing, validate_routing


@dataclass(frozen=True)
class RoutingPlan:
    """The generation-independent, cacheable part of an update plan."""

    mode: str
    topology: Topology
    table: RoutingTable
    regions: Mapping[str, Mapping[str, int]]
    layout: tuple[dict[str, Any], ...]
    region_dtypes: Mapping[str, Mapping[str, str]]  # direct mode: stored dtype per region
    unique_demand_bytes: int
    node_nic_bytes: Mapping[str, int]


@dataclass(frozen=True)
class UpdatePlan:
    routing: RoutingPlan
    group_id: str
    engines: Mapping[str, tuple[str, ...]]  # engine url -> its worker ids

    stages: int = 2

    @property
    def store_read_bytes(self) -> int:
        return self.routing.table.store_read_bytes

    @property
    def pushed_bytes(self) -> int:
        return sum(self.routing.table.pushed_bytes(self.routing.topology))

    @property
    def unique_demand_bytes(self) -> int:
        return self.routing.unique_demand_bytes

    def worker_slice(self, worker: str) -> WorkerSlice:
        prefix = f"{self.group_id}/payload/"
        bound = tuple(
            tuple(
                Batch(
                    tuple(
                        ReadOp(prefix + r.key, r.src_offset, r.region, r.dst_offset, r.length)
                        for r in b.reads
                    ),
                    b.pushes,
                )
                for b in stage
            )
            for stage in self.routing.table.batches(worker)
        )
        return WorkerSlice(self.routing.regions[worker], bound)

    def engine_workers(self, url: str) -> dict[str, Any]:
        """The prepare body's ``workers``: one encoded slice per worker of the engine."""
        return {
            worker: {
                "slice": encode_slice(self.worker_slice(worker)),
                "layout": list(self.routing.layout),
                "region_dtypes": dict(self.routing.region_dtypes.get(worker, {})),
            }
            for worker in self.engines[url]
        }


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


class RoutingCache:
    """Routing plans by (source layout, target placement, mode, batch) digests."""

    def __init__(self) -> None:
        self._plans: dict[tuple[str, str, str, int], RoutingPlan] = {}
        self.misses = 0

    def get_or_plan(
        self,
        manifest: WeightManifest,
        engines: Mapping[str, Sequence[Mapping[str, Any]]],
        mode: str,
        batch_bytes: int,
    ) -> RoutingPlan:
        layout = source_layout(manifest)
        target = _digest({u: sorted(_target_identity(w) for w in ws) for u, ws in engines.items()})
        key = (layout.digest, target, mode, batch_bytes)
        if key not in self._plans:
            self.misses += 1
            self._plans[key] = plan_routing(manifest, engines, mode, batch_bytes)
        return self._plans[key]


def _target_identity(worker: Mapping[str, Any]) -> str:
    return json.dumps(
        {
            k: worker.get(k)
            for k in ("worker_id", "node", "tp_rank", "tp_size", "regions", "shards")
        },
        sort_keys=True,
    )


def plan_routing(
    manifest: WeightManifest,
    engines: Mapping[str, Sequence[Mapping[str, Any]]],
    mode: str,
    batch_bytes: int,
) -> RoutingPlan:
    if mode not in ("compat", "direct"):
        raise InvariantViolation(f"unknown mode {mode!r}")
    workers = [w for ws in engines.values() for w in ws]
    topology = Topology({w["worker_id"]: w["node"] for w in workers})
    layout = source_layout(manifest)
    regions: dict[str, dict[str, int]] = {}
    region_dtypes: dict[str, dict[str, str]] = {}
    if mode == "compat":
        entries, total = compat_layout(layout)
        demands = compat_demands(layout, topology.node_of)
        regions = {w: {COMPAT_REGION: total} for w in topology.node_of}
        layout_rows = tuple(e.to_json() for e in entries)
    else:
        stored = {t.tensor_id: t.dtype for t in manifest.tensors}
        demands = []
        for engine_workers in engines.values():
            demands += _engine_direct_demands(manifest, engine_workers)
        for worker in workers:
            regions[worker["worker_id"]] = {
                name: spec["bytes"] for name, spec in worker["regions"].items()
            }
            region_dtypes[worker["worker_id"]] = _region_dtypes(worker, stored)
        layout_rows = ()
    ranges = merge_demands(demands)
    assignments = assign_readers(ranges, topology, batch_bytes)
    table = build_routing(assignments, topology, batch_bytes)
    validate_routing(table, demands, layout.object_sizes, topology)
    return RoutingPlan(
        mode,
        topology,
        table,
        regions,
        layout_rows,
        region_dtypes,
        unique_bytes(ranges),
        nic_bytes(assignments, topology),
    )


def _region_dtypes(worker: Mapping[str, Any], stored: Mapping[str, str]) -> dict[str, str]:
    """The stored dtype landing in each region; one region never mixes dtypes."""
    dtypes: dict[str, str] = {}
    for shard in worker["shards"]:
        dtype = stored.get(shard["tensor"])
        if dtype is None:
            continue  # reported by the placement check
        if dtypes.setdefault(shard["region"], dtype) != dtype:
            raise InvariantViolation(f"region {shard['region']} would receive mixed dtypes")
    return dtypes


def _engine_direct_demands(
    manifest: WeightManifest, workers: Sequence[Mapping[str, Any]]
) -> list[Demand]:
    tp_sizes = {int(w["tp_size"]) for w in workers}
    if len(tp_sizes) != 1 or len(workers) != tp_sizes.copy().pop():
        raise InvariantViolation("an engine must describe every TP rank exactly once")
    shards = [
        Shard(
            w["worker_id"],
            int(w["tp_rank"]),
            s["tensor"],
            tuple(s["global_offset"]),
            tuple(s["local_shape"]),
            s["region"],
            int(s["region_offset"]),
        )
        for w in workers
        for s in w["shards"]
    ]
    return direct_demands(manifest, shards, tp_sizes.pop())


def plan_update(
    manifest: WeightManifest,
    engines: Mapping[str, Sequence[Mapping[str, Any]]],
    mode: str,
    batch_bytes: int,
    cache: RoutingCache,
) -> UpdatePlan:
    routing = cache.get_or_plan(manifest, engines, mode, batch_bytes)
    by_engine = {url: tuple(w["worker_id"] for w in ws) for url, ws in engines.items()}
    return UpdatePlan(routing, manifest.group_id, by_engine)
