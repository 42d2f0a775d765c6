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
from mooncake_rl.generations.checksums import ObjectChecksum
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

ALIGN = 64


def region_of(name: str, tensor: torch.Tensor) -> Region:
    if not tensor.is_contiguous():
        raise InvariantViolation(f"region {name} must be contiguous")
    return Region(
        name, tensor.data_ptr(), tensor.numel() * tensor.element_size(), str(tensor.device)
    )


def allocate_arena(
    sizes: Mapping[str, int], reuse: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, Region]]:
    """Every region in one buffer, 64-byte aligned, in name order.

    ``reuse`` (the worker's current arena) is kept when the layout fits in it: the bytes
    are overwritten by every update anyway, and an unchanged arena keeps its registrations
    (no re-registration, no new memory for peers to learn about). Otherwise a zeroed,
    larger buffer is allocated.
    """
    offsets, cursor = {}, 0
    for name in sorted(sizes):
        offsets[name] = cursor
        cursor += (sizes[name] + ALIGN - 1) // ALIGN * ALIGN
    needed = max(cursor, ALIGN)
    fits = reuse is not None and reuse.numel() >= needed
    arena = reuse if fits else torch.zeros(needed, dtype=torch.uint8)
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
        self.checksums: Mapping[str, ObjectChecksum] | None = None

    def describe(self) -> dict[str, Any]:
        """What peers need to write here: TE endpoint, node and region addresses."""
        return {
            "worker_id": self.worker_id,
            "node": self.settings.node,
            "endpoint": self.engine.endpoint,
            "regions": {n: {"base": r.base, "size": r.size} for n, r in self.regions.items()},
        }

    def prepare(
        self,
        arena: Region,
        regions: Mapping[str, Region],
        stages: Sequence[Sequence[Batch]],
        checksums: Mapping[str, ObjectChecksum] | None = None,
    ) -> None:
        """Validate every local range and register the arena; touches no bytes.

        ``checksums`` (the generation's table, at least every key this worker reads) makes
        every later stage check its landed reads; without it they land unchecked.

        A different arena than last time is registered on the same Transfer Engine and the
        old one released. Peers need not learn of it in advance: a TCP receiver checks
        each write against what it has registered when the write arrives (so a write into
        the released arena is refused), and RDMA reloads a peer's descriptor when an
        address misses it. One endpoint per worker for its lifetime also means peers'
        connections are made once and reused by every later update.
        """
        executor = WorkerExecutor(
            self.store, self.engine, regions, self.settings.staging_watermark_bytes, checksums
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
        self.registrations.provision([arena])
        self.arena = arena
        self.regions = dict(regions)
        self.checksums = checksums

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
            self.store,
            self.engine,
            self.regions,
            self.settings.staging_watermark_bytes,
            self.checksums,
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
