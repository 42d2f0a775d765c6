"""What each rollout worker needs, and where the bytes must land.

Two modes. *Compat*: every worker receives every full tensor into one receive buffer (region
``compat``) laid out by :func:`compat_layout`, then feeds the engine's own ``load_weights``.
*Direct*: every worker declares its exact shards as a ``WeightPlacementPart`` (or, for a
placement read off an engine's description, a :class:`BoxPart`) and receives only the bytes
that land in its parameters; where each placement fragment lands is given by
:class:`Destinations` (default: one region per placement fragment, named by its id).

Demands are declared once per registration and reused every generation, so their digests
are computed once per object (``cached_property``) and exclude generation fields.
"""

from __future__ import annotations

import hashlib
import marshal
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, count, repeat
from operator import attrgetter, gt, itemgetter
from typing import NamedTuple

import numpy as np
from mooncake.reshard.geometry import boxes_overlap
from mooncake.reshard.weight import ParallelRank, TensorDescriptor, WeightPlacementPart
from mooncake.reshard.weight.types import validate_fragment_geometry

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.layout import TENSOR_AXES, TENSOR_FIELDS, is_digest
from mooncake_rl.plan import grid
from mooncake_rl.plan.source import SourceLayout

STAGING_REGION = "staging"
COMPAT_REGION = "compat"
# Direct mode's per-parameter fallback: full tensors a worker lands through ``load_weights``.
FALLBACK_REGION = "fallback"


@dataclass(frozen=True)
class CompatDemand:
    """Every worker needs every full tensor, packed into its ``compat`` region."""

    align: int = 64

    def __post_init__(self) -> None:
        if type(self.align) is not int or self.align <= 0:
            raise InvariantViolation(f"compat alignment must be a positive int: {self.align!r}")

    @cached_property
    def digest(self) -> str:
        return hashlib.sha256(f"mooncake-rl/compat/v2/align={self.align}".encode()).hexdigest()


@dataclass(frozen=True, eq=False)
class CompatLayout:
    """Offsets of full tensors in every worker's compat region (``tensor_ids`` sorted; the
    tensors lie in stored order)."""

    tensor_ids: tuple[str, ...]
    offsets: np.ndarray
    nbytes: np.ndarray
    total_bytes: int

    @cached_property
    def index(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tensor_ids)}

    def offset(self, tensor_id: str) -> int:
        """Byte offset of ``tensor_id`` in the compat region."""
        return int(self.offsets[self.index[tensor_id]])


