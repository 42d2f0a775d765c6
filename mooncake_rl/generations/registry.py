"""A model's generation numbers, active record, index and announce: the publication contract.

    publish attempt --claim_generation--> number N (its exclusive ``claim`` record)
      ... ranks put the payloads ...
    rank 0 --announce--> payloads checked whole (``payloads``), checksums/segments/manifest
      put, fence record F + 1 created exclusively --> ``active`` copy and index upserted
    readers --active()--> the ``active`` copy, then fence records probed forward
      --> load_manifest / load_checksums / segment_hints of that generation

The records themselves and their sealed encoding are ``records``; this module reads and
writes them in order. ``docs/generations.md`` states the scheme; in short:

- **Claims.** A publish attempt claims its generation number by creating the group's
  ``claim`` record exclusively (the master arbitrates: no read-then-write). A number is
  claimed once per Store incarnation and never handed out again, so every object under a
  group belongs to the one attempt that claimed it, and an attempt that fails removes only
  its own objects.
- **Fences.** Active records are numbered: record ``F`` lives at ``fence/F`` and is created
  exclusively, so a move of the active generation is a compare-and-set against record
  ``F - 1``. Announce moves it only forward (past every generation ever announced);
  ``activate`` may move it back to an older, readable generation with a new fence.
  ``active`` holds a copy of a recent record, where readers start probing.
- **Incarnation.** A record created once per master lifetime. Every active record carries
  the incarnation it was written in; a master that lost its state lost that record too, so
  readers can tell, and a generation is named by (incarnation, number).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import UTC, datetime

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import (
    InvariantViolation,
    MooncakeError,
    MooncakeRLError,
    ObjectAlreadyExists,
    ObjectNotFound,
)
from mooncake_rl.generations.chain import (
    DeltaTable,
    chain_of,
    delta_problems,
    load_delta_table,
    realize_generation,
)
from mooncake_rl.generations.checksums import ChecksumTable, CorruptObject
from mooncake_rl.generations.keys import (
    active_key,
    check_model_name,
    checksums_key,
    claim_key,
    deltas_key,
    fence_key,
    group_id,
    index_key,
    manifest_key,
    segments_key,
)
from mooncake_rl.generations.layout import SegmentMap
from mooncake_rl.generations.packing import checksum_sizes
from mooncake_rl.generations.payloads import payload_problems, payload_state
from mooncake_rl.generations.records import (
    ActiveRecord,
    Claim,
    FenceError,
    GenerationIndex,
    GenerationInfo,
    Incarnation,
    Lineage,
    NoActiveGeneration,
    StoreStateLost,
    decode_record,
    lost_state_hint,
    seal,
    unseal,
)
from mooncake_rl.store import StoreClient

# The records and the payload checks live in their own modules; code across the repo imports
# them from here, the contract's one entry point.
__all__ = [
    "CLAIM_PROBES",
    "FENCES_KEPT",
    "ActiveRecord",
    "Claim",
    "FenceError",
    "GenerationIndex",
    "GenerationInfo",
    "GenerationRegistry",
    "Incarnation",
    "NoActiveGeneration",
    "StoreStateLost",
    "active_generation",
    "load_manifest",
    "lost_state_hint",
    "no_active_message",
    "payload_problems",
    "payload_state",
    "require_active",
]

logger = logging.getLogger(__name__)

CLAIM_PROBES = 1000
"""Claims tried past the newest known number before giving up (aborted attempts skip one)."""
FENCES_KEPT = 16
"""Fence records kept below the newest, so a reader whose ``active`` copy lags still probes."""


class GenerationRegistry:
    """Reads and writes one model's generation records in the Store."""

    def __init__(self, store: StoreClient, model: str) -> None:
        self.store = store
        self.model = check_model_name(model)

    # -- readers -----------------------------------------------------------------------
    def fence_record(self, fence: int) -> ActiveRecord | None:
        """Active record number ``fence``, or ``None`` if it was never written (or collected)."""
        try:
            record = ActiveRecord.decode(self.store.get_bytes(fence_key(self.model, fence)))
        except ObjectNotFound:
            return None
        if record.model != self.model or record.fence != fence:
            raise FenceError(f"active record {fence} names {record.model!r}/{record.fence}")
        return record

    def active(self) -> ActiveRecord | None:
        """The newest fence record: start at the ``active`` copy, probe forward."""
        try:
            record: ActiveRecord | None = ActiveRecord.decode(
                self.store.get_bytes(active_key(self.model))
            )
        except ObjectNotFound:
            record = None
        if record is not None and record.model != self.model:
            raise FenceError(f"active record names model {record.model!r}, not {self.model!r}")
        fence = record.fence if record else 0
        while self.store.exists([fence_key(self.model, fence + 1)])[0]:
            fence += 1
            record = self.fence_record(fence)
        return record

    def load_manifest(self, generation: int, expected_digest: str | None = None) -> WeightManifest:
        data = self.store.get_bytes(manifest_key(group_id(self.model, generation)))
        try:
            manifest = WeightManifest.from_json(data)
        except ValueError as error:  # mooncake.reshard's own checks (overlapping fragments)
            raise InvariantViolation(
                f"the manifest of generation {generation} of {self.model} is malformed "
                f"({error}); republish it"
            ) from error
        if manifest.resource_id != self.model or manifest.weight_generation != generation:
            raise FenceError(f"manifest at generation {generation} describes something else")
        if expected_digest is not None and manifest.manifest_digest != expected_digest:
            raise FenceError(f"manifest digest of generation {generation} does not match")
        return manifest

    def load_active_manifest(self) -> WeightManifest | None:
        record = self.active()
        if record is None:
            return None
        return self.load_manifest(record.generation, record.manifest_digest)

    def load_segments(self, generation: int, digest: str) -> SegmentMap:
        """The generation's segment map, refused unless it hashes to ``digest``."""
        data = self.store.get_bytes(segments_key(group_id(self.model, generation)))
        segments = SegmentMap.decode(data)
        if segments.digest != digest:
            raise CorruptObject(
                f"the segment map of generation {generation} of {self.model} does not match "
                "its digest in the active record"
            )
        return segments

    def segment_hints(self, record: ActiveRecord) -> SegmentMap | None:
        """The record's segment map, or None (a record older than hints, or a map that cannot
        be read): hints only steer the reader choice, a plan without them is as correct."""
        if record.segments_digest is None:
            return None
        try:
            return self.load_segments(record.generation, record.segments_digest)
        except MooncakeRLError as error:
            logger.warning(
                "generation %s: planning without locality hints: %s", record.generation, error
            )
            return None

    def load_checksums(self, generation: int, digest: str) -> ChecksumTable:
        """The generation's checksum table, refused unless it hashes to ``digest``."""
        data = self.store.get_bytes(checksums_key(group_id(self.model, generation)))
        if ChecksumTable.digest_of(data) != digest:
            raise CorruptObject(
                f"the checksum table of generation {generation} of {self.model} does not match "
                "its digest in the index: the Store holds corrupted records"
            )
        return ChecksumTable.decode(data)

    def index(self) -> GenerationIndex:
        """The stored index with every newer fence record folded in (read-only)."""
        try:
            stored = GenerationIndex.decode(self.store.get_bytes(index_key(self.model)))
        except ObjectNotFound:
            stored = GenerationIndex(0, ())
        current = self.active()
        newest = current.fence if current else 0
        start = max(stored.through_fence + 1, newest - FENCES_KEPT + 1, 1)
        records = [r for f in range(start, newest + 1) if (r := self.fence_record(f)) is not None]
        return stored.with_records(records)

    def generations(self) -> list[GenerationInfo]:
        return list(self.index().generations)

    def unreadable(self, generation: int, digest: str | None = None) -> list[str]:
        """What keeps ``generation``'s bytes from being read whole: a missing or resized
        payload, or, for a delta not yet realized, anything missing along its chain."""
        chain = chain_of(self.store, self.model, generation)
        if not chain.deltas:
            return payload_problems(self.store, self.load_manifest(generation, digest))
        try:
            problems = payload_problems(self.store, self.load_manifest(chain.full))
        except ObjectNotFound:
            problems = [f"missing the manifest of generation {chain.full}, the chain's base"]
        for delta, table in chain.deltas:
            problems += delta_problems(self.store, self.load_manifest(delta), table)
        return problems

    def incarnation(self) -> Incarnation | None:
        return Incarnation.read(self.store)

    # -- writers -----------------------------------------------------------------------
    def claim_generation(self, attempt: str) -> int:
        """Claim the next free generation number for ``attempt`` (exclusive creates only)."""
        incarnation = Incarnation.ensure(self.store)
        active = self.active()
        known = [g.generation for g in self.generations()]
        start = max([*known, active.newest if active else 0], default=0) + 1
        claim = seal(asdict(Claim(attempt, incarnation.id, datetime.now(UTC).isoformat())))
        for generation in range(start, start + CLAIM_PROBES):
            try:
                self.store.create_exclusive(claim_key(group_id(self.model, generation)), claim)
                return generation
            except ObjectAlreadyExists:
                continue
        raise InvariantViolation(
            f"no free generation number of {self.model} in [{start}, {start + CLAIM_PROBES}): "
            "that many publish attempts failed without a success; see `mooncake-rl status`"
        )

    def claim(self, generation: int) -> Claim | None:
        try:
            body = unseal(
                self.store.get_bytes(claim_key(group_id(self.model, generation))), "claim record"
            )
        except ObjectNotFound:
            return None
        return decode_record(Claim, body, "claim record")

    def check_owner(self, generation: int, attempt: str) -> Claim:
        """Refuse to act on a group this attempt does not own (or that the master forgot)."""
        claim = self.claim(generation)
        if claim is None:
            raise StoreStateLost(
                lost_state_hint(self.model, f"generation {generation} has no claim record")
            )
        if claim.attempt != attempt:
            raise FenceError(
                f"generation {generation} of {self.model} belongs to publish attempt "
                f"{claim.attempt}, not {attempt}"
            )
        return claim

    def mark_aborted(self, generation: int, attempt: str) -> None:
        """Tombstone the claim: late ranks of the attempt see it and remove their own puts."""
        claim = self.check_owner(generation, attempt)
        self.store.upsert_bytes(
            claim_key(group_id(self.model, generation)),
            seal(asdict(replace(claim, aborted_at=time.time()))),
        )

    def announce(
        self,
        manifest: WeightManifest,
        checksums: ChecksumTable,
        attempt: str,
        delta: DeltaTable | None = None,
    ) -> ActiveRecord:
        """Make a fully written generation active: a compare-and-set that only moves forward.

        Refused, with nothing of the winner changed, when a newer generation was announced
        first, when a payload is missing or of the wrong size, or when the checksum table
        does not cover every payload exactly. A delta generation (``delta``) holds delta
        objects instead of payloads, and is refused unless its base is the newest
        generation announced before it (:mod:`.chain`).
        """
        generation = manifest.weight_generation
        if manifest.resource_id != self.model or manifest.group_id != group_id(
            self.model, generation
        ):
            raise FenceError("manifest does not belong to this model's key space")
        claim = self.check_owner(generation, attempt)
        sizes = checksum_sizes(manifest, {k: c.nbytes for k, c in checksums.objects.items()})
        if delta is None:
            lineage = Lineage(generation)
            problems, segments = payload_state(self.store, manifest)
        else:
            lineage = self._delta_lineage(generation, delta)
            problems, segments = delta_problems(self.store, manifest, delta), SegmentMap.of({})
        if set(sizes) != set(checksums.objects) or any(
            checksums.objects[k].nbytes != n for k, n in sizes.items()
        ):
            problems.append("the checksum table does not cover exactly the manifest's payloads")
        if problems:
            raise InvariantViolation(
                f"cannot announce: {len(problems)} payload problem(s), first: {problems[0]}"
            )
        encoded = checksums.encode()
        self.store.put_bytes(checksums_key(manifest.group_id), encoded)
        if delta is not None:
            self.store.upsert_bytes(deltas_key(manifest.group_id), delta.encode())
        self.store.upsert_bytes(segments_key(manifest.group_id), segments.encode())
        self.store.put_bytes(manifest.manifest_key, manifest.to_json().encode())

        def record(current: ActiveRecord | None) -> ActiveRecord:
            if current is not None and current.newest >= generation:
                raise FenceError(
                    f"stale announce: generation {generation} of {self.model} lost to generation "
                    f"{current.newest} (active: {current.generation}, fence {current.fence}); "
                    "nothing of it was changed"
                )
            if lineage.is_delta and (current is None or current.newest != lineage.base):
                raise FenceError(
                    f"generation {generation} of {self.model} is a delta against generation "
                    f"{lineage.base}, but the generation announced before it is "
                    f"{current.newest if current else 'none'}: publish it against that one, "
                    "or as a keyframe"
                )
            digest = ChecksumTable.digest_of(encoded)
            return ActiveRecord.replacing(
                current, manifest, digest, claim.incarnation, generation, segments.digest, lineage
            )

        return self._advance(record)

    def _delta_lineage(self, generation: int, delta: DeltaTable) -> Lineage:
        """The chain a delta generation extends: its base must still be announced, and the
        table must name the base's keyframe."""
        base = next((i for i in self.generations() if i.generation == delta.base), None)
        if base is None:
            raise FenceError(
                f"generation {generation} of {self.model} is a delta against generation "
                f"{delta.base}, which was never announced or was collected: publish a keyframe"
            )
        keyframe = base.keyframe if base.keyframe is not None else base.generation
        if delta.keyframe != keyframe:
            raise FenceError(
                f"generation {generation}'s delta table names keyframe {delta.keyframe}, but "
                f"its base {base.generation} descends from keyframe {keyframe}"
            )
        return Lineage(
            generation,
            delta.base,
            keyframe,
            base.chain_length + 1,
            base.chain_bytes + delta.delta_bytes,
        )

    def activate(self, generation: int) -> ActiveRecord:
        """Move the active record to an announced, fully readable generation (a new fence)."""
        info = next((i for i in self.generations() if i.generation == generation), None)
        if info is None:
            raise FenceError(
                f"generation {generation} of {self.model} was never announced or was collected; "
                "`mooncake-rl status` lists the ones that can be activated"
            )
        manifest = self.load_manifest(generation, info.digest)
        if load_delta_table(self.store, self.model, generation) is not None:
            checksums = self.load_checksums(generation, info.checksums_digest)
            realize_generation(self.store, self.model, generation, checksums)
        problems, segments = payload_state(self.store, manifest)
        if problems:
            raise InvariantViolation(
                f"cannot activate generation {generation}: {len(problems)} object(s) unreadable, "
                f"first: {problems[0]}"
            )
        self.load_checksums(generation, info.checksums_digest)
        self.store.upsert_bytes(segments_key(manifest.group_id), segments.encode())
        incarnation = Incarnation.ensure(self.store)

        def record(current: ActiveRecord | None) -> ActiveRecord:
            if current is None:
                raise StoreStateLost(lost_state_hint(self.model, "no active record"))
            if current.generation == generation:
                raise FenceError(f"generation {generation} of {self.model} is already active")
            return ActiveRecord.replacing(
                current,
                manifest,
                info.checksums_digest,
                incarnation.id,
                current.newest,
                segments.digest,
                info.lineage,
            )

        return self._advance(record)

    def _advance(self, build: Callable[[ActiveRecord | None], ActiveRecord]) -> ActiveRecord:
        """Compare-and-set: create fence record ``current + 1``; on a lost race, re-decide.

        Refused while a durable Store's etcd is out of space: the fence would be served now
        and gone after the next failover (Mooncake cannot log it, yet answers success). A
        writer elsewhere can fill etcd between that check and the fence: etcd is asked again
        afterwards, and the change raises, named as possibly unlogged, instead of returning.
        """
        self.store.require_log_space(f"moving the active generation of {self.model}")
        while True:
            record = build(self.active())
            try:
                self.store.create_exclusive(fence_key(self.model, record.fence), record.encode())
            except ObjectAlreadyExists:
                continue
            self._publish_side_records(record)
            self.store.require_log_space(
                f"generation {record.generation} of {self.model} became active on the leading "
                f"master (fence {record.fence}), but etcd filled up as it did (its own record or "
                "another writer took the last space): the change may be missing from the "
                "operation log, and a "
                f"failover would bring back generation {record.previous}"
            )
            return record

    def _publish_side_records(self, record: ActiveRecord) -> None:
        """The ``active`` copy and the index heal from fence records: failures only warn."""
        try:
            self.store.upsert_bytes(active_key(self.model), record.encode())
            self.write_index(self.index())
        except MooncakeError as error:
            logger.warning(
                "generation %s is active; side records lag: %s", record.generation, error
            )

    def write_index(self, index: GenerationIndex) -> None:
        self.store.upsert_bytes(index_key(self.model), index.encode())

    def is_announced(self, generation: int) -> bool:
        return any(i.generation == generation for i in self.generations())


def active_generation(store: StoreClient, model: str) -> ActiveRecord | None:
    """The model's active generation, or ``None`` if nothing was announced yet."""
    return GenerationRegistry(store, model).active()


def load_manifest(store: StoreClient, model: str, generation: int) -> WeightManifest:
    return GenerationRegistry(store, model).load_manifest(generation)


def require_active(store: StoreClient, model: str, what: str) -> ActiveRecord:
    """The active record, or the documented error naming the Store incarnation and way out."""
    record = GenerationRegistry(store, model).active()
    if record is not None:
        return record
    raise NoActiveGeneration(no_active_message(store, model, what))


def no_active_message(store: StoreClient, model: str, what: str) -> str:
    incarnation = Incarnation.read(store)
    where = (
        f"Store incarnation {incarnation.id} (started {incarnation.created_at})"
        if incarnation
        else "a Store that holds no record at all"
    )
    return (
        f"{what}: model {model!r} has no active generation in {where}. Publish one "
        "(`mooncake-rl publish`); if one was published before, the master restarted and lost "
        "it: republish, then `mooncake-rl update` (docs/generations.md#lost-master)"
    )
