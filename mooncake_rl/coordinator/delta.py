"""Which engines take a delta generation in place, decided in the survey, and their fetch.

    active record (a delta: ``base`` set) + placements --at base, same Store incarnation,
    direct mode in place over the Store--> candidates --their boxes (``GET placement``),
    :func:`mooncake_rl.apply.delta.delta_reads`--> the engines that take the delta in place,
    each worker's entry blocks (:class:`InPlaceDelta`) --:func:`plan_delta_fetch`--> one
    slice per worker: every entry read from the Store once, pushed to the others

Everything else takes the full path: an engine further behind, compat mode, another
transport, or a worker with a parameter the engine processes after loading (vLLM-CPU's
packed GEMMs) or a box no checksum covers alone (:class:`DeltaUnavailable` says which).
Those read generation N whole, rebuilt once from its chain (:func:`realize_generation`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.apply.delta import DeltaUnavailable, delta_reads
from mooncake_rl.apply.wire import WorkerSlice, encode_slice
from mooncake_rl.apply.worker import pushed_regions
from mooncake_rl.generations.chain import DeltaTable
from mooncake_rl.generations.checksums import ChecksumTable
from mooncake_rl.generations.registry import ActiveRecord
from mooncake_rl.plan.delta import (
    DELTA_REGION,
    DeltaDemand,
    EntryBlock,
    entry_blocks,
    plan_delta_fetch,
)
from mooncake_rl.transport.modes import TransportMode

if TYPE_CHECKING:
    from mooncake_rl.coordinator.orchestration import Coordinator
    from mooncake_rl.coordinator.survey import Options

logger = logging.getLogger(__name__)


class BoxRow(NamedTuple):
    """A box as a placement reports it (``engine_ext.shards.ShardSpec.to_json``)."""

    tensor: str
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    region: str
    region_offset: int

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> BoxRow:
        return cls(
            str(row["tensor"]),
            tuple(row["global_offset"]),
            tuple(row["local_shape"]),
            str(row["region"]),
            int(row["region_offset"]),
        )


@dataclass(frozen=True)
class InPlaceDelta:
    """The engines that take a delta in place: each one's workers, their nodes and the
    entry blocks their boxes cover (:func:`~mooncake_rl.plan.delta.entry_blocks`)."""

    workers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    nodes: Mapping[str, str] = field(default_factory=dict)
    blocks: Mapping[str, tuple[EntryBlock, ...]] = field(default_factory=dict)

    @property
    def engines(self) -> list[str]:
        return list(self.workers)

    def plan(self, urls: Sequence[str], batch_bytes: int) -> DeltaFetch:
        """The fetch for ``urls`` (all, or those still prepared after some fell out)."""
        ids = [w for url in urls for w in self.workers[url]]
        demand = DeltaDemand({w: self.nodes[w] for w in ids}, {w: self.blocks[w] for w in ids})
        return DeltaFetch(
            {url: self.workers[url] for url in urls}, plan_delta_fetch(demand, batch_bytes)
        )


@dataclass(frozen=True)
class DeltaFetch:
    """A planned fetch of delta entries: every worker's slice, by engine."""

    workers: Mapping[str, tuple[str, ...]]
    slices: Mapping[str, WorkerSlice]

    def body(self, url: str) -> dict[str, Any]:
        """The prepare body's ``workers`` of ``url``."""
        return {
            w: {"slice": encode_slice(self.slices[w]), "layout": [], "fallback": []}
            for w in self.workers[url]
        }

    def peers(self, url: str, advertised: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """The apply body's ``peers`` of ``url``: the workers its workers push entries to,
        each with its entry buffer alone."""
        batches = [b for w in self.workers[url] for b in self.slices[w].stages[0]]
        return {
            peer: {
                **advertised[peer],
                "regions": {DELTA_REGION: advertised[peer]["regions"][DELTA_REGION]},
            }
            for peer in sorted(pushed_regions(batches))
        }

    @property
    def read_bytes(self) -> int:
        return sum(s.read_bytes for s in self.slices.values())


def worker_blocks(
    workers: Sequence[Mapping[str, Any]],
    manifest: WeightManifest,
    checksums: ChecksumTable,
    table: DeltaTable,
) -> dict[str, tuple[EntryBlock, ...]]:
    """Each worker's entry blocks, or :class:`DeltaUnavailable` saying why an engine (its
    workers' full placements) cannot take the delta in place."""
    out = {}
    for worker in workers:
        if not worker.get("in_place_all"):
            raise DeltaUnavailable(
                f"worker {worker.get('worker_id')} processes some parameters after loading"
            )
        try:
            reads = delta_reads(
                manifest,
                checksums.objects,
                table,
                [BoxRow.of(s) for s in worker["shards"]],
                set(worker.get("regions", {})),
            )
        except DeltaUnavailable as error:
            raise DeltaUnavailable(f"worker {worker.get('worker_id')}: {error}") from error
        out[str(worker["worker_id"])] = entry_blocks(
            table, [(r.key, r.offset, r.length) for r in reads]
        )
    return out


def delta_targets(
    coordinator: Coordinator,
    record: ActiveRecord,
    manifest: WeightManifest,
    checksums: ChecksumTable,
    table: DeltaTable | None,
    placements: Mapping[str, Mapping[str, Any]],
    targets: Sequence[str],
    options: Options,
) -> tuple[InPlaceDelta, dict[str, str]]:
    """The targets that take ``record``'s delta in place, and why each other target takes
    the generation whole (nothing for a full generation)."""
    if table is None:
        return InPlaceDelta(), {}
    if options.mode != "direct" or not options.in_place:
        return InPlaceDelta(), dict.fromkeys(
            targets, "a delta is taken in place in direct mode alone"
        )
    if options.transport is not TransportMode.STORE:
        return InPlaceDelta(), dict.fromkeys(targets, f"the {options.transport.value} transport")
    why_not: dict[str, str] = {}
    at_base = []
    for url in targets:
        served = placements[url].get("generation")
        if served != table.base or placements[url].get("incarnation") != record.incarnation:
            why_not[url] = f"serves generation {served}, not the base {table.base}"
        else:
            at_base.append(url)
    described, _ = coordinator._all(at_base, "GET", "placement")
    workers: dict[str, tuple[str, ...]] = {}
    nodes: dict[str, str] = {}
    blocks: dict[str, tuple[EntryBlock, ...]] = {}
    for url in at_base:
        reply = described.get(url)
        if reply is None:
            why_not[url] = "its placement did not answer"
            continue
        try:
            found = worker_blocks(reply["workers"], manifest, checksums, table)
        except DeltaUnavailable as error:
            why_not[url] = str(error)
            continue
        workers[url] = tuple(found)
        blocks |= found
        nodes |= {str(w["worker_id"]): str(w["node"]) for w in reply["workers"]}
    for url, why in why_not.items():
        logger.info("%s takes generation %s whole: %s", url, record.generation, why)
    return InPlaceDelta(workers, nodes, blocks), why_not
