"""The publication contract's records: frozen dataclasses, sealed as checksummed JSON.

    record --encode / seal--> {"body": ..., "sha256": ...} bytes --put--> the Store
    Store bytes --unseal (checksum)--> body --decode_record--> the record, or FenceError

Why sealed: a torn write, or a key some other tool wrote, must read as an error, never as a
record. The records are ``Incarnation`` (one master lifetime), ``ActiveRecord`` (fence
record ``F``: the generation engines serve), ``GenerationIndex`` of ``GenerationInfo`` (every
announced generation still held) and ``Claim`` (who owns a generation number). Reading and
writing them in order is ``registry.GenerationRegistry``'s work; ``docs/generations.md``
states the scheme.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import TypeVar

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import (
    ConfigurationError,
    InvariantViolation,
    ObjectAlreadyExists,
    ObjectNotFound,
)
from mooncake_rl.generations import layout
from mooncake_rl.generations.keys import INCARNATION_KEY
from mooncake_rl.generations.layout import is_digest
from mooncake_rl.store import StoreClient


class FenceError(InvariantViolation):
    """A stale or losing announce, or a record that does not match what it claims."""


class StoreStateLost(InvariantViolation):
    """The master restarted without its state: every record and object is gone."""


class NoActiveGeneration(ConfigurationError):
    """Nothing was announced for the model in this Store incarnation."""


def seal(body: dict[str, object]) -> bytes:
    """JSON with a checksum of its own content, so a torn or foreign record is detected."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({"body": body, "sha256": hashlib.sha256(text.encode()).hexdigest()}).encode()


def unseal(data: bytes, what: str) -> dict[str, object]:
    try:
        outer = json.loads(data)
        body = outer["body"]
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        ok = hashlib.sha256(text.encode()).hexdigest() == outer["sha256"]
    except (ValueError, KeyError, TypeError) as error:
        raise FenceError(f"{what} is not a valid record") from error
    if not ok:
        raise FenceError(f"{what} failed its checksum (torn or corrupted)")
    return body


T = TypeVar("T")


def read_optional(store: StoreClient, key: str, decode: Callable[[bytes], T]) -> T | None:
    """The record at ``key``, decoded; None where the generation has none (a record of one
    kind only: a delta table, an adapter record)."""
    try:
        return decode(store.get_bytes(key))
    except ObjectNotFound:
        return None


def decode_record(cls: Callable[..., T], body: dict[str, object], what: str) -> T:
    try:
        return cls(**body)
    except TypeError as error:
        raise FenceError(f"{what} has unexpected fields ({error})") from error


# -- incarnation -------------------------------------------------------------------------


@dataclass(frozen=True)
class Incarnation:
    """One lifetime of the master's state."""

    id: str
    created_at: str

    @classmethod
    def read(cls, store: StoreClient) -> Incarnation | None:
        try:
            body = unseal(store.get_bytes(INCARNATION_KEY), "Store incarnation record")
        except ObjectNotFound:
            return None
        return decode_record(cls, body, "Store incarnation record")

    @classmethod
    def ensure(cls, store: StoreClient) -> Incarnation:
        """The current incarnation; the first writer of a fresh master creates it."""
        found = cls.read(store)
        if found is not None:
            return found
        fresh = cls(uuid.uuid4().hex[:16], datetime.now(UTC).isoformat())
        with contextlib.suppress(ObjectAlreadyExists):
            store.create_exclusive(INCARNATION_KEY, seal(asdict(fresh)))
        created = cls.read(store)
        if created is None:
            raise StoreStateLost("the Store incarnation record vanished while being created")
        return created


def lost_state_hint(model: str, what: str) -> str:
    """The documented message when readers find the master without the state they expect."""
    return (
        f"{what}: the Store has lost its state for model {model!r} (mooncake_master restarted "
        "without persistence, so every generation it held is gone). Engines keep serving what "
        f"they hold. Way out: republish (`mooncake-rl publish --name {model} ...`, or the next "
        "trainer sync), then `mooncake-rl update`; see docs/generations.md#lost-master"
    )


# -- records -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lineage:
    """Where a generation's bytes come from: full (``base`` None), or a delta against
    ``base`` in a chain that starts at full ``keyframe``, ``chain_length`` deltas long
    (this one included) and ``chain_bytes`` heavy (:mod:`.chain`)."""

    generation: int
    base: int | None = None
    keyframe: int | None = None
    chain_length: int = 0
    chain_bytes: int = 0

    def __post_init__(self) -> None:
        full = self.base is None
        if full != (self.keyframe is None) or full != (self.chain_length == 0):
            raise FenceError(
                f"generation {self.generation}: a delta names base, keyframe and "
                "chain together, a full generation none of them"
            )
        if not full and not (
            1 <= self.keyframe <= self.base < self.generation  # type: ignore[operator]
            and self.chain_length >= 1
            and self.chain_bytes >= 0
        ):
            raise FenceError(f"generation {self.generation}: malformed delta lineage {self}")

    @property
    def is_delta(self) -> bool:
        return self.base is not None


