"""Garbage collection of old generations.

GC keeps the newest K generations, the active one, and every generation a serving or update
lease names (:mod:`.leases`); it removes the rest once they have been retired for the grace
period, with what failed publish attempts left and the routing tables no kept generation
uses.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import (
    InvariantViolation,
    ObjectNotFound,
)
from mooncake_rl.generations.keys import (
    adapter_key,
    checksums_key,
    claim_key,
    delta_prefix,
    deltas_key,
    fence_key,
    group_id,
    legacy_routing_tables_pattern,
    manifest_key,
    routing_tables_prefix,
    segments_key,
)
from mooncake_rl.generations.layout import SegmentMap, layout_digest, located_digest
from mooncake_rl.generations.leases import lease_book
from mooncake_rl.generations.registry import (
    FENCES_KEPT,
    ActiveRecord,
    GenerationIndex,
    GenerationInfo,
    GenerationRegistry,
)
from mooncake_rl.store import StoreClient


def plan_gc(
    generations: Iterable[int],
    active: int | None,
    leased: Iterable[int],
    keep: int,
    bases: Mapping[int, int | None] | None = None,
) -> list[int]:
    """Generations to delete: all but the newest ``keep``, the active and the leased ones,
    and the chain each of those reads its bytes through (``bases``: a delta generation's
    base, :mod:`.chain`), back to its keyframe."""
    if keep < 1:
        raise InvariantViolation("keep must be at least 1")
    ordered = sorted(set(generations), reverse=True)
    protected = set(ordered[:keep]) | set(leased) | ({active} if active is not None else set())
    for generation in list(protected):
        while (base := (bases or {}).get(generation)) is not None and base not in protected:
            protected.add(base)
            generation = base
    return sorted(g for g in ordered if g not in protected)


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
    leased = lease_book(store, model).live_generations(moment)
    candidates = plan_gc(
        (i.generation for i in index.generations),
        active.generation if active else None,
        leased,
        keep,
        {i.generation: i.base for i in index.generations},
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
    deltas = store.remove_prefix(delta_prefix(group))
    records = [manifest_key(group), checksums_key(group), segments_key(group), claim_key(group)]
    failed = store.remove([*records, deltas_key(group), adapter_key(group)], force=True)
    return len(keys) + deltas + len(records) - len(failed), failed, sources


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
