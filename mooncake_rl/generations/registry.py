"""The model's active-generation record, the generation index, announce and readers.

Announce order is what makes a generation all-or-nothing: every payload is verified in the
Store, the manifest is written, the group's ``announced`` fence is created exclusively, and
only then is the active record replaced. A reader that follows the active record therefore
always finds a complete manifest and every payload it names.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import InvariantViolation, ObjectAlreadyExists, ObjectNotFound
from mooncake_rl.generations import layout
from mooncake_rl.generations.keys import (
    active_key,
    announced_key,
    check_model_name,
    group_id,
    index_key,
    manifest_key,
)
from mooncake_rl.generations.layout import is_digest
from mooncake_rl.store import StoreClient


class FenceError(InvariantViolation):
    """A stale or duplicate announce, or a record that does not match what it claims."""


def _sealed(body: dict[str, object]) -> bytes:
    """JSON with a checksum of its own content, so a torn or foreign record is detected."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({"body": body, "sha256": hashlib.sha256(text.encode()).hexdigest()}).encode()


def _unsealed(data: bytes, what: str) -> dict[str, object]:
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


@dataclass(frozen=True)
class ActiveRecord:
    """The model's active generation: where its manifest is and what it must hash to.

    ``layout_digest`` is the generation's layout digest (``generations.layout``), computed
    once by :meth:`GenerationRegistry.announce` so that every consumer's plan-cache lookup
    reads it instead of re-hashing the whole manifest; ``None`` in records written before
    it was recorded (consumers then compute it).
    """

    model: str
    generation: int
    manifest_key: str
    manifest_digest: str
    layout_digest: str | None = None

    def __post_init__(self) -> None:
        if not is_digest(self.manifest_digest):
            raise FenceError(f"active record manifest digest {self.manifest_digest!r} is malformed")
        if self.layout_digest is not None and not is_digest(self.layout_digest):
            raise FenceError(f"active record layout digest {self.layout_digest!r} is malformed")

    def encode(self) -> bytes:
        return _sealed(asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> ActiveRecord:
        body = _unsealed(data, "active-generation record")
        try:
            return cls(**body)  # type: ignore[arg-type]
        except TypeError as error:
            raise FenceError("active-generation record has unexpected fields") from error


@dataclass(frozen=True)
class GenerationInfo:
    generation: int
    tensors: int
    bytes: int
    digest: str
    created_at: str


def payload_problems(store: StoreClient, manifest: WeightManifest) -> list[str]:
    """Fragments not held whole: absent, not yet complete, or of another size than declared."""
    keys = [f.object_key for f in manifest.fragments]
    return [
        f"missing {f.object_key}"
        if size is None
        else f"{f.object_key} holds {size} bytes, expected {f.nbytes}"
        for f, size in zip(manifest.fragments, store.complete_sizes(keys), strict=True)
        if size != f.nbytes
    ]


class GenerationRegistry:
    """Reads and writes one model's generation records in the Store."""

    def __init__(self, store: StoreClient, model: str) -> None:
        self.store = store
        self.model = check_model_name(model)

    # -- readers -----------------------------------------------------------------------
    def active(self) -> ActiveRecord | None:
        try:
            data = self.store.get_bytes(active_key(self.model))
        except ObjectNotFound:
            return None
        record = ActiveRecord.decode(data)
        if record.model != self.model:
            raise FenceError(f"active record names model {record.model!r}, not {self.model!r}")
        return record

    def load_manifest(self, generation: int, expected_digest: str | None = None) -> WeightManifest:
        data = self.store.get_bytes(manifest_key(group_id(self.model, generation)))
        manifest = WeightManifest.from_json(data)
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

    def generations(self) -> list[GenerationInfo]:
        try:
            rows = _unsealed(self.store.get_bytes(index_key(self.model)), "generation index")
        except ObjectNotFound:
            return []
        return [GenerationInfo(**row) for row in rows["generations"]]  # type: ignore[union-attr]

    def next_generation(self) -> int:
        known = [g.generation for g in self.generations()]
        active = self.active()
        if active is not None:
            known.append(active.generation)
        return max(known, default=0) + 1

    # -- writers (the coordinator, rank 0) ---------------------------------------------
    def write_index(self, infos: list[GenerationInfo]) -> None:
        rows = [asdict(info) for info in sorted(infos, key=lambda i: i.generation)]
        self.store.upsert_bytes(index_key(self.model), _sealed({"generations": rows}))

    def announce(self, manifest: WeightManifest) -> ActiveRecord:
        """Make a fully written generation active; refuses stale, duplicate or partial ones."""
        generation = manifest.weight_generation
        if manifest.resource_id != self.model or manifest.group_id != group_id(
            self.model, generation
        ):
            raise FenceError("manifest does not belong to this model's key space")
        current = self.active()
        if current is not None and current.generation >= generation:
            raise FenceError(
                f"stale announce: generation {generation} is not newer than active "
                f"generation {current.generation}"
            )
        problems = payload_problems(self.store, manifest)
        if problems:
            raise InvariantViolation(
                f"cannot announce: {len(problems)} payload problem(s), first: {problems[0]}"
            )
        self.store.put_bytes(manifest.manifest_key, manifest.to_json().encode())
        try:
            self.store.create_exclusive(
                announced_key(manifest.group_id), manifest.manifest_digest.encode()
            )
        except ObjectAlreadyExists:
            raise FenceError(f"duplicate announce of generation {generation}") from None
        record = ActiveRecord(
            self.model,
            generation,
            manifest.manifest_key,
            manifest.manifest_digest,
            layout.layout_digest(manifest),
        )
        self.store.upsert_bytes(active_key(self.model), record.encode())
        info = GenerationInfo(
            generation,
            len(manifest.tensors),
            sum(f.nbytes for f in manifest.fragments),
            manifest.manifest_digest,
            manifest.created_at,
        )
        self.write_index([g for g in self.generations() if g.generation != generation] + [info])
        return record


def active_generation(store: StoreClient, model: str) -> ActiveRecord | None:
    """The model's active generation, or ``None`` if nothing was announced yet."""
    return GenerationRegistry(store, model).active()


def load_manifest(store: StoreClient, model: str, generation: int) -> WeightManifest:
    return GenerationRegistry(store, model).load_manifest(generation)
