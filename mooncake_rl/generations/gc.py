"""Serving leases and garbage collection of old generations.

Engines renew a lease record naming the generation they serve; GC keeps the newest K
generations, the active one, and every generation under an unexpired lease. Lease expiry
uses wall-clock time, so engine and GC hosts need synchronized clocks (NTP).

The Store has no key listing, so lease holders are found through the model's engines
record. Concurrent renewals may overwrite each other's addition to it; every renewal
re-checks and re-adds its engine, so a lost addition heals at the next renewal.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mooncake_rl.errors import InvariantViolation, ObjectNotFound
from mooncake_rl.generations.keys import (
    announced_key,
    engines_key,
    group_id,
    lease_key,
    manifest_key,
)
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.store import StoreClient


@dataclass(frozen=True)
class Lease:
    engine_id: str
    generation: int
    expires_at: float

    def live(self, now: float) -> bool:
        return self.expires_at > now


def plan_gc(
    generations: Iterable[int], active: int | None, leased: Iterable[int], keep: int
) -> list[int]:
    """Generations to delete: all but the newest ``keep``, the active and the leased ones."""
    if keep < 1:
        raise InvariantViolation("keep must be at least 1")
    ordered = sorted(set(generations), reverse=True)
    protected = set(ordered[:keep]) | set(leased) | ({active} if active is not None else set())
    return sorted(g for g in ordered if g not in protected)


class LeaseBook:
    """Reads and writes one model's serving leases."""

    def __init__(self, store: StoreClient, model: str) -> None:
        self.store = store
        self.model = model

    def _engines(self) -> list[str]:
        try:
            return list(json.loads(self.store.get_bytes(engines_key(self.model))))
        except ObjectNotFound:
            return []

    def renew(
        self, engine_id: str, generation: int, ttl_s: float, now: float | None = None
    ) -> Lease:
        if not engine_id or "/" in engine_id:
            raise InvariantViolation(f"engine id {engine_id!r} must be non-empty without '/'")
        lease = Lease(engine_id, generation, (now or time.time()) + ttl_s)
        self.store.upsert_bytes(
            lease_key(self.model, engine_id), json.dumps(lease.__dict__).encode()
        )
        engines = self._engines()
        if engine_id not in engines:
            self.store.upsert_bytes(
                engines_key(self.model), json.dumps(sorted([*engines, engine_id])).encode()
            )
        return lease

    def release(self, engine_id: str) -> None:
        self.store.remove([lease_key(self.model, engine_id)], force=True)

    def leases(self) -> dict[str, Lease]:
        found: dict[str, Lease] = {}
        for engine_id in self._engines():
            try:
                found[engine_id] = Lease(
                    **json.loads(self.store.get_bytes(lease_key(self.model, engine_id)))
                )
            except ObjectNotFound:
                continue
        return found

    def live_generations(self, now: float | None = None) -> set[int]:
        moment = time.time() if now is None else now
        return {lease.generation for lease in self.leases().values() if lease.live(moment)}


@dataclass(frozen=True)
class GcReport:
    kept: tuple[int, ...]
    deleted: tuple[int, ...]
    removed_objects: int
    failures: Mapping[str, int]


def collect_garbage(
    store: StoreClient, model: str, keep: int = 2, now: float | None = None
) -> GcReport:
    """Delete the generations :func:`plan_gc` selects; the index is rewritten to match."""
    registry = GenerationRegistry(store, model)
    infos = registry.generations()
    active = registry.active()
    leased = LeaseBook(store, model).live_generations(now)
    doomed = plan_gc(
        (i.generation for i in infos), active.generation if active else None, leased, keep
    )
    removed, failures = 0, {}
    for generation in doomed:
        manifest = registry.load_manifest(generation)
        group = group_id(model, generation)
        keys = [f.object_key for f in manifest.fragments]
        keys += [manifest_key(group), announced_key(group)]
        failed = store.remove(keys, force=True)
        failures.update(failed)
        removed += len(keys) - len(failed)
    registry.write_index([i for i in infos if i.generation not in doomed])
    kept = tuple(sorted(i.generation for i in infos if i.generation not in doomed))
    return GcReport(kept, tuple(doomed), removed, failures)
