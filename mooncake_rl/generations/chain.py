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

from mooncake_rl.errors import InvariantViolation, MooncakeRLError, ObjectNotFound
from mooncake_rl.generations.checksums import ChecksumTable, block_spans
from mooncake_rl.generations.delta import (
    WORDS,
    TensorDelta,
    apply_delta,
    changed_positions,
    decode_changes,
    diff,
    encode,
    entry_holds,
)
from mooncake_rl.generations.keys import (
    delta_prefix,
    deltas_key,
    group_id,
    manifest_key,
    payload_prefix,
)
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
    """A delta entry whose bytes do not match its published hash, do not decode, or write
    other than its block or what the delta table declares."""


REPUBLISH = (
    "the publisher wrote a malformed delta: publish a keyframe (a full generation), or "
    "`mooncake-rl activate` a generation `mooncake-rl verify` passes"
)


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
    itemsize: int = 0
    """The entries' element size in bytes; 0 in a table from before extents were kept."""
    extents: tuple[tuple[int, int], ...] = ()
    """Per block, what its entry writes: (elements, position of the last one; -1: none),
    in ``itemsize``-byte elements, a whole entry writing its block. Lets an announce refuse
    an entry that would write outside its block without reading it (:meth:`problems`);
    empty where unknown (an older table: its entries are checked at load only)."""

    def __post_init__(self) -> None:
        blocks = len(self.spans())
        if len(self.ends) != blocks or len(self.hashes) != blocks:
            raise InvariantViolation(
                f"a delta of an object of {self.nbytes} bytes needs {blocks} entries, has "
                f"{len(self.ends)} ends and {len(self.hashes)} hashes"
            )
        if any(b <= a for a, b in itertools.pairwise((0, *self.ends))):
            raise InvariantViolation(f"delta entry ends {self.ends} are not increasing")
        if self.itemsize == 0 and not self.extents:
            return
        if self.itemsize not in WORDS or len(self.extents) != blocks:
            raise InvariantViolation(
                f"a delta of {blocks} blocks in {self.itemsize}-byte elements declares "
                f"{len(self.extents)} extents"
            )
        if any(count < 0 or last < -1 for count, last in self.extents):
            raise InvariantViolation(f"delta extents {self.extents} are negative")

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> ObjectDelta:
        return cls(
            int(row["nbytes"]),
            tuple(row["ends"]),
            tuple(row["hashes"]),
            tuple(row["cuts"]),
            bool(row["fresh"]),
            int(row.get("itemsize", 0)),
            tuple((int(count), int(last)) for count, last in row.get("extents", ())),
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

    def problems(self) -> list[tuple[int, str]]:
        """(block, why) for each block whose declared extent falls outside it, or that its
        entry's size cannot hold in any encoding: what an announce refuses unread."""
        if not self.extents:
            return []
        spans = np.array(self.spans(), np.int64)
        lengths = spans[:, 1] - spans[:, 0]
        sizes = np.diff(np.array(self.ends, np.int64), prepend=0)
        count, last = np.array(self.extents, np.int64).T
        numel = lengths // self.itemsize
        ragged = lengths % self.itemsize != 0
        outside = last >= numel
        uneven = (count > last + 1) | ((count == 0) != (last == -1))
        unfit = ~entry_holds(sizes, numel, count, self.itemsize)
        found = []
        for block in np.flatnonzero(ragged | outside | uneven | unfit).tolist():
            n, at, elements = int(count[block]), int(last[block]), int(numel[block])
            if ragged[block]:
                why = f"is not whole {self.itemsize}-byte elements"
            elif outside[block]:
                why = f"declares a change at element {at}, outside its {elements} elements"
            elif uneven[block]:
                why = f"declares {n} changed elements up to element {at}"
            else:
                why = (
                    f"has an entry of {int(sizes[block])} bytes, which no encoding fills with "
                    f"{n} of its {elements} {self.itemsize}-byte elements"
                )
            found.append((block, why))
        return found


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
        except (KeyError, TypeError, ValueError) as error:
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
    extents: list[tuple[int, int]] = []
    for start, end in spans:
        block = new[start:end].view(words)
        if base is None:
            delta = TensorDelta("whole", itemsize, len(block), len(block), b"", block.tobytes())
        else:
            delta = diff(base[start:end].view(words), block)
        parts.append(encode(delta))
        extents.append(entry_extent(delta))
    ends = tuple(itertools.accumulate(len(p) for p in parts))
    hashes = tuple(entry_hash(p) for p in parts)
    row = ObjectDelta(len(new), ends, hashes, tuple(cuts), base is None, itemsize, tuple(extents))
    return b"".join(parts), row


def entry_extent(delta: TensorDelta) -> tuple[int, int]:
    """(elements an entry writes, the last one's position; -1: none): its declared extent."""
    if delta.encoding == "whole":
        return delta.numel, delta.numel - 1
    positions = changed_positions(delta)
    return len(positions), int(positions[-1]) if len(positions) else -1


Tensors = Callable[[int, int], Sequence[str]]
"""The tensors whose bytes lie in bytes start..end of an object: what a refusal names."""


def apply_object(
    target: np.ndarray,
    data: bytes | memoryview,
    row: ObjectDelta,
    key: str,
    tensors: Tensors | None = None,
) -> None:
    """Turn ``target`` (the base's bytes of ``key``, writable) into N's, entry after entry;
    every entry is checked (:func:`checked_entry`) first."""
    view = memoryview(data)
    if len(view) != row.delta_bytes or len(target) != row.nbytes:
        raise CorruptDelta(
            f"delta of {key}: {len(view)} bytes for a {row.delta_bytes}-byte delta of a "
            f"{row.nbytes}-byte object ({len(target)} in hand)"
        )
    for block, ((start, end), (lo, hi)) in enumerate(zip(row.spans(), row.entries(), strict=True)):
        delta, _ = checked_entry(view[lo:hi], key, row, block, (start, end), tensors)
        where = f"{key} bytes {start}..{end}"
        apply_delta(target[start:end].view(f"u{delta.itemsize}"), delta, where)


def checked_entry(
    entry: bytes | memoryview | np.ndarray,
    key: str,
    row: ObjectDelta,
    block: int,
    span: tuple[int, int],
    tensors: Tensors | None = None,
) -> tuple[TensorDelta, np.ndarray]:
    """Block ``block`` (bytes ``span``) of ``key``'s delta: its entry's delta and changed
    positions, refused (:class:`CorruptDelta` naming the object, the block and, given
    ``tensors``, what it holds) unless it matches its published hash, decodes, covers
    exactly its block and writes what the table declares. A few scalar checks: it runs
    for every entry an engine lands."""
    start, end = span

    def refused(cause: str, lo: int = start, hi: int = end) -> CorruptDelta:
        held = tensors(lo, hi) if tensors is not None else ()  # bytes lo..hi's tensors
        return CorruptDelta(
            f"delta of {key} bytes {start}..{end}{f' ({named(held)})' if held else ''}{cause}"
        )

    if entry_hash(entry) != row.hashes[block]:
        raise refused(
            " does not match its published hash: the Store holds corrupted bytes; publish a "
            "keyframe, or `mooncake-rl activate` a generation `mooncake-rl verify` passes"
        )
    try:
        delta, positions = decode_changes(entry, f"{key} bytes {start}..{end}")
    except InvariantViolation as error:
        raise refused(f": {error}; {REPUBLISH}") from error
    if delta.numel * delta.itemsize != end - start:
        raise refused(
            f": its entry covers {delta.numel} elements of {delta.itemsize} bytes, not the "
            f"block's {end - start} bytes; {REPUBLISH}"
        )
    if row.extents:
        count, last = len(positions), int(positions[-1]) if len(positions) else -1
        if (delta.itemsize, count, last) != (row.itemsize, *row.extents[block]):
            declared, up_to = row.extents[block]
            at = start + max(last, 0) * delta.itemsize  # names the last written element's tensor
            raise refused(
                f": its entry writes {count} {delta.itemsize}-byte elements up to element "
                f"{last}, the delta table declares {declared} {row.itemsize}-byte elements up "
                f"to element {up_to}; {REPUBLISH}",
                at,
                at + delta.itemsize,
            )
    return delta, positions


def named(tensors: Sequence[str]) -> str:
    """A refusal's list of tensors: the first three, and how many more."""
    if not tensors:
        return "no tensor"
    shown = ", ".join(tensors[:3]) + (f" and {len(tensors) - 3} more" if len(tensors) > 3 else "")
    return f"tensor{'s' if len(tensors) > 1 else ''} {shown}"


def block_tensors(pieces: Sequence[tuple[str, str, int, int]], key: str) -> Tensors:
    """:data:`Tensors` of object ``key`` from (tensor, object key, offset, bytes) pieces: a
    manifest's fragments, or a worker's delta reads. Looked up only when a refusal asks."""

    def tensors(start: int, end: int) -> Sequence[str]:
        return sorted({t for t, k, lo, n in pieces if k == key and lo < end and start < lo + n})

    return tensors


def manifest_tensors(manifest: WeightManifest, key: str) -> Tensors:
    """:data:`Tensors` of object ``key`` by the manifest's fragments."""
    pieces = [(f.tensor_id, f.object_key, f.object_offset, f.nbytes) for f in manifest.fragments]
    return block_tensors(pieces, key)


def stored_tensors(store: StoreClient, model: str, generation: int, key: str) -> Tensors:
    """:data:`Tensors` of ``key`` by ``generation``'s manifest, read only when a refusal
    names them; an unreadable manifest names none (the refusal stands without names)."""

    def tensors(start: int, end: int) -> Sequence[str]:
        try:
            data = store.get_bytes(manifest_key(group_id(model, generation)))
            return manifest_tensors(WeightManifest.from_json(data), key)(start, end)
        except (MooncakeRLError, ValueError):
            return ()

    return tensors


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
    manifest's objects at their sizes, declare no change outside a block
    (:meth:`ObjectDelta.problems`: the entries themselves are read at load only), and the
    Store hold every delta object whole."""
    objects = object_extents(manifest, {k: r.nbytes for k, r in table.objects.items()})
    problems = [f"no delta for {key}" for key in objects if key not in table.objects]
    problems += [
        f"a delta for {key}, which the manifest lacks"
        for key in table.objects
        if key not in objects
    ]
    keys = sorted(set(objects) & set(table.objects))
    sizes = store.complete_sizes([delta_key(k) for k in keys])
    outside: list[tuple[str, int, str]] = []
    for key, size in zip(keys, sizes, strict=True):
        row = table.objects[key]
        if objects[key].nbytes != row.nbytes:
            problems.append(
                f"the delta of {key} is for {row.nbytes} bytes, the object has "
                f"{objects[key].nbytes}"
            )
            continue
        outside += [(key, block, why) for block, why in row.problems()]
        if size is None:
            problems.append(f"missing {delta_key(key)}")
        elif size != row.delta_bytes:
            problems.append(f"{delta_key(key)} holds {size} bytes, expected {row.delta_bytes}")
    refused = []
    for key, block, why in outside:
        start, end = table.objects[key].spans()[block]
        refused.append(
            f"the delta table's block {block} of {key} (bytes {start}..{end}, "
            f"{named(manifest_tensors(manifest, key)(start, end))}) {why}: the publisher wrote "
            "a malformed delta; republish this generation as a keyframe (a full generation)"
        )
    return [*refused, *problems]  # first: an announce names the first problem


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
        rows.append((generation, own, table.objects[own]))
    start = max((i for i, (_, _, row) in enumerate(rows) if row.fresh), default=None)
    if start is None:  # the newest full ancestor's object is the base of every delta
        data = bytearray(store.get_bytes(payload_prefix(group_id(model, chain.full)) + name))
    else:  # new (or resized) there: nothing before it is read
        rows, data = rows[start:], bytearray(rows[start][2].nbytes)
    for generation, own, row in rows:
        delta = store.get_bytes(delta_key(own))
        tensors = stored_tensors(store, model, generation, own)
        apply_object(np.frombuffer(data, np.uint8), delta, row, own, tensors)
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
