"""Packed objects: small tensors share Store objects; the manifest says where each one sits.

    stored specs, in publish order --Packer.place--> (pack object, offset) per small tensor
    publisher: copies each small tensor into its open pack's buffer, puts each full pack once
    rank 0: build_manifest points each packed fragment at (pack key, offset)
    readers: object_extents(manifest) -> the objects to read and what each one holds

Why: Mooncake charges per object and per range, not per byte (about 145 us per object and
40 us per range on this host's loopback TCP; ``bench.ops``). A MoE generation is mostly
small tensors (Qwen3-30B-A3B: 18,000 expert tensors; Kimi-K2 fp8: 139,583 tensors, half
of them block scales), so one object per tensor spent an update in per-object work. A pack
holds tensors of one dtype back to back, without gaps: every byte of a pack belongs to a
tensor, and each tensor starts at a multiple of its itemsize. Tensors larger than a quarter
of a pack stay one object each: copying them into a pack would buy nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from mooncake.reshard.weight import StoredFragment, WeightManifest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.keys import payload_key, payload_prefix

DEFAULT_PACK_BYTES = 128 << 20
"""A pack's size. At least ~100 MiB packs Kimi-K2 fp8's 14 MiB expert weights nine to an
object (139,583 tensors in 7,900 objects); 64 MiB would pack four (17,600 objects)."""
MAX_PACK_BYTES = 1 << 30
"""The largest pack a publisher stages: one registered host buffer per open pack."""
PACKED_FRACTION = 4
"""Tensors of at most ``pack_bytes // PACKED_FRACTION`` bytes are packed."""
PACK_PREFIX = "~pack/"
"""Object names of packs; no tensor name may start with it."""


def check_pack_bytes(pack_bytes: object) -> int:
    """``pack_bytes`` if a publisher can use it; else an error naming the setting."""
    if type(pack_bytes) is not int or not 0 < pack_bytes <= MAX_PACK_BYTES:
        raise InvariantViolation(
            f"pack_bytes (--pack-bytes, bridge key pack_bytes) must be an integer in "
            f"[1, {MAX_PACK_BYTES}] (1 GiB: one registered buffer per open pack), got "
            f"{pack_bytes!r}; nothing was claimed"
        )
    return pack_bytes


def is_packed(nbytes: int, pack_bytes: int) -> bool:
    """Whether a stored tensor of ``nbytes`` goes into a pack."""
    return nbytes <= pack_bytes // PACKED_FRACTION


def pack_name(rank: int, dtype: str, index: int) -> str:
    return f"{PACK_PREFIX}r{rank}-{dtype}-{index}"


@dataclass(frozen=True)
class Placement:
    """Where a packed tensor sits: object name and byte offset in it; or, in a rank-major
    pack (:mod:`.pack_order`), where its rows ``rows`` (first, end) sit."""

    object_name: str
    offset: int
    rows: tuple[int, int] | None = None

    def fragment_id(self, tensor: str) -> str:
        """The manifest's id of what this places: the tensor's name, or its rows'."""
        return tensor if self.rows is None else f"{tensor}[{self.rows[0]}:{self.rows[1]}]"


@dataclass
class Packer:
    """One publisher rank's open packs, one per dtype, filled in publish order.

    Pure bookkeeping (no I/O), so the publisher and the simulator's layouts agree.
    ``place`` returns the tensor's placement and, when the tensor did not fit its dtype's
    open pack, that pack's name and size: it is full and can be put.
    """

    rank: int
    pack_bytes: int
    _open: dict[str, tuple[int, int]] = field(default_factory=dict)  # dtype -> (index, fill)
    _next_index: int = 0

    def __post_init__(self) -> None:
        check_pack_bytes(self.pack_bytes)

    def place(self, nbytes: int, dtype: str) -> tuple[Placement, tuple[str, int] | None]:
        if not 0 < nbytes <= self.pack_bytes:
            raise InvariantViolation(f"a packed tensor needs 1..{self.pack_bytes} bytes")
        full = None
        index, fill = self._open.get(dtype, (-1, self.pack_bytes))
        if fill + nbytes > self.pack_bytes:
            if index >= 0:
                full = (pack_name(self.rank, dtype, index), fill)
            index, fill = self._next_index, 0
            self._next_index += 1
        self._open[dtype] = (index, fill + nbytes)
        return Placement(pack_name(self.rank, dtype, index), fill), full

    def open_packs(self) -> list[tuple[str, int, str]]:
        """(name, size, dtype) of every pack not yet reported full: the last ones to put."""
        return [(pack_name(self.rank, d, i), fill, d) for d, (i, fill) in self._open.items()]


