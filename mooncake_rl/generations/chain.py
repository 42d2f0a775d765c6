"""Delta generations: what one stores, how its chain is read back, and when to keyframe.

    publisher: N-1's object bytes (kept), N's object bytes --delta_object--> one delta object
        (an entry per checksum block: :mod:`.delta`) + its :class:`ObjectDelta` row
    rank 0: every rank's rows --> :class:`DeltaTable` (base, keyframe, rows), sealed at
        ``deltas_key``; announce checks it against the manifest and the Store
    readers: keyframe's payload --apply each delta of the chain (:func:`object_bytes`)-->
        N's object bytes, checked against N's own checksum table

A delta generation has N's full manifest and checksum table, but no payload objects: its
bytes are its chain's. Engines that serve exactly the base take the entries in place; the
rest read N's objects once :func:`realize_generation` has rebuilt them from the chain
(idempotent; every rebuilt object is checked before it is put). Why per checksum block: an
engine reads only the entries of the blocks it lands, and each entry checks on its own.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash
from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import InvariantViolation, ObjectNotFound
from mooncake_rl.generations.checksums import ChecksumTable, block_spans
from mooncake_rl.generations.delta import (
    TensorDelta,
    apply_delta,
    decode_changes,
    diff,
    encode,
)
from mooncake_rl.generations.keys import delta_prefix, deltas_key, group_id, payload_prefix
from mooncake_rl.generations.packing import object_extents
from mooncake_rl.generations.records import (
    FenceError,
    GenerationInfo,
    decode_record,
    read_optional,
    seal,
    unseal,
)
from mooncake_rl.store import StoreClient

DEFAULT_DELTA_EVERY = 8
"""A keyframe at least every this many generations: a fallback reads at most 7 deltas."""
DEFAULT_DELTA_FRACTION = 0.5
"""A keyframe once the chain's deltas would weigh more than half a full generation."""


class CorruptDelta(InvariantViolation):
    """A delta entry whose bytes do not match its published hash, or do not decode."""