@dataclass(frozen=True)
class ActiveRecord:
    """Active record number ``fence``: the generation engines must serve, and how to check it.

    ``layout_digest`` is computed once at announce, so every consumer's plan-cache lookup
    reads it instead of re-hashing the manifest. ``segments_digest``: the digest of the
    generation's segment map (``segments_key``: which segment holds each payload, the
    planner's locality hints); None in records written before it was recorded. ``newest``
    is the newest generation ever announced (the floor every later announce must exceed,
    whatever ``activate`` did); ``previous`` the generation this record replaced; ``at`` its
    wall-clock time.
    """

    model: str
    generation: int
    manifest_key: str
    manifest_digest: str
    layout_digest: str
    checksums_digest: str
    incarnation: str
    fence: int
    newest: int
    previous: int | None
    at: float
    tensors: int
    bytes: int
    created_at: str
    segments_digest: str | None = None
    base: int | None = None
    keyframe: int | None = None
    chain_length: int = 0
    chain_bytes: int = 0

    def __post_init__(self) -> None:
        self.lineage  # noqa: B018 (validates)
        if self.segments_digest is not None and not is_digest(self.segments_digest):
            raise FenceError(f"active record segments digest {self.segments_digest!r} is malformed")
        if not is_digest(self.manifest_digest):
            raise FenceError(f"active record manifest digest {self.manifest_digest!r} is malformed")
        if not is_digest(self.layout_digest):
            raise FenceError(f"active record layout digest {self.layout_digest!r} is malformed")
        if self.fence < 1 or self.newest < self.generation:
            raise FenceError(f"active record fence {self.fence} / newest {self.newest} invalid")

    def encode(self) -> bytes:
        return seal(asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> ActiveRecord:
        return decode_record(cls, unseal(data, "active-generation record"), "active record")

    @classmethod
    def replacing(
        cls,
        current: ActiveRecord | None,
        manifest: WeightManifest,
        checksums_digest: str,
        incarnation: str,
        newest: int,
        segments_digest: str | None = None,
        lineage: Lineage | None = None,
    ) -> ActiveRecord:
        """The record that follows ``current`` (fence + 1) and makes ``manifest`` active."""
        chain = lineage or Lineage(manifest.weight_generation)
        return cls(
            manifest.resource_id,
            manifest.weight_generation,
            manifest.manifest_key,
            manifest.manifest_digest,
            layout.layout_digest(manifest),
            checksums_digest,
            incarnation,
            current.fence + 1 if current else 1,
            newest,
            current.generation if current else None,
            time.time(),
            len(manifest.tensors),
            sum(f.nbytes for f in manifest.fragments),
            manifest.created_at,
            segments_digest,
            chain.base,
            chain.keyframe,
            chain.chain_length,
            chain.chain_bytes,
        )

    @property
    def lineage(self) -> Lineage:
        return Lineage(
            self.generation, self.base, self.keyframe, self.chain_length, self.chain_bytes
        )

    def info(self) -> GenerationInfo:
        return GenerationInfo(
            self.generation,
            self.tensors,
            self.bytes,
            self.manifest_digest,
            self.created_at,
            self.checksums_digest,
            base=self.base,
            keyframe=self.keyframe,
            chain_length=self.chain_length,
            chain_bytes=self.chain_bytes,
        )


@dataclass(frozen=True)
class GenerationInfo:
    """One announced generation as the index lists it; ``retired_at``: when it stopped
    being active (``None`` while active or never replaced), which GC's grace period uses."""

    generation: int
    tensors: int
    bytes: int
    digest: str
    created_at: str
    checksums_digest: str
    retired_at: float | None = None
    base: int | None = None
    keyframe: int | None = None
    chain_length: int = 0
    chain_bytes: int = 0

    @property
    def lineage(self) -> Lineage:
        return Lineage(
            self.generation, self.base, self.keyframe, self.chain_length, self.chain_bytes
        )


@dataclass(frozen=True)
class GenerationIndex:
    """Every announced generation the Store still holds, as of fence ``through_fence``;
    ``swept_through``: every unannounced number up to it left nothing behind (GC's mark)."""

    through_fence: int
    generations: tuple[GenerationInfo, ...]
    swept_through: int = 0

    def with_records(self, records: list[ActiveRecord]) -> GenerationIndex:
        """Fold fence records after ``through_fence`` in, in order (pure, idempotent)."""
        infos = {i.generation: i for i in self.generations}
        through = self.through_fence
        for record in sorted(records, key=lambda r: r.fence):
            if record.fence <= through:
                continue
            through = record.fence
            known = infos.get(record.generation)
            infos[record.generation] = replace(known or record.info(), retired_at=None)
            previous = infos.get(record.previous) if record.previous is not None else None
            if previous is not None and record.previous != record.generation:
                infos[previous.generation] = replace(previous, retired_at=record.at)
        ordered = tuple(sorted(infos.values(), key=lambda i: i.generation))
        return replace(self, through_fence=through, generations=ordered)

    def without(self, generations: set[int]) -> GenerationIndex:
        kept = tuple(i for i in self.generations if i.generation not in generations)
        return replace(self, generations=kept)

    def encode(self) -> bytes:
        body = asdict(self)
        body["generations"] = [asdict(info) for info in self.generations]
        return seal(body)

    @classmethod
    def decode(cls, data: bytes) -> GenerationIndex:
        body = unseal(data, "generation index")
        try:
            rows = tuple(GenerationInfo(**row) for row in body.pop("generations"))  # type: ignore[union-attr]
            return cls(generations=rows, **body)  # type: ignore[arg-type]
        except (KeyError, TypeError) as error:
            raise FenceError(f"generation index has unexpected fields ({error})") from error


@dataclass(frozen=True)
class Claim:
    """Who owns a generation number: one publish attempt, in one Store incarnation."""

    attempt: str
    incarnation: str
    claimed_at: str
    aborted_at: float | None = None