def pack_layout(
    specs: Iterable[tuple[str, int, str, int]], pack_bytes: int
) -> dict[str, tuple[Placement, ...]]:
    """Placement of every packed tensor of ``(name, nbytes, dtype, publisher rank)`` rows,
    in publish order, tensor after tensor: what the publishers would do with no pack order
    (for planning and simulation)."""
    packers: dict[int, Packer] = {}
    placed: dict[str, tuple[Placement, ...]] = {}
    for name, nbytes, dtype, rank in specs:
        if is_packed(nbytes, pack_bytes):
            packer = packers.setdefault(rank, Packer(rank, pack_bytes))
            placed[name] = (packer.place(nbytes, dtype)[0],)
    return placed


@dataclass(frozen=True)
class StoredObject:
    """One Store object of a generation: its key, size and the fragments it holds, by offset."""

    key: str
    nbytes: int
    fragments: tuple[StoredFragment, ...]


def object_extents(
    manifest: WeightManifest, sizes: Mapping[str, int] | None = None
) -> dict[str, StoredObject]:
    """Every object the manifest's fragments live in, in first-use order; with ``sizes``
    (key -> bytes, e.g. the checksum table's) checked that no fragment runs past its object.
    An object's size is ``sizes[key]``, else its last fragment's end.

    Raises naming the tensor, at announce and at load: a reader of such a manifest would
    hand a tensor bytes that are not its own. (Overlapping fragments never get this far:
    ``WeightManifest`` refuses them when it is built or decoded.)
    """
    by_key: dict[str, list[StoredFragment]] = {}
    for fragment in manifest.fragments:
        by_key.setdefault(fragment.object_key, []).append(fragment)
    objects = {}
    for key, fragments in by_key.items():
        ordered = sorted(fragments, key=lambda f: f.object_offset)
        end = ordered[-1].object_offset + ordered[-1].nbytes
        size = end if sizes is None or key not in sizes else sizes[key]
        if end > size:
            raise InvariantViolation(
                f"tensor {ordered[-1].tensor_id!r} runs past the end of object {key} "
                f"({end} > {size} bytes): the manifest is malformed; republish the generation"
            )
        objects[key] = StoredObject(key, size, tuple(ordered))
    return objects


def is_pack_key(group: str, key: str) -> bool:
    return key.startswith(payload_prefix(group) + PACK_PREFIX)


def tensor_checksum_key(group: str, fragment: StoredFragment) -> str:
    """The checksum-table key that checks ``fragment``'s bytes on their own: its object's
    for a tensor stored alone, the fragment's own id for a packed one (the tensor's name, or
    its rows' in a rank-major pack: a receiver of single tensors, e.g. broadcast, checks
    each piece without its pack)."""
    if is_pack_key(group, fragment.object_key):
        return payload_key(group, fragment.fragment_id)
    return fragment.object_key


def checksum_sizes(
    manifest: WeightManifest, sizes: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Every key the generation's checksum table must hold, with its byte count: each object
    (checked as by :func:`object_extents`) and each packed tensor on its own."""
    group = manifest.group_id
    expected = {key: o.nbytes for key, o in object_extents(manifest, sizes).items()}
    for fragment in manifest.fragments:
        if is_pack_key(group, fragment.object_key):
            expected[tensor_checksum_key(group, fragment)] = fragment.nbytes
    return expected
