"""Trainer side: every rank iterates the same tensors; the assigned rank puts each one.

Each put is one copy (``replica_num=1`` by default) preferring the publisher's own segment,
hard-pinned, with its content checksum computed from the staged bytes. A failed put never
stops the iteration (trainer ranks rebuild tensors collectively, so every rank must finish
the iterator); it is recorded, reported through the Store, and makes rank 0 abort the
generation instead of announcing it. Rank 0 claimed the generation number for this attempt
(:meth:`GenerationRegistry.claim_generation`), so everything under its group is the
attempt's own: an abort removes exactly that, and a retry claims a fresh number.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime

import numpy as np
import torch

from mooncake_rl.errors import (
    InvariantViolation,
    MooncakeError,
    MooncakeRLError,
    ObjectNotFound,
)
from mooncake_rl.generations import fp8
from mooncake_rl.generations.assignment import PublisherLoads, TrainerTopology
from mooncake_rl.generations.catalog import (
    TensorSpec,
    build_manifest,
    check_specs,
    publish_format,
    rollout_dtype,
    specs_digest,
)
from mooncake_rl.generations.chain import (
    Chain,
    DeltaPolicy,
    DeltaTable,
    ObjectDelta,
    chain_of,
    delta_key,
    delta_object,
    object_bytes,
)
from mooncake_rl.generations.checksums import ChecksumTable, ObjectChecksum
from mooncake_rl.generations.keys import (
    adapter_key,
    checksums_key,
    delta_prefix,
    deltas_key,
    group_id,
    manifest_key,
    payload_key,
    payload_prefix,
    report_key,
    report_prefix,
)
from mooncake_rl.generations.pack_order import (
    PackOrder,
    Piece,
    load_pack_order,
    rank_major,
    run_starts,
)
from mooncake_rl.generations.packing import (
    DEFAULT_PACK_BYTES,
    Packer,
    Placement,
    check_pack_bytes,
    is_packed,
)
from mooncake_rl.generations.registry import ActiveRecord, FenceError, GenerationRegistry
from mooncake_rl.store import StoreClient

logger = logging.getLogger(__name__)

DEFAULT_KEEP = 2
"""Generations retention keeps after each announce, besides the active and leased ones."""


class PublishFailed(InvariantViolation):
    """The generation was not announced; the previous one stays active."""


@dataclass(frozen=True)
class PublishReport:
    """What one rank did for one generation; rank 0 reads every rank's report."""

    rank: int
    generation: int
    specs_digest: str
    tensors: int
    put_tensors: int
    put_bytes: int
    failures: tuple[tuple[str, str], ...] = ()
    nonlocal_put_bytes: int = 0
    checksums: tuple[tuple[str, ObjectChecksum], ...] = ()
    placements: tuple[tuple[str, str, int, tuple[int, int] | None], ...] = ()
    """Packed tensors: (tensor name, pack object name, offset, rows or ``None``: whole)."""
    deltas: tuple[tuple[str, ObjectDelta], ...] = ()
    """A delta generation: each payload key this rank wrote a delta object for, its row."""

    @property
    def ok(self) -> bool:
        return not self.failures

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> PublishReport:
        raw = json.loads(data)
        raw["failures"] = tuple(tuple(f) for f in raw["failures"])
        raw["placements"] = tuple(
            (n, o, offset, tuple(rows) if rows else None)
            for n, o, offset, rows in raw.get("placements", ())
        )
        raw["checksums"] = tuple(
            (key, ObjectChecksum(c["nbytes"], c["whole"], tuple(c["blocks"]), tuple(c["cuts"])))
            for key, c in raw["checksums"]
        )
        raw["deltas"] = tuple(
            (key, ObjectDelta.from_json(row)) for key, row in raw.get("deltas", ())
        )
        return cls(**raw)


