"""The routing table lowered for the engines: the plan an update carries, and its slices.

A :class:`RoutingPlan` is a planned table with each worker's regions (declared, and those the
table plans) and, in compat mode, where each full tensor sits; it names objects relative to
the generation, so it is kept across generations with the same layout. An
:class:`UpdatePlan` binds it to one generation's group: each worker's executor slice
(:meth:`UpdatePlan.worker_slice`), and each engine's prepare-body ``workers``
(:meth:`UpdatePlan.engine_workers`, encoded by :func:`encode_workers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any

import numpy as np
import orjson
from mooncake.reshard.weight import WeightManifest

from mooncake_rl.apply.executor import Batch
from mooncake_rl.apply.wire import WorkerSlice, checksums_of
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.checksums import ObjectChecksum
from mooncake_rl.plan import grid
from mooncake_rl.plan.demand import COMPAT_REGION
from mooncake_rl.plan.planner import planning_mode
from mooncake_rl.plan.table import BoundRoutingTable, RecordBatch, RoutingTable, bind
from mooncake_rl.plan.topology import Topology

# What a worker without a direct layout declares (compat mode: none).
_NO_DTYPES: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, eq=False)
class RoutingPlan:
    """The generation-independent, cacheable part of an update plan."""

    mode: str
    topology: Topology
    table: RoutingTable
    regions: Mapping[str, Mapping[str, int]]  # worker -> region -> bytes (staging included)
    layout: tuple[dict[str, Any], ...]  # compat mode: where each full tensor sits
    region_dtypes: Mapping[str, Mapping[str, str]]  # direct mode: stored dtype per region
    unique_demand_bytes: int
    node_nic_bytes: Mapping[str, int]
    # direct mode: per worker, the full tensors it lands through ``load_weights``
    fallback: Mapping[str, tuple[dict[str, Any], ...]] = field(default_factory=dict)
    # direct mode: per worker, the placement digest it reported (the plan is made for it)
    reports: Mapping[str, str] = field(default_factory=dict)

    @property
    def cross_node_pushed_bytes(self) -> int:
        return self.table.totals.cross_node_push_bytes

    @property
    def pushed_bytes(self) -> int:
        totals = self.table.totals
        return totals.cross_node_push_bytes + totals.intra_node_push_bytes

    def received_bytes(self) -> dict[str, int]:
        """Bytes landing in each worker's destination regions (staging excluded)."""
        delivered = self.table.totals.delivered_bytes
        return {w: int(delivered[i]) for i, w in enumerate(self.table.workers)}

    def fallback_bytes(self) -> dict[str, int]:
        """Of :meth:`received_bytes`, what each worker lands through ``load_weights``."""
        return {
            worker: sum(row["nbytes"] for row in rows)
            for worker, rows in self.fallback.items()
            if rows
        }


@dataclass(frozen=True, eq=False)
class UpdatePlan:
    routing: RoutingPlan
    group_id: str
    engines: Mapping[str, tuple[str, ...]]  # engine url -> its worker ids

    stages: int = 2
    _slices: dict[str, WorkerSlice] = field(default_factory=dict, repr=False)

    @property
    def store_read_bytes(self) -> int:
        return self.routing.table.totals.store_read_bytes

    @property
    def pushed_bytes(self) -> int:
        return self.routing.pushed_bytes

    @property
    def unique_demand_bytes(self) -> int:
        return self.routing.unique_demand_bytes

    def worker_slice(self, worker: str) -> WorkerSlice:
        """The worker's regions and executor batches per stage, bound to this generation."""
        if worker not in self._slices:
            bound = self._bound
            stages: list[list[Batch]] = [[] for _ in range(self.stages)]
            for batch in self._batches(worker):
                stages[batch.stage - 1].append(
                    Batch(tuple(bound.read_ops(batch)), tuple(bound.push_ops(batch)))
                )
            self._slices[worker] = WorkerSlice(
                self.routing.regions[worker],
                tuple(tuple(s) for s in stages),
                region_dtypes=self._dtypes(worker),
            )
        return self._slices[worker]

    def engine_workers(
        self, url: str, checksums: Mapping[str, ObjectChecksum] | None = None
    ) -> dict[str, Any]:
        """The prepare body's ``workers``: one encoded slice per worker of the engine, each
        with the checksums of the objects it reads when the generation's table is given.
        Made in the planner's mode (:func:`planning_mode`): a 1T MoE's TP8 engine takes
        millions of fresh arrays, whose allocations set off collections that rescan the
        coordinator's heap (plans, placements) over and over."""
        with planning_mode():
            return {
                worker: {
                    "slice": self._encoded_slice(worker, checksums),
                    "layout": list(self.routing.layout),
                    "fallback": list(self.routing.fallback.get(worker, ())),
                    # The worker refuses a slice planned for another placement than its own.
                    **_named("placement_digest", self.routing.reports.get(worker)),
                }
                for worker in self.engines[url]
            }

    def push_regions(self, url: str, stage: int) -> dict[str, set[str]]:
        """The workers ``url``'s workers push to in ``stage`` (from 0), each with the regions
        those pushes land in, read off the table. A worker's pushes to itself are local
        copies that need no peer (a rank-major pack's pieces: one region each)."""
        table = self.routing.table
        ids = [table.worker_ids[w] for w in self.engines[url] if w in table.worker_ids]
        pushes = table.pushes
        mine = pushes[
            np.isin(pushes["worker"], ids)
            & (pushes["stage"] == stage + 1)
            & (pushes["peer"] != pushes["worker"])
        ]
        found: dict[str, set[str]] = {}
        pairs = np.unique(np.stack([mine["peer"], mine["dst_region"]]), axis=1)
        for peer, region in pairs.T.tolist():
            found.setdefault(table.workers[peer], set()).add(table.regions[region])
        return found

    def _encoded_slice(
        self, worker: str, checksums: Mapping[str, ObjectChecksum] | None
    ) -> dict[str, Any]:
        """``encode_slice`` of the worker's slice (``with_checksums`` when given), made from
        the table's columns without the executor's op objects: the same JSON, in a fraction
        of the time (a 1T MoE's TP8 engine: some 610k ranges per update)."""
        bound = self._bound
        names = bound.slice_names()
        regions = names.table.regions(self.routing.regions[worker], self._dtypes(worker))
        stages: list[list[dict[str, Any]]] = [[] for _ in range(self.stages)]
        for batch in self._batches(worker):
            reads, pushes = bound.read_rows(batch, names), bound.push_rows(batch, names)
            stages[batch.stage - 1].append({"reads": reads, "pushes": pushes})
        encoded: dict[str, Any] = {"regions": regions, "stages": stages}
        if checksums is not None:
            read = checksums_of(names.read_keys(), checksums)
            encoded["checksums"] = names.table.checksums(read)
        encoded["names"] = names.table.names
        return encoded

    def _dtypes(self, worker: str) -> Mapping[str, str]:
        return self.routing.region_dtypes.get(worker, _NO_DTYPES)

    def _batches(self, worker: str) -> tuple[RecordBatch, ...]:
        table = self.routing.table
        return table.batches(worker) if worker in table.worker_ids else ()

    @cached_property
    def _bound(self) -> BoundRoutingTable:
        return bind(self.routing.table, self.group_id)


