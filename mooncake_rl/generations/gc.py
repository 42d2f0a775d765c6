"""Serving leases and garbage collection of old generations.

Engines renew a lease record naming the generation they serve; GC keeps the newest K
generations, the active one, and every generation under an unexpired lease. Lease expiry
uses wall-clock time, so engine and GC hosts need synchronized clocks (NTP).

The Store has no key listing, so lease holders are found through the model's engine slots
(:class:`LeaseBook`), each created exclusively, so concurrent registrations never lose one
another.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import (
    InvariantViolation,
    MooncakeError,
    ObjectAlreadyExists,
    ObjectNotFound,
)
from mooncake_rl.generations.keys import (
    checksums_key,
    claim_key,
    engines_key,
    fence_key,
    group_id,
    lease_key,
    legacy_routing_tables_pattern,
    manifest_key,
    routing_tables_prefix,
    segments_key,
)
from mooncake_rl.generations.layout import SegmentMap, layout_digest, located_digest
from mooncake_rl.generations.registry import (
    FENCES_KEPT,
    ActiveRecord,
    GenerationIndex,
    GenerationInfo,
    GenerationRegistry,
)
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


ENGINE_SLOT_PROBE = 64
"""Engine slots probed per existence check when listing lease holders."""


class LeaseBook:
    """Reads and writes one model's serving leases.

    Lease holders are found through engine slots: ``engines/1``, ``engines/2``, ... each
    created exclusively (the master arbitrates) and naming one engine, so two engines that
    register at once both get listed, and a lease is visible to GC as soon as ``renew``
    returns. Slots are never removed (a restarted engine finds and reuses its own).
    """

    def __init__(self, store: StoreClient, model: str) -> None:
        self.store = store
        self.model = model
        self._registered: set[str] = set()

    def _slot(self, number: int) -> str:
        return f"{engines_key(self.model)}/{number}"

    def _slot_owner(self, number: int) -> str | None:
        for _ in range(20):  # a slot being created is briefly not readable yet
            try:
                return self.store.get_bytes(self._slot(number)).decode()
            except ObjectNotFound:
                return None
            except MooncakeError:
                time.sleep(0.01)
        return None

    def _slots(self) -> list[str | None]:
        """Every slot's engine (None: unreadable), in slot order."""
        owners: list[str | None] = []
        start = 1
        while True:
            numbers = range(start, start + ENGINE_SLOT_PROBE)
            present = self.store.exists([self._slot(n) for n in numbers])
            for number, exists in zip(numbers, present, strict=True):
                if not exists:
                    return owners
                owners.append(self._slot_owner(number))
            start += ENGINE_SLOT_PROBE

    def _engines(self) -> list[str]:
        return sorted({owner for owner in self._slots() if owner})

    def _register(self, engine_id: str) -> None:
        if engine_id in self._registered:
            return
        while True:
            owners = self._slots()
            if engine_id in owners:
                break
            try:
                self.store.create_exclusive(self._slot(len(owners) + 1), engine_id.encode())
                break
            except ObjectAlreadyExists:
                continue  # another engine took that slot first: look again
        self._registered.add(engine_id)

    def renew(
        self, engine_id: str, generation: int, ttl_s: float, now: float | None = None
    ) -> Lease:
        if not engine_id or "/" in engine_id:
            raise InvariantViolation(f"engine id {engine_id!r} must be non-empty without '/'")
        lease = Lease(engine_id, generation, (now or time.time()) + ttl_s)
        self.store.upsert_bytes(
            lease_key(self.model, engine_id), json.dumps(lease.__dict__).encode()
        )
        self._register(engine_id)
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
    swept_attempts: tuple[int, ...] = ()
    removed_tables: int = 0


def removable(info: GenerationInfo, now: float, grace_s: float) -> bool:
    """A retired generation is removable once ``grace_s`` passed since it stopped being
    active: an engine that read the active record before that has taken its lease by then
    (engines take the lease before reading, and give up if that took longer than the grace)."""
    return info.retired_at is not None and now - info.retired_at >= grace_s