def entry_hash(data: bytes | memoryview | np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(data)


@dataclass(frozen=True)
class ObjectDelta:
    """One payload object of N as changes to the same object of the base: ``nbytes`` and
    ``cuts`` give its checksum blocks (:func:`.checksums.block_spans`), ``ends`` where each
    block's entry ends in the delta object, ``hashes`` each entry's XXH3-64."""

    nbytes: int
    ends: tuple[int, ...]
    hashes: tuple[str, ...]
    cuts: tuple[int, ...] = ()
    fresh: bool = False
    """The object is new in this generation (or resized): every entry holds its block
    whole and no base object is read."""

    def __post_init__(self) -> None:
        blocks = len(self.spans())
        if len(self.ends) != blocks or len(self.hashes) != blocks:
            raise InvariantViolation(
                f"a delta of an object of {self.nbytes} bytes needs {blocks} entries, has "
                f"{len(self.ends)} ends and {len(self.hashes)} hashes"
            )
        if any(b <= a for a, b in itertools.pairwise((0, *self.ends))):
            raise InvariantViolation(f"delta entry ends {self.ends} are not increasing")

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> ObjectDelta:
        return cls(
            int(row["nbytes"]),
            tuple(row["ends"]),
            tuple(row["hashes"]),
            tuple(row["cuts"]),
            bool(row["fresh"]),
        )

    def spans(self) -> list[tuple[int, int]]:
        """(start, end) of each block of the full object."""
        return list(block_spans(self.nbytes, self.cuts))

    def entries(self) -> list[tuple[int, int]]:
        """(start, end) of each block's entry in the delta object."""
        return list(itertools.pairwise((0, *self.ends)))

    @property
    def delta_bytes(self) -> int:
        return self.ends[-1]


@dataclass(frozen=True)
class DeltaTable:
    """What a delta generation stores: its ``base`` (the generation announced before it),
    the ``keyframe`` its chain starts from, and a row per payload object key of N."""

    base: int
    keyframe: int
    objects: Mapping[str, ObjectDelta] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.keyframe <= self.base:
            raise InvariantViolation(f"keyframe {self.keyframe} must be in 1..base {self.base}")

    @property
    def delta_bytes(self) -> int:
        return sum(row.delta_bytes for row in self.objects.values())

    def encode(self) -> bytes:
        rows = {k: asdict(r) for k, r in sorted(self.objects.items())}
        return seal({"base": self.base, "keyframe": self.keyframe, "objects": rows})

    @classmethod
    def decode(cls, data: bytes) -> DeltaTable:
        body = unseal(data, "delta table")
        try:
            rows = {
                k: ObjectDelta.from_json(r)
                for k, r in body.pop("objects").items()  # type: ignore[union-attr]
            }
        except (KeyError, TypeError) as error:
            raise FenceError(f"delta table has unexpected fields ({error})") from error
        return decode_record(cls, {**body, "objects": rows}, "delta table")


def delta_key(payload: str) -> str:
    """Where the delta object of payload key ``payload`` lives (same group, ``/delta/``)."""
    group, sep, name = payload.partition("/payload/")
    if not sep:
        raise InvariantViolation(f"{payload!r} is not a payload key")
    return delta_prefix(group) + name


def delta_object(
    base: np.ndarray | None, new: np.ndarray, itemsize: int, cuts: Sequence[int] = ()
) -> tuple[bytes, ObjectDelta]:
    """N's object ``new`` (bytes) as a delta object against ``base`` (N-1's same object, or
    None: the object is new, every entry holds its block whole), one entry per block."""
    new = np.ascontiguousarray(new).view(np.uint8).reshape(-1)
    spans = list(block_spans(len(new), cuts))
    if any((e - s) % itemsize for s, e in spans):
        itemsize = 1  # a block cut between elements: compare bytes
    words = np.dtype(f"u{itemsize}")
    if base is not None:
        base = np.ascontiguousarray(base).view(np.uint8).reshape(-1)
        if len(base) != len(new):
            base = None  # resized under the same name: nothing of it carries over
    parts: list[bytes] = []
    for start, end in spans:
        block = new[start:end].view(words)
        if base is None:
            delta = TensorDelta("whole", itemsize, len(block), len(block), b"", block.tobytes())
        else:
            delta = diff(base[start:end].view(words), block)
        parts.append(encode(delta))
    ends = tuple(itertools.accumulate(len(p) for p in parts))
    hashes = tuple(entry_hash(p) for p in parts)
    row = ObjectDelta(len(new), ends, hashes, tuple(cuts), base is None)
    return b"".join(parts), row


def apply_object(target: np.ndarray, data: bytes | memoryview, row: ObjectDelta, key: str) -> None:
    """Turn ``target`` (the base's bytes of ``key``, writable) into N's, entry after entry;
    every entry is checked against its hash first."""
    view = memoryview(data)
    if len(view) != row.delta_bytes or len(target) != row.nbytes:
        raise CorruptDelta(
            f"delta of {key}: {len(view)} bytes for a {row.delta_bytes}-byte delta of a "
            f"{row.nbytes}-byte object ({len(target)} in hand)"
        )
    for (start, end), (lo, hi), digest in zip(row.spans(), row.entries(), row.hashes, strict=True):
        where = f"{key} bytes {start}..{end}"
        delta, _ = checked_entry(view[lo:hi], digest, where)
        try:
            apply_delta(target[start:end].view(f"u{delta.itemsize}"), delta, where)
        except InvariantViolation as error:
            raise CorruptDelta(f"delta of {where}: {error}") from error


def checked_entry(
    entry: bytes | memoryview | np.ndarray, digest: str, where: str
) -> tuple[TensorDelta, np.ndarray]:
    """An entry's delta and changed positions, refused (:class:`CorruptDelta` naming
    ``where``) unless it matches its published hash and decodes."""
    if entry_hash(entry) != digest:
        raise CorruptDelta(
            f"delta of {where} does not match its published hash: the Store holds corrupted "
            "bytes; publish a keyframe, or `mooncake-rl activate` a generation `mooncake-rl "
            "verify` passes"
        )
    try:
        return decode_changes(entry, where)
    except InvariantViolation as error:
        raise CorruptDelta(f"delta of {where}: {error}") from error


@dataclass(frozen=True)
class Chain:
    """A delta generation's ancestry: ``full`` holds payloads (a keyframe, or a delta
    generation already realized), then each delta generation to apply, oldest first."""

    full: int
    deltas: tuple[tuple[int, DeltaTable], ...] = ()

    @property
    def generations(self) -> tuple[int, ...]:
        return (self.full, *(g for g, _ in self.deltas))


def delta_problems(store: StoreClient, manifest: WeightManifest, table: DeltaTable) -> list[str]:
    """What keeps a delta generation from being announced: its table must cover exactly the
    manifest's objects at their sizes, and the Store hold every delta object whole."""
    objects = object_extents(manifest, {k: r.nbytes for k, r in table.objects.items()})
    problems = [f"no delta for {key}" for key in objects if key not in table.objects]
    problems += [
        f"a delta for {key}, which the manifest lacks"
        for key in table.objects
        if key not in objects
    ]
    keys = sorted(set(objects) & set(table.objects))
    sizes = store.complete_sizes([delta_key(k) for k in keys])
    for key, size in zip(keys, sizes, strict=True):
        row = table.objects[key]
        if objects[key].nbytes != row.nbytes:
            problems.append(
                f"the delta of {key} is for {row.nbytes} bytes, the object has "
                f"{objects[key].nbytes}"
            )
        elif size is None:
            problems.append(f"missing {delta_key(key)}")
        elif size != row.delta_bytes:
            problems.append(f"{delta_key(key)} holds {size} bytes, expected {row.delta_bytes}")
    return problems


def load_delta_table(store: StoreClient, model: str, generation: int) -> DeltaTable | None:
    """The delta table of ``generation``, or None for a full one."""
    return read_optional(store, deltas_key(group_id(model, generation)), DeltaTable.decode)


def is_realized(store: StoreClient, table: DeltaTable) -> bool:
    """Every payload of the delta generation is in the Store at its full size."""
    keys = sorted(table.objects)
    if not all(store.exists(keys)):  # asked first: it answers absent keys without an error log
        return False
    sizes = store.complete_sizes(keys)
    return all(s == table.objects[k].nbytes for k, s in zip(keys, sizes, strict=True))


def chain_of(store: StoreClient, model: str, generation: int) -> Chain:
    """How to read ``generation``'s bytes: back through its bases to the nearest one whose
    payloads are all present (its keyframe at the latest)."""
    deltas: list[tuple[int, DeltaTable]] = []
    current = generation
    while (table := load_delta_table(store, model, current)) is not None:
        if is_realized(store, table):
            break
        deltas.append((current, table))
        if table.base < table.keyframe:
            raise FenceError(f"generation {current} of {model} has base below its keyframe")
        current = table.base
    return Chain(current, tuple(reversed(deltas)))


def object_bytes(store: StoreClient, model: str, chain: Chain, key: str) -> bytearray:
    """Payload ``key`` of the chain's last generation, rebuilt: the newest full ancestor's
    object (absent when the object appeared later), then every delta in turn. The caller
    checks the result against that generation's checksum table."""
    name = key.removeprefix(payload_prefix(group_id(model, chain.generations[-1])))
    rows = []
    for generation, table in chain.deltas:
        own = payload_prefix(group_id(model, generation)) + name
        if own not in table.objects:
            raise ObjectNotFound(0, "delta", f"generation {generation} has no object {name}")
        rows.append((own, table.objects[own]))
    start = max((i for i, (_, row) in enumerate(rows) if row.fresh), default=None)
    if start is None:  # the newest full ancestor's object is the base of every delta
        data = bytearray(store.get_bytes(payload_prefix(group_id(model, chain.full)) + name))
    else:  # new (or resized) there: nothing before it is read
        rows, data = rows[start:], bytearray(rows[start][1].nbytes)
    for own, row in rows:
        apply_object(np.frombuffer(data, np.uint8), store.get_bytes(delta_key(own)), row, own)
    return data


def object_reader(store: StoreClient, model: str, generation: int) -> Callable[[str], bytearray]:
    """Reads payload objects of ``generation`` by key: from the Store, or rebuilt from its
    chain while it is a delta generation not yet realized. Callers check what it returns."""
    chain = chain_of(store, model, generation)
    if not chain.deltas:
        return lambda key: bytearray(store.get_bytes(key))
    return functools.partial(object_bytes, store, model, chain)


def realize_generation(
    store: StoreClient, model: str, generation: int, checksums: ChecksumTable
) -> int:
    """Put every payload of delta ``generation`` rebuilt from its chain (checked against
    its ``checksums`` first), so full readers can read it; returns the bytes put (0 when
    it is full or was realized before). Two realizers racing put identical bytes."""
    chain = chain_of(store, model, generation)
    if not chain.deltas:
        return 0
    table = chain.deltas[-1][1]
    put = 0
    for key, present in zip(
        sorted(table.objects), store.exists(sorted(table.objects)), strict=True
    ):
        if present:
            continue  # put by an earlier or a racing realizer (a second put is ignored)
        data = object_bytes(store, model, chain, key)
        checksums.objects[key].check(key, data)
        store.put_tensor(key, torch.frombuffer(data, dtype=torch.uint8))  # racing twin: ignored
        put += len(data)
    return put


@dataclass(frozen=True)
class DeltaPolicy:
    """When a publisher sends a delta: ``every`` (a keyframe at least every ``every``
    generations; 1 never deltas) and ``max_fraction`` (a keyframe once the chain's deltas
    would exceed this fraction of a full generation's bytes)."""

    every: int = DEFAULT_DELTA_EVERY
    max_fraction: float = DEFAULT_DELTA_FRACTION

    def __post_init__(self) -> None:
        if type(self.every) is not int or self.every < 1:
            raise InvariantViolation(
                f"delta_every must be an integer >= 1 (1: every generation full), got "
                f"{self.every!r}; nothing published"
            )
        if not 0 < self.max_fraction <= 1:
            raise InvariantViolation(
                f"delta_max_fraction must be in (0, 1], got {self.max_fraction!r}; "
                "nothing published"
            )

    def base_for(self, newest: GenerationInfo | None) -> tuple[int, int] | None:
        """(base, keyframe) for the next generation, or None for a keyframe: every rank
        decides alike from the index entry of the newest announced generation."""
        if newest is None or self.every == 1:
            return None
        keyframe = newest.keyframe if newest.keyframe is not None else newest.generation
        length = newest.chain_length + 1
        if length >= self.every or newest.chain_bytes > self.max_fraction * newest.bytes:
            return None
        return newest.generation, keyframe