def encode_workers(workers: Mapping[str, Any]) -> bytes:
    """A prepare body's ``workers`` (:meth:`UpdatePlan.engine_workers`) as JSON: the bytes
    the standard library writes (compact, ``ensure_ascii=False``), by orjson, which writes
    the same for what a body holds (string keys, strings, integers, lists) ten times
    faster. A 1T MoE's TP8 engine takes 40 MB per update: 0.43 -> 0.05 s."""
    return orjson.dumps(workers)


def _named(name: str, value: Any) -> dict[str, Any]:
    """``{name: value}``, or nothing for ``None``: a field only some bodies carry."""
    return {} if value is None else {name: value}


def compat_rows(manifest: WeightManifest, table: RoutingTable) -> tuple[dict[str, Any], ...]:
    """Where each full tensor sits in a compat worker's receive region (the engine's loader
    reads them back as views)."""
    layout = table.compat
    assert layout is not None
    tensors = {t.tensor_id: t for t in manifest.tensors}
    return tuple(
        {
            "name": name,
            "region": COMPAT_REGION,
            "offset": offset,
            "shape": list(tensors[name].global_shape),
            "dtype": tensors[name].dtype,
        }
        for name, offset in zip(layout.tensor_ids, np.asarray(layout.offsets).tolist(), strict=True)
    )


def planned_regions(
    table: RoutingTable, declared: Mapping[str, Mapping[str, int]]
) -> dict[str, dict[str, int]]:
    """Each worker's regions: its declared ones and those the table plans (staging, compat's
    buffer), refusing a table whose size for a declared region differs.

    A 1T MoE's table has millions of region rows, one per (worker, tensor), and identical
    engines repeat them rank by rank. So workers that declare the same mapping (one object:
    ranks of identical engines share their representative's layout) and get the same rows
    are checked once and share the merged, new dict; the declared mappings are left as they
    are (the layout cache holds them)."""
    rows = table.region_sizes
    order = grid.stable_order(rows["worker"])
    bounds = np.flatnonzero(grid.group_starts(rows["worker"][order]))[1:]
    merged: dict[tuple[int, bytes, bytes], dict[str, int]] = {}
    planned: dict[str, dict[str, int]] = {}
    for block in np.split(order, bounds) if len(order) else ():
        worker = table.workers[int(rows["worker"][block[0]])]
        mine = declared[worker]
        region_ids, sizes = rows["region"][block], rows["size"][block]
        key = (id(mine), region_ids.tobytes(), sizes.tobytes())
        if key not in merged:
            merged[key] = _merged_regions(worker, mine, table.regions, region_ids, sizes)
        planned[worker] = merged[key]
    return {w: planned[w] if w in planned else dict(regions) for w, regions in declared.items()}


def _merged_regions(
    worker: str,
    declared: Mapping[str, int],
    names: tuple[str, ...],
    region_ids: np.ndarray,
    sizes: np.ndarray,
) -> dict[str, int]:
    """``declared`` and the planned regions it lacks; where every planned region is declared
    with its size this is a C-level comparison of two lists."""
    merged = dict(declared)
    planned = list(map(names.__getitem__, region_ids.tolist()))
    wanted = sizes.tolist()
    if list(map(declared.get, planned)) == wanted:
        return merged
    for region, size in zip(planned, wanted, strict=True):
        had = declared.get(region)
        if had is None:
            merged[region] = size
        elif had != size:
            raise InvariantViolation(f"{worker}:{region} declares {had} bytes, plan needs {size}")
    return merged