def collect_garbage(
    store: StoreClient,
    model: str,
    keep: int = 2,
    now: float | None = None,
    grace_s: float | None = None,
) -> GcReport:
    """Delete what :func:`plan_gc` selects among generations retired for ``grace_s``, and
    the leftovers of failed publish attempts; the index is rewritten to match when that
    changed it.

    Removal is not forced: Mooncake refuses to remove an object a reader holds a read lease
    on (``OBJECT_HAS_LEASE``); such a generation stays listed and goes at the next run.
    """
    moment = time.time() if now is None else now
    grace = store.settings.retire_grace_s if grace_s is None else grace_s
    registry = GenerationRegistry(store, model)
    active = registry.active()
    index = registry.index()
    leased = LeaseBook(store, model).live_generations(moment)
    candidates = plan_gc(
        (i.generation for i in index.generations),
        active.generation if active else None,
        leased,
        keep,
    )
    infos = {i.generation: i for i in index.generations}
    doomed = [g for g in candidates if removable(infos[g], moment, grace)]
    removed, failures, deleted, layouts = 0, {}, [], set()
    for generation in doomed:
        count, failed, sources = _remove_generation(store, registry, generation)
        removed += count
        failures.update(failed)
        if not failed:
            deleted.append(generation)
            layouts |= sources
    swept, swept_through = _sweep_failed_attempts(store, registry, index, active, moment, grace)
    if active is not None:
        floor = active.fence - FENCES_KEPT
        store.remove([fence_key(model, f) for f in range(max(1, floor - 64), floor + 1)])
    rewritten = replace(index.without(set(deleted)), swept_through=swept_through)
    if rewritten != index:  # every Store write is an entry in a durable Store's etcd log
        registry.write_index(rewritten)
    kept = tuple(sorted(g for g in infos if g not in deleted))
    tables = _remove_tables(store, registry, layouts, kept) if deleted else 0
    return GcReport(kept, tuple(deleted), removed, failures, tuple(swept), tables)


def _remove_generation(
    store: StoreClient, registry: GenerationRegistry, generation: int
) -> tuple[int, dict[str, int], set[str]]:
    """Objects removed, failures, and the source digests its routing tables are kept under."""
    group = group_id(registry.model, generation)
    try:
        manifest = registry.load_manifest(generation)
    except ObjectNotFound:  # removed by an earlier run that could not rewrite the index
        return store.remove_prefix(group + "/", force=True), {}, set()
    sources = _table_sources(store, registry, generation, manifest)
    keys = list(dict.fromkeys(f.object_key for f in manifest.fragments))  # packs hold several
    failed = store.remove(keys)
    if failed:
        return len(keys) - len(failed), failed, set()
    records = [manifest_key(group), checksums_key(group), segments_key(group), claim_key(group)]
    failed = store.remove(records, force=True)
    return len(keys) + len(records) - len(failed), failed, sources


def _table_sources(
    store: StoreClient, registry: GenerationRegistry, generation: int, manifest: WeightManifest
) -> set[str]:
    """The source digests a generation's routing tables are kept under: its layout's, and
    its layout located by its segment map (plans whose hints put objects on a rollout node)."""
    layout = layout_digest(manifest)
    try:
        data = store.get_bytes(segments_key(group_id(registry.model, generation)))
    except ObjectNotFound:  # a generation without locality hints
        return {layout}
    return {layout, located_digest(layout, SegmentMap.digest_of(data))}


def _remove_tables(
    store: StoreClient, registry: GenerationRegistry, gone: set[str], kept: Iterable[int]
) -> int:
    """Remove the routing tables planned from sources only collected generations had, and
    any a release before issue 51 left; a kept generation's manifest is read only while
    some source is still a candidate (a model whose layout never changes reads none)."""
    for generation in kept:
        if not gone:
            break
        try:
            manifest = registry.load_manifest(generation)
        except ObjectNotFound:  # unreadable: no engine can load it, nor needs its tables
            continue
        gone -= _table_sources(store, registry, generation, manifest)
    removed = sum(store.remove_prefix(routing_tables_prefix(s), force=True) for s in sorted(gone))
    return removed + store.remove_matching(legacy_routing_tables_pattern(), force=True)


def _sweep_failed_attempts(
    store: StoreClient,
    registry: GenerationRegistry,
    index: GenerationIndex,
    active: ActiveRecord | None,
    now: float,
    grace_s: float,
) -> tuple[list[int], int]:
    """Remove what failed attempts below the newest generation left (their tombstoned claim
    and any straggler's late puts) once ``grace_s`` passed since the abort; an attempt still
    in flight stops the sweep mark there."""
    if active is None:
        return [], index.swept_through
    announced = {i.generation for i in index.generations}
    swept, mark = [], index.swept_through
    for generation in range(index.swept_through + 1, active.newest):
        if generation in announced:
            mark = generation if mark == generation - 1 else mark
            continue
        claim = registry.claim(generation)
        if claim is not None and (claim.aborted_at is None or now - claim.aborted_at < grace_s):
            continue  # in flight, or aborted moments ago: a late rank may still be putting
        if claim is not None:
            store.remove_prefix(group_id(registry.model, generation) + "/", force=True)
            swept.append(generation)
        mark = generation if mark == generation - 1 else mark
    return swept, mark