def compat_layout(layout: SourceLayout, align: int) -> CompatLayout:
    """Full tensors in the order they are stored (by object, then offset), each starting on
    an ``align``-byte boundary: tensors packed back to back in one Store object land back to
    back, so their reads and pushes join into one (:func:`.merge.join_adjacent`)."""
    nbytes = np.array(
        [t.itemsize * int(np.prod(t.global_shape)) for t in layout.tensors], dtype=np.int64
    )
    padded = -(-nbytes // align) * align
    first = layout.fragment_ptr[:-1]
    stored = grid.lex_order(layout.fragment_object[first], layout.fragment_offset[first])
    offsets = np.empty(len(nbytes), np.int64)
    offsets[stored] = np.concatenate([[0], np.cumsum(padded[stored])[:-1]])
    total = int(offsets[stored[-1]] + nbytes[stored[-1]]) if len(nbytes) else 0
    return CompatLayout(
        tensor_ids=tuple(t.tensor_id for t in layout.tensors),
        offsets=offsets,
        nbytes=nbytes,
        total_bytes=total,
    )


@dataclass(frozen=True, eq=False)
class Destinations:
    """Where one worker wants its placement fragments to land.

    Regions: ``region_names[i]`` has ``region_sizes[i]`` bytes, e.g. one fused ``qkv_proj``
    parameter buffer. Fragments: the row-major bytes of placement fragment
    ``fragment_ids[j]`` occupy ``[fragment_bases[j], fragment_bases[j] + nbytes)`` of region
    ``fragment_regions[j]``. Every fragment of the worker's part needs an entry; two
    fragments may share a region (fused parameters) but must not overlap.

    Kept as columns, not a row tuple per region and fragment: a 1T MoE's TP worker maps
    some 5,600 fragments, each to its own region, and a plan keeps every worker's
    destinations, so rows were 360k objects per engine that every collector pass walked.
    Order carries no meaning; :attr:`digest` is taken over the rows in sorted order.
    """

    region_names: tuple[str, ...]
    region_sizes: tuple[int, ...]
    fragment_ids: tuple[str, ...] = ()
    fragment_regions: tuple[str, ...] = ()
    fragment_bases: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """Column passes first; a row at a time only to name the first bad one (fragments
        in id order). Types are checked before anything is compared."""
        names, declared = self.region_names, self.region_sizes
        ids, where, bases = self.fragment_ids, self.fragment_regions, self.fragment_bases
        if len(names) != len(declared) or not len(ids) == len(where) == len(bases):
            raise InvariantViolation("destination columns must have equal lengths")
        if (
            set(map(type, names)) - {str}
            or not all(names)
            or STAGING_REGION in names
            or set(map(type, declared)) - {int}
            or min(declared, default=1) <= 0
        ):
            for name, size in zip(names, declared, strict=True):
                if not isinstance(name, str) or not name or name == STAGING_REGION:
                    raise InvariantViolation(f"bad destination region name {name!r}")
                if type(size) is not int or size <= 0:
                    raise InvariantViolation(f"region {name} needs a positive size, got {size!r}")
        known = set(names)
        if len(known) != len(names):
            raise InvariantViolation("destinations declare a region twice")
        if set(map(type, ids)) - {str}:
            bad = next(i for i in ids if type(i) is not str)
            raise InvariantViolation(f"placement fragment id {bad!r} is not a string")
        if len(set(ids)) != len(ids):
            raise InvariantViolation("destinations map a placement fragment twice")
        if set(where) - known or set(map(type, bases)) - {int} or min(bases, default=0) < 0:
            for fragment_id, region, base in sorted(zip(ids, where, bases, strict=True)):
                if region not in known:
                    raise InvariantViolation(
                        f"fragment {fragment_id} maps to unknown region {region}"
                    )
                if type(base) is not int or base < 0:
                    raise InvariantViolation(f"fragment {fragment_id} has bad base offset {base!r}")
        # Regions in name order: a plan numbers regions in this order, and one plan key
        # (whose digest ignores order) must give one table, however an engine listed them.
        if any(map(gt, names, names[1:])):
            order = sorted(range(len(names)), key=names.__getitem__)
            object.__setattr__(self, "region_names", tuple(map(names.__getitem__, order)))
            object.__setattr__(self, "region_sizes", tuple(map(declared.__getitem__, order)))

    @classmethod
    def of(
        cls, regions: Mapping[str, int], fragments: Mapping[str, tuple[str, int]]
    ) -> Destinations:
        rows = tuple(fragments.values())
        return cls(
            tuple(regions),
            tuple(regions.values()),
            tuple(fragments),
            tuple(map(itemgetter(0), rows)),
            tuple(map(itemgetter(1), rows)),
        )

    @cached_property
    def digest(self) -> str:
        rows = (
            tuple(sorted(zip(self.region_names, self.region_sizes, strict=True))),
            tuple(
                sorted(
                    zip(self.fragment_ids, self.fragment_regions, self.fragment_bases, strict=True)
                )
            ),
        )
        return hashlib.sha256(repr(rows).encode()).hexdigest()


class Box(NamedTuple):
    """One placed box with the fields of a ``PlacementFragment`` the planner reads."""

    placement_fragment_id: str
    tensor_id: str
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    nbytes: int
    pipeline_stage_id: int | None = None
    aliases: tuple[str, ...] = ()

    @classmethod
    def columns(
        cls,
        ids: Iterable[str],
        tensors: Iterable[str],
        offsets: Iterable[tuple[int, ...]],
        shapes: Iterable[tuple[int, ...]],
        nbytes: Iterable[int],
    ) -> list[Box]:
        """Boxes from columns in one C-level pass (a 1T MoE's TP8 rank has 140k)."""
        rows = zip(ids, tensors, offsets, shapes, nbytes, repeat(None), repeat(()))
        return list(map(tuple.__new__, repeat(cls), rows))


_BOX_ID, _TENSOR_ID = attrgetter("placement_fragment_id"), attrgetter("tensor_id")
_BOX_OFFSET, _BOX_SHAPE = attrgetter("global_offset"), attrgetter("local_shape")
_BOX_NBYTES = attrgetter("nbytes")
_SHAPE_AND_SIZE = attrgetter("global_shape", "itemsize")


@dataclass(frozen=True, eq=False)
class BoxPart:
    """A rank's placement read off an engine's description, each distinct box geometry
    checked by mooncake.reshard's own rule, without a contract object per box.

    Why: a 1T MoE's TP8 engine describes about a million boxes, and a ``PlacementFragment``
    per box, validated again inside a ``WeightPlacementPart``, cost 20-40 s per distinct
    engine. The contract planner still sees real contract objects: ``plan.reshard`` builds
    them for one representative tensor of each distinct geometry. Fields and order match a
    ``WeightPlacementPart``'s (tensors and fragments sorted by id), so both digest alike.
    The checks run as column passes: experts repeat a few geometries many times.
    """

    rank: ParallelRank
    tensors: tuple[TensorDescriptor, ...]
    fragments: tuple[Box, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.rank, ParallelRank):
            raise InvariantViolation("a placement part's rank must be a ParallelRank")
        if set(map(type, self.tensors)) - {TensorDescriptor}:
            raise InvariantViolation("a placement part's tensors must be TensorDescriptors")
        tensors = dict(zip(map(_TENSOR_ID, self.tensors), self.tensors, strict=True))
        if len(tensors) != len(self.tensors):
            raise InvariantViolation("a placement part declares one tensor twice")
        if set(map(type, self.fragments)) - {Box}:
            raise InvariantViolation("a placement part's fragments must be Boxes")
        ids = list(map(_BOX_ID, self.fragments))
        if set(map(type, ids)) - {str} or not all(ids):
            raise InvariantViolation("box ids must be non-empty strings")
        if len(set(ids)) != len(ids):
            twice = next(i for i, n in Counter(ids).items() if n > 1)
            raise InvariantViolation(f"placement part {self.rank} declares box {twice} twice")
        fragments = tuple(sorted(self.fragments, key=_BOX_ID))
        named = Counter(map(_TENSOR_ID, fragments))
        if named.keys() - tensors.keys():
            box = next(b for b in fragments if b.tensor_id not in tensors)
            raise InvariantViolation(
                f"box {box.placement_fragment_id} names tensor {box.tensor_id!r}, which "
                "the placement part does not declare"
            )
        if tensors.keys() - named.keys():
            unused = sorted(tensors.keys() - named.keys())[0]
            raise InvariantViolation(f"placement part declares tensor {unused} without a box")
        offsets, shapes = list(map(_BOX_OFFSET, fragments)), list(map(_BOX_SHAPE, fragments))
        if (
            (set(map(type, offsets)) | set(map(type, shapes))) - {tuple}
            or set(map(type, chain.from_iterable(offsets + shapes))) - {int}
            or set(map(type, map(_BOX_NBYTES, fragments))) - {int}
        ):
            for box in fragments:  # raises at the first box of another type, naming it
                _require_box(box, tensors[box.tensor_id])
        # Each tensor's (global shape, itemsize) as a small int, so that a box's geometry
        # key hashes an int and its own offset and shape, not the tensor's shape tuple.
        kinds: dict[tuple, int] = {}
        kind_of = dict(
            zip(
                tensors,
                map(kinds.setdefault, map(_SHAPE_AND_SIZE, tensors.values()), count()),
                strict=True,
            )
        )
        geometry = zip(
            map(kind_of.__getitem__, map(_TENSOR_ID, fragments)),
            offsets,
            shapes,
            map(_BOX_NBYTES, fragments),
            strict=True,
        )
        for box in dict(zip(geometry, fragments, strict=True)).values():  # one per geometry
            _require_box(box, tensors[box.tensor_id])
        several = {t for t, n in named.items() if n > 1} if len(named) < len(fragments) else ()
        boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        for box in (b for b in fragments if b.tensor_id in several) if several else ():
            boxes.setdefault(box.tensor_id, []).append((box.global_offset, box.local_shape))
        for tensor_id, held_boxes in boxes.items():
            if boxes_overlap(tuple(held_boxes)):
                raise InvariantViolation(
                    f"boxes of {tensor_id} overlap on rank {self.rank}; each byte of a "
                    "tensor lands once per rank"
                )
        object.__setattr__(self, "tensors", tuple(sorted(self.tensors, key=_TENSOR_ID)))
        object.__setattr__(self, "fragments", fragments)


def _require_box(box: Box, tensor: TensorDescriptor) -> None:
    """mooncake.reshard's fragment geometry rule, after the types it assumes."""
    offset, shape = box.global_offset, box.local_shape
    if (
        type(offset) is not tuple
        or type(shape) is not tuple
        or type(box.nbytes) is not int
        or not all(type(v) is int and v >= 0 for v in offset)
        or not all(type(v) is int and v >= 1 for v in shape)
    ):
        raise InvariantViolation(
            f"box {box.placement_fragment_id}: offsets must be integers >= 0 and extents "
            f"integers >= 1, got {offset!r} and {shape!r}"
        )
    try:
        validate_fragment_geometry(
            tensor,
            fragment_id=box.placement_fragment_id,
            global_offset=offset,
            local_shape=shape,
            nbytes=box.nbytes,
        )
    except ValueError as error:
        raise InvariantViolation(f"{error} (tensor {box.tensor_id})") from error


# Tensor descriptors are digested with the same field lists as the source layout.
_PART_TENSOR, _PART_AXES = TENSOR_FIELDS, TENSOR_AXES
_PART_FRAGMENT = attrgetter(
    "placement_fragment_id",
    "tensor_id",
    "global_offset",
    "local_shape",
    "nbytes",
    "pipeline_stage_id",
    "aliases",
)


def part_digest(part: WeightPlacementPart | BoxPart) -> str:
    """Digest of a part's rank, tensors and fragments; not its generation or participant id.

    Plain fields go through marshal format 2 (a pure function of content); parallel axes
    are dataclasses, rendered once per distinct value.
    """
    h = hashlib.sha256(b"mooncake-rl/placement-part/v1")
    h.update(repr(part.rank).encode())
    h.update(marshal.dumps(list(map(_PART_TENSOR, part.tensors)), 2))
    rendered: dict[tuple, str] = {}
    for axes in map(_PART_AXES, part.tensors):
        text = rendered.get(axes)
        if text is None:
            text = rendered[axes] = repr(axes)
        h.update(text.encode())
    h.update(marshal.dumps(list(map(_PART_FRAGMENT, part.fragments)), 2))
    return h.hexdigest()


def declared_digest(reports: Iterable[tuple[str, str]], scope: str = "") -> str:
    """One demand digest from each worker's report of what it receives.

    Each worker digests its own placement once (an engine, at every ``/mooncake/placement``
    reply) and reports it, so a coordinator learns its cache key by combining one digest per
    worker instead of hashing a 1T MoE's ~1M fragments. ``scope`` names anything else the
    demand depends on (the operator's direct fallback). Planning checks the reports first
    (``plan_routing``'s ``before_planning``), so no table is stored under a false one.
    """
    h = hashlib.sha256(b"mooncake-rl/declared/v1\x00" + scope.encode() + b"\x00")
    for worker, digest in sorted(reports):
        if not is_digest(digest):
            raise InvariantViolation(
                f"worker {worker} reported placement digest {digest!r}, not a SHA-256 hex digest"
            )
        h.update(f"{worker}\x00{digest}\x00".encode())
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class DirectDemand:
    """Each worker's placement part, and optionally its destinations (worker id -> value).

    ``declared``: the demand's digest as the workers reported it (:func:`declared_digest`);
    it is then the cache key's demand digest, and nothing is hashed here.
    """

    parts: tuple[tuple[str, WeightPlacementPart | BoxPart], ...]
    destinations: tuple[tuple[str, Destinations], ...] = ()
    declared: str | None = None

    def __post_init__(self) -> None:
        if self.declared is not None and not is_digest(self.declared):
            raise InvariantViolation(f"declared demand digest {self.declared!r} is not SHA-256")
        parts = tuple(sorted(self.parts, key=lambda p: p[0]))
        destinations = tuple(sorted(self.destinations, key=lambda d: d[0]))
        if len({w for w, _ in parts}) != len(parts):
            raise InvariantViolation("a worker declares two placement parts")
        if len({w for w, _ in destinations}) != len(destinations):
            raise InvariantViolation("a worker declares two destination maps")
        for worker, part in parts:
            if not isinstance(part, WeightPlacementPart | BoxPart):
                raise InvariantViolation(
                    f"worker {worker}: part is neither a WeightPlacementPart nor a BoxPart"
                )
        known = {w for w, _ in parts}
        for worker, dest in destinations:
            if worker not in known:
                raise InvariantViolation(f"destinations for worker {worker} without a part")
            if not isinstance(dest, Destinations):
                raise InvariantViolation(f"worker {worker}: destinations of the wrong type")
        object.__setattr__(self, "parts", parts)
        object.__setattr__(self, "destinations", destinations)

    @classmethod
    def of(
        cls,
        parts: Mapping[str, WeightPlacementPart | BoxPart],
        destinations: Mapping[str, Destinations] | None = None,
        declared: str | None = None,
    ) -> DirectDemand:
        return cls(tuple(parts.items()), tuple((destinations or {}).items()), declared)

    @cached_property
    def digest(self) -> str:
        """The declared digest, else :attr:`content_digest`."""
        return self.declared or self.content_digest

    @cached_property
    def content_digest(self) -> str:
        """Computed once per demand; parts shared by several workers are hashed once."""
        memo: dict[int, str] = {}
        h = hashlib.sha256(b"mooncake-rl/direct/v1")
        for worker, part in self.parts:
            if id(part) not in memo:
                memo[id(part)] = part_digest(part)
            h.update(f"{worker}\x00{memo[id(part)]}\x00".encode())
        for worker, dest in self.destinations:
            h.update(f"{worker}\x00{dest.digest}\x00".encode())
        return h.hexdigest()
