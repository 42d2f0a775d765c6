"""One rollout worker's data-plane endpoint: Store client, TE client, regions, executor.

Engine adapters hold one per worker process (TP rank); tests and benchmarks hold one per
simulated worker. Regions are the worker's destination buffers (parameters or staging);
they are registered in both domains at prepare and reused across generations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mooncake_rl.apply.executor import Batch, Peer, StageResult, WorkerExecutor
from mooncake_rl.apply.registration import Domain, Region, RegistrationManager
from mooncake_rl.engine import TransferEngineClient
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

ALIGN = 64


def region_of(name: str, tensor: torch.Tensor) -> Region:
    if not tensor.is_contiguous():
        raise InvariantViolation(f"region {name} must be contiguous")
    return Region(
        name, tensor.data_ptr(), tensor.numel() * tensor.element_size(), str(tensor.device)
    )


def allocate_arena(sizes: Mapping[str, int]) -> tuple[torch.Tensor, dict[str, Region]]:
    """One zeroed buffer holding every region, 64-byte aligned, in name order.

    A worker registers its arena once. Transfer Engine peers cache a segment's buffer list at
    their first handshake, so registering more memory later would be invisible to them; a
    new arena therefore comes with a new TE endpoint (see :meth:`ApplyWorker.prepare`).
    """
    offsets, cursor = {}, 0
    for name in sorted(sizes):
        offsets[name] = cursor
        cursor += (sizes[name] + ALIGN - 1) // ALIGN * ALIGN
    arena = torch.zeros(max(cursor, ALIGN), dtype=torch.uint8)
    base = arena.data_ptr()
    return arena, {n: Region(n, base + offsets[n], sizes[n]) for n in sorted(sizes)}


def arena_views(arena: torch.Tensor, regions: Mapping[str, Region]) -> dict[str, torch.Tensor]:
    base = arena.data_ptr()
    return {n: arena[r.base - base : r.base - base + r.size] for n, r in regions.items()}


class ApplyWorker:
    def __init__(self, settings: Settings, worker_id: str) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self.store = StoreClient(settings)
        self.engine = TransferEngineClient(settings)
        self.registrations = RegistrationManager(
            worker_id, {Domain.STORE: self.store, Domain.ENGINE: self.engine}
        )
        self.regions: dict[str, Region] = {}
        self.arena: Region | None = None
        self._retired_engines: list[TransferEngineClient] = []

    def describe(self) -> dict[str, Any]:
        """What peers need to write here: TE endpoint, node and region addresses."""
        return {
            "worker_id": self.worker_id,
            "node": self.settings.node,
            "endpoint": self.engine.endpoint,
            "regions": {n: {"base": r.base, "size": r.size} for n, r in self.regions.items()},
        }

    def prepare(
        self, arena: Region, regions: Mapping[str, Region], stages: Sequence[Sequence[Batch]]
    ) -> None:
        """Validate every local range and register the arena; touches no bytes.

        A different arena than last time means new memory: the old one is unregistered and
        the TE endpoint is replaced (a new epoch), so no peer writes with a stale view.
        """
        executor = WorkerExecutor(
            self.store, self.engine, regions, self.settings.staging_watermark_bytes
        )
        for batches in stages:
            executor.validate(batches)
        for region in regions.values():
            if not (
                arena.base <= region.base and region.base + region.size <= arena.base + arena.size
            ):
                raise InvariantViolation(f"region {region.name} lies outside the worker's arena")
        if self.arena is not None and (self.arena.base, self.arena.size) != (
            arena.base,
            arena.size,
        ):
            self.registrations.release([self.arena.base])
            self.engine.close()
            # Keep the retired engine alive: its port stays taken, so no later endpoint in
            # this process reuses a name that peers may have cached with the old buffers.
            self._retired_engines.append(self.engine)
            self.engine = TransferEngineClient(self.settings)
            self.registrations.reconnect({Domain.STORE: self.store, Domain.ENGINE: self.engine})
        self.registrations.provision([arena])
        self.arena = arena
        self.regions = dict(regions)

    def promote(self) -> None:
        self.registrations.promote()

    def rollback(self) -> None:
        self.registrations.rollback()

    def run_stage(
        self,
        batches: Sequence[Batch],
        peers: Mapping[str, Peer],
        scatter: Callable[[Batch], None] | None = None,
    ) -> StageResult:
        executor = WorkerExecutor(
            self.store, self.engine, self.regions, self.settings.staging_watermark_bytes
        )
        return executor.run(batches, peers, scatter)

    def close(self) -> None:
        self.registrations.teardown()
        self.engine.close()
        self.store.close()


def peers_from(descriptions: Sequence[Mapping[str, Any]]) -> dict[str, Peer]:
    return {
        d["worker_id"]: Peer(
            d["endpoint"],
            {n: Region(n, r["base"], r["size"]) for n, r in d["regions"].items()},
        )
        for d in descriptions
    }
