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
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient


def region_of(name: str, tensor: torch.Tensor) -> Region:
    if not tensor.is_contiguous():
        raise ValueError(f"region {name} must be contiguous")
    return Region(
        name, tensor.data_ptr(), tensor.numel() * tensor.element_size(), str(tensor.device)
    )


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

    def describe(self) -> dict[str, Any]:
        """What peers need to write here: TE endpoint, node and region addresses."""
        return {
            "worker_id": self.worker_id,
            "node": self.settings.node,
            "endpoint": self.engine.endpoint,
            "regions": {n: {"base": r.base, "size": r.size} for n, r in self.regions.items()},
        }

    def prepare(self, regions: Mapping[str, Region], stages: Sequence[Sequence[Batch]]) -> None:
        """Register (provisionally) and validate every local range; touches no bytes."""
        executor = WorkerExecutor(
            self.store, self.engine, regions, self.settings.staging_watermark_bytes
        )
        for batches in stages:
            executor.validate(batches)
        self.registrations.provision(regions.values())
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