@dataclass
class LastPublished:
    """One rank's host copy of the objects it published for ``generation``: the base its
    next delta is computed from (a rank without it reads the base back from the Store).
    Costs this rank's share of the model in host memory; each base object is dropped once
    its delta is computed, so a publish holds about one share, not two."""

    generation: int = 0
    objects: dict[str, np.ndarray] = field(default_factory=dict)
    _next: dict[str, np.ndarray] = field(default_factory=dict, init=False)
    _next_generation: int = field(default=0, init=False)

    def base(self, generation: int, name: str) -> np.ndarray | None:
        """The object ``name`` as published in ``generation``, if this copy holds it."""
        return self.objects.pop(name, None) if self.generation == generation else None

    def keep(self, generation: int, name: str, data: np.ndarray) -> None:
        if self._next_generation != generation:
            self._next, self._next_generation = {}, generation
        self._next[name] = data.copy()

    def settle(self, generation: int) -> None:
        """This rank wrote every object of ``generation``: it is the next base."""
        if self._next_generation == generation:
            self.generation, self.objects = generation, self._next
            self._next, self._next_generation = {}, 0


@dataclass
class GenerationPublisher:
    """One trainer rank's view of publishing generation ``generation`` of ``model``."""

    store: StoreClient
    model: str
    generation: int
    rank: int
    topology: TrainerTopology
    dtype: str = "bfloat16"
    """A rollout format of ``PUBLISH_FORMATS``; ``fp8_e4m3`` block-quantizes (see fp8.py)."""
    replica_num: int = 1
    check_locality: bool = False
    attempt: str | None = None
    """Rank 0: the attempt id its claim of ``generation`` names (what finalize checks)."""
    pack_bytes: int = DEFAULT_PACK_BYTES
    """Size of the packs small tensors share (:mod:`.packing`)."""
    delta_base: tuple[int, int] | None = None
    """(base, keyframe): publish a delta against announced ``base`` (:mod:`.chain`); every
    rank of one generation gets the same (:func:`delta_base`)."""
    kept: LastPublished | None = None
    """This rank's copy of what it last published; refreshed as it writes."""
    _deltas: dict[str, ObjectDelta] = field(default_factory=dict, init=False)
    _base_chain: Chain | None = field(default=None, init=False)
    _specs: list[TensorSpec] = field(default_factory=list, init=False)
    _put_names: list[str] = field(default_factory=list, init=False)
    _checksums: dict[str, ObjectChecksum] = field(default_factory=dict, init=False)
    _put_bytes: int = field(default=0, init=False)
    _nonlocal_bytes: int = field(default=0, init=False)
    _placements: dict[str, list[Placement]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        publish_format(self.dtype)
        check_pack_bytes(self.pack_bytes)
        self.group = group_id(self.model, self.generation)
        if not 0 <= self.rank < self.topology.world_size:
            raise InvariantViolation(
                f"rank {self.rank} outside world size {self.topology.world_size}"
            )
        if self.replica_num < 1:
            raise InvariantViolation("replica_num must be at least 1")

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport:
        """Consume the whole iterator; put this rank's share; write this rank's report.

        A tensor may store as several objects (fp8: the weight and its block scales); one
        rank puts all of them, so it quantizes once. Small ones go into packs.
        """
        loads = PublisherLoads(self.topology)
        failures: list[tuple[str, str]] = []
        seen: set[str] = set()
        packs = _Packs(
            self, Packer(self.rank, self.pack_bytes), load_pack_order(self.store, self.model)
        )
        try:
            for name, tensor in named_tensors:
                try:
                    specs = TensorSpec.stored(name, tensor, self.dtype)
                except InvariantViolation as error:
                    failures.append((name, str(error)))
                    continue
                clash = next((s.name for s in specs if s.name in seen), None)
                if clash is not None:
                    failures.append((name, f"duplicate tensor name {clash!r}"))
                    continue
                seen.update(s.name for s in specs)
                self._specs.extend(specs)
                publisher, loads = loads.assign(sum(s.nbytes for s in specs))
                if publisher != self.rank or failures:
                    continue  # not ours, or this generation is already lost: keep iterating
                try:
                    for spec, staged in zip(specs, self._stage(name, tensor, specs), strict=True):
                        if is_packed(spec.nbytes, self.pack_bytes):
                            packs.add(spec, staged)
                            continue
                        key = payload_key(self.group, spec.name)
                        self._checksums[key] = ObjectChecksum.of(staged)
                        written = self._delta(spec.name, staged, spec.itemsize)
                        if written is None:
                            self._put(spec.name, staged)
                        self._stored(spec.name, written or spec.nbytes)
                except (MooncakeError, InvariantViolation) as error:
                    # a failed put, rank 0 already swept the group, or weights fp8 cannot hold
                    failures.append((packs.failed_tensor or name, str(error)))
            if not failures:
                try:
                    packs.put_open()
                except MooncakeError as error:
                    failures.append((packs.failed_tensor, str(error)))
        finally:
            packs.close()
        if not self._specs and not failures:
            failures.append(("", "a generation needs at least one tensor (empty model)"))
        report = PublishReport(
            checksums=tuple(self._checksums.items()),
            rank=self.rank,
            generation=self.generation,
            specs_digest=specs_digest(self._specs),
            tensors=len(self._specs),
            put_tensors=len(self._put_names),
            put_bytes=self._put_bytes,
            failures=tuple(failures),
            nonlocal_put_bytes=self._nonlocal_bytes,
            placements=tuple(
                (name, p.object_name, p.offset, p.rows)
                for name, placed in self._placements.items()
                for p in sorted(placed, key=lambda p: p.rows or (0, 0))
            ),
            deltas=tuple(sorted(self._deltas.items())),
        )
        if self.kept is not None and not failures:
            self.kept.settle(self.generation)
        self.store.put_bytes(report_key(self.group, self.rank), report.encode())
        if self.aborted():
            # Rank 0 gave up on this rank before these puts finished: nobody else removes them.
            self.remove_own()
            report = replace(report, failures=(*report.failures, ("", "generation aborted")))
        return report

    def _preferred_segments(self) -> list[str]:
        return [self.store.local_segment] if self.store.local_segment else []

    def _stored(self, name: str, nbytes: int) -> None:
        """Object ``name`` (or its delta, ``nbytes`` of it) is in the Store: count it (and
        where it landed, when asked)."""
        self._put_names.append(name)
        self._put_bytes += nbytes
        if self.check_locality:
            where = self.store.replica_segments(self._written_key(name))
            self._nonlocal_bytes += 0 if where == (self.store.local_segment,) else nbytes

    def _written_key(self, name: str) -> str:
        key = payload_key(self.group, name)
        return key if self.delta_base is None else delta_key(key)

    def _delta(
        self, name: str, data: torch.Tensor, itemsize: int, cuts: tuple[int, ...] = ()
    ) -> int | None:
        """Keep object ``name``'s bytes for the next delta; in a delta generation, put its
        delta object instead of it and return the bytes put (None: put the object)."""
        array = data.view(torch.uint8).numpy()
        if self.kept is not None:
            self.kept.keep(self.generation, name, array)
        if self.delta_base is None:
            return None
        key = payload_key(self.group, name)
        blob, row = delta_object(self._base_object(name), array, itemsize, cuts)
        self.store.put_tensor(
            delta_key(key),
            torch.frombuffer(bytearray(blob), dtype=torch.uint8),
            replica_num=self.replica_num,
            preferred_segments=self._preferred_segments(),
            hard_pin=True,
        )
        self._deltas[key] = row
        return len(blob)

    def _base_object(self, name: str) -> np.ndarray | None:
        """The base's bytes of object ``name``: this rank's copy, else read back from the
        Store through the base's chain; None when the base has no such object."""
        assert self.delta_base is not None
        base = self.delta_base[0]
        if self.kept is not None and (kept := self.kept.base(base, name)) is not None:
            return kept
        if self._base_chain is None:
            self._base_chain = chain_of(self.store, self.model, base)
        try:
            data = object_bytes(
                self.store,
                self.model,
                self._base_chain,
                payload_key(group_id(self.model, base), name),
            )
        except ObjectNotFound:
            return None
        return np.frombuffer(data, np.uint8)

    def aborted(self) -> bool:
        """Rank 0 tombstoned this attempt's claim (or the claim is gone)."""
        claim = GenerationRegistry(self.store, self.model).claim(self.generation)
        return claim is None or claim.aborted_at is not None

    def remove_own(self) -> None:
        """Remove every object this rank wrote for the attempt (its puts and its report)."""
        mine = [self._written_key(n) for n in self._put_names]
        self.store.remove([*mine, report_key(self.group, self.rank)], force=True)

    @staticmethod
    def _stage(
        name: str, tensor: torch.Tensor, specs: tuple[TensorSpec, ...]
    ) -> tuple[torch.Tensor, ...]:
        """``tensor`` in its stored forms (``specs``: one cast, or fp8 weight and scales),
        computed on the tensor's own device, as contiguous host tensors."""
        source = tensor.detach()
        if len(specs) == 2:
            forms: tuple[torch.Tensor, ...] = fp8.block_quantize(name, source)
        else:
            forms = (source.to(rollout_dtype(specs[0].dtype)),)
        return tuple(form.contiguous().cpu().reshape(-1) for form in forms)

    def _put(self, name: str, staged: torch.Tensor) -> None:
        self.store.put_tensor(
            payload_key(self.group, name),
            staged,
            replica_num=self.replica_num,
            preferred_segments=self._preferred_segments(),
            hard_pin=True,
        )

    @property
    def specs(self) -> list[TensorSpec]:
        return list(self._specs)


class _Packs:
    """The publisher's open packs: one registered host buffer per dtype, reused pack after
    pack (a put is synchronous), registered once per publish, not once per tensor.

    A pack fills tensor after tensor; with a pack order (:mod:`.pack_order`) it is put in
    its rank-major form, copied once into a second registered buffer."""

    def __init__(
        self, publisher: GenerationPublisher, packer: Packer, order: PackOrder | None
    ) -> None:
        self.publisher, self.packer, self.order = publisher, packer, order
        self.buffers: dict[str, torch.Tensor] = {}
        self.rank_major: dict[str, torch.Tensor] = {}
        self.contents: dict[str, list[tuple[TensorSpec, int]]] = {}  # pack -> (spec, offset)
        self.failed_tensor = ""
        """The first tensor of a pack whose put failed: what the failure names."""

    def add(self, spec: TensorSpec, staged: torch.Tensor) -> None:
        placement, full = self.packer.place(spec.nbytes, spec.dtype)
        if full is not None:
            self._put(*full, spec.dtype)
        end = placement.offset + spec.nbytes
        self._buffer(self.buffers, spec.dtype)[placement.offset : end].copy_(
            staged.view(torch.uint8)
        )
        self.contents.setdefault(placement.object_name, []).append((spec, placement.offset))

    def put_open(self) -> None:
        for name, size, dtype in self.packer.open_packs():
            self._put(name, size, dtype)

    def _buffer(self, buffers: dict[str, torch.Tensor], dtype: str) -> torch.Tensor:
        buffer = buffers.get(dtype)
        if buffer is None:
            buffer = torch.empty(self.packer.pack_bytes, dtype=torch.uint8)
            buffers[dtype] = buffer
            self.publisher.store.register(buffer.data_ptr(), buffer.numel())
        return buffer

    def _laid_out(self, name: str, size: int, dtype: str) -> tuple[torch.Tensor, list[Piece]]:
        """The pack's bytes as they are put, and where each tensor (or its rows) sits."""
        contents = self.contents[name]
        filled = self.buffers[dtype][:size]
        if self.order is None:
            return filled, [Piece(s.name, None, o, o, s.nbytes) for s, o in contents]
        rows = [(s.name, s.shape, o, s.nbytes) for s, o in contents]
        pieces = rank_major(rows, self.order)
        if all(p.source == p.target for p in pieces):
            return filled, pieces
        data = self._buffer(self.rank_major, dtype)[:size]
        for p in pieces:
            data[p.target : p.target + p.nbytes].copy_(filled[p.source : p.source + p.nbytes])
        return data, pieces

    def _put(self, name: str, size: int, dtype: str) -> None:
        data, pieces = self._laid_out(name, size, dtype)
        publisher = self.publisher
        # Blocks also cut where a rank's run starts: each rank checks all it reads.
        checksum = ObjectChecksum.of(data, run_starts(pieces))
        publisher._checksums[payload_key(publisher.group, name)] = checksum
        try:
            written = publisher._delta(name, data, rollout_dtype(dtype).itemsize, checksum.cuts)
            if written is None:
                publisher.store.put_from(
                    payload_key(publisher.group, name),
                    data.data_ptr(),
                    size,
                    replica_num=publisher.replica_num,
                    preferred_segments=publisher._preferred_segments(),
                    hard_pin=True,
                )
        except MooncakeError as error:
            self.failed_tensor = self.contents[name][0][0].name
            count = len(self.contents[name])
            raise type(error)(
                error.code, error.operation, f"{error.context}, a pack of {count} tensors"
            ) from error
        for piece in pieces:
            placement = Placement(name, piece.target, piece.rows)
            key = payload_key(publisher.group, placement.fragment_id(piece.tensor))
            bytes_ = data[piece.target : piece.target + piece.nbytes]
            publisher._checksums[key] = ObjectChecksum.of(bytes_)
            publisher._placements.setdefault(piece.tensor, []).append(placement)
        publisher._stored(name, written or size)
        del self.contents[name]

    def close(self) -> None:
        for buffer in (*self.buffers.values(), *self.rank_major.values()):
            self.publisher.store.unregister(buffer.data_ptr())
        self.buffers.clear()
        self.rank_major.clear()


def _wait_reports(
    store: StoreClient, group: str, world_size: int, timeout_s: float
) -> list[PublishReport | None]:
    deadline = time.monotonic() + timeout_s
    reports: list[PublishReport | None] = [None] * world_size
    while True:
        for rank in range(world_size):
            if reports[rank] is None:
                with contextlib.suppress(ObjectNotFound):
                    reports[rank] = PublishReport.decode(store.get_bytes(report_key(group, rank)))
        if all(reports) or time.monotonic() >= deadline:
            return reports
        time.sleep(0.05)


def abort_generation(store: StoreClient, model: str, generation: int, attempt: str) -> None:
    """Remove every object attempt ``attempt`` wrote for ``generation`` (forced: nobody reads
    it), after tombstoning its claim; refuses unless the attempt owns the number and the
    generation was never announced. The claim itself stays, so the number is never reused.

    The tombstone goes first: a publisher still putting when the sweep runs either finished
    its puts before it (the sweep removes them) or sees it and removes its own.
    """
    registry = GenerationRegistry(store, model)
    registry.mark_aborted(generation, attempt)
    if registry.is_announced(generation):
        raise FenceError(f"generation {generation} of {model} was announced: it is not removed")
    group = group_id(model, generation)
    store.remove_prefix(payload_prefix(group), force=True)
    store.remove_prefix(delta_prefix(group), force=True)
    store.remove_prefix(report_prefix(group), force=True)
    records = [manifest_key(group), checksums_key(group), deltas_key(group), adapter_key(group)]
    store.remove(records, force=True)


def finalize_generation(
    publisher: GenerationPublisher,
    report: PublishReport,
    *,
    timeout_s: float = 60.0,
    now: datetime | None = None,
    keep: int | None = DEFAULT_KEEP,
) -> ActiveRecord:
    """Rank 0: wait for every rank's report, then announce (and apply retention), or abort
    and raise. ``keep=None`` skips retention (the caller runs GC itself)."""
    if publisher.rank != 0 or publisher.attempt is None:
        raise InvariantViolation("only rank 0, with the attempt id of its claim, finalizes")
    store, model, generation = publisher.store, publisher.model, publisher.generation
    world = publisher.topology.world_size
    reports = _wait_reports(store, publisher.group, world, timeout_s)
    problems: list[str] = []
    checksums = ChecksumTable()
    deltas: dict[str, ObjectDelta] = {}
    placements: dict[str, list[Placement]] = {}
    for rank, other in enumerate(reports):
        if other is None:
            problems.append(f"rank {rank} did not report within {timeout_s}s")
        elif other.specs_digest != report.specs_digest:
            problems.append(f"rank {rank} iterated a different tensor set than rank 0")
        else:
            problems.extend(f"rank {rank}: tensor {n!r}: {e}" for n, e in other.failures)
            checksums = checksums.merged(dict(other.checksums))
            deltas.update(other.deltas)
            for name, obj, offset, rows in other.placements:
                placements.setdefault(name, []).append(Placement(obj, offset, rows))
    if not problems:
        try:
            check_specs(publisher.specs)
            created = (now or datetime.now(UTC)).isoformat()
            manifest = build_manifest(model, generation, publisher.specs, created, placements)
            registry = GenerationRegistry(store, model)
            table = None
            if publisher.delta_base is not None:
                table = DeltaTable(*publisher.delta_base, deltas)
            record = registry.announce(manifest, checksums, publisher.attempt, table)
        except InvariantViolation as error:
            problems.append(str(error))
        else:
            store.remove([report_key(publisher.group, rank) for rank in range(world)], force=True)
            if keep is not None:
                apply_retention(store, model, keep)
            return record
    abort_generation(store, model, generation, publisher.attempt)
    raise PublishFailed(f"generation {generation} of {model} not announced: " + "; ".join(problems))


def apply_retention(store: StoreClient, model: str, keep: int) -> None:
    """Collect old generations after an announce; a failure leaves them for the next one."""
    from mooncake_rl.generations.gc import collect_garbage

    try:
        report = collect_garbage(store, model, keep)
    except MooncakeRLError as error:
        logger.warning("retention for %s failed, retried after the next announce: %s", model, error)
        return
    if report.failures:
        logger.warning("retention for %s left %d object(s)", model, len(report.failures))


def delta_base(
    store: StoreClient, model: str, policy: DeltaPolicy | None
) -> tuple[int, int] | None:
    """(base, keyframe) for the next generation under ``policy``, or None (a keyframe): the
    newest announced generation is the only base an announce accepts."""
    if policy is None:
        return None
    registry = GenerationRegistry(store, model)
    active = registry.active()
    if active is None:
        return None
    newest = next((i for i in registry.generations() if i.generation == active.newest), None)
    base = policy.base_for(newest)
    if base is not None and (lost := registry.unreadable(base[0])):
        # A delta of a chain nobody can read would be unreadable too: start a new chain.
        logger.warning(
            "generation %s of %s cannot be read whole (%s): publishing a keyframe",
            base[0],
            model,
            lost[0],
        )
        return None
    return base


def start_attempt(store: StoreClient, model: str) -> tuple[int, str]:
    """A fresh attempt id and the generation number it claimed; refused before anything is
    written while a durable Store's etcd is out of space (no announce could follow)."""
    store.require_log_space(f"publishing a generation of {model}")
    attempt = uuid.uuid4().hex
    return GenerationRegistry(store, model).claim_generation(attempt), attempt


def publish_local(
    store: StoreClient,
    model: str,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: str = "bfloat16",
    node: str | None = None,
    replica_num: int = 1,
    keep: int | None = DEFAULT_KEEP,
    pack_bytes: int = DEFAULT_PACK_BYTES,
    delta: DeltaPolicy | None = None,
    kept: LastPublished | None = None,
) -> ActiveRecord:
    """World size 1: claim, publish and announce the next generation from one process;
    with ``delta``, as a delta against the newest announced generation when the policy
    says so (``kept``: this process's copy of what it last published, reused across
    calls; without it the base is read back from the Store)."""
    if keep is not None and (type(keep) is not int or keep < 1):
        raise InvariantViolation(f"keep must be an integer >= 1, got {keep!r}; nothing published")
    check_pack_bytes(pack_bytes)
    base = delta_base(store, model, delta)
    generation, attempt = start_attempt(store, model)
    publisher = GenerationPublisher(
        store,
        model,
        generation,
        0,
        TrainerTopology.single(node or store.settings.node),
        dtype,
        replica_num=replica_num,
        attempt=attempt,
        pack_bytes=pack_bytes,
        delta_base=base,
        kept=kept,
    )
    return finalize_generation(publisher, publisher.publish(named_tensors), keep=keep)
