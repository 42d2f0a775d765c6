"""The JSON shape of one worker's routing slice, as the coordinator sends it to engines.

A slice is the worker's destination regions (name -> bytes, allocated by the worker at
prepare) and its batches per stage. Every string it names (region names, object keys,
peers) is listed once in ``names``, and the slice's arrays carry indices into it: a 1T
MoE's TP8 worker names some 140k regions, each in its regions, reads and pushes, and
spelled out they were most of a 312 MB prepare body (protocol 5). ``regions`` is
``[[name, bytes(, stored dtype)], ...]``: direct mode names the dtype each region's bytes
are stored in, which the worker checks against its parameter's. Ops travel as compact
arrays:
read ``[key, src_offset, region, dst_offset, length]`` and
push ``[peer, src_region, src_offset, dst_region, dst_offset, length]``. A strided run (a
column shard's rows: ``count`` ranges of ``length`` bytes, ``src_stride`` and
``dst_stride`` apart) may travel as one array with ``count, src_stride, dst_stride``
appended, which the worker expands: a 1T MoE's TP8 engine reads some 470k ranges per
update from about 9k such runs. Arrays are tuples until encoded (tuples of plain values
leave the cyclic collector's view once it has seen them; lists stay, and make every full
collection of a large heap longer).
``checksums`` (present when the coordinator loaded the generation's table) holds
``[key, nbytes, whole, [block, ...]]`` for every object the worker reads, so the worker
checks what lands without loading the table itself (one table load per update).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mooncake_rl.apply.executor import Batch, PushOp, ReadOp
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.checksums import ObjectChecksum


@dataclass(frozen=True)
class WorkerSlice:
    regions: Mapping[str, int]
    stages: tuple[tuple[Batch, ...], ...]
    checksums: Mapping[str, ObjectChecksum] | None = None
    # direct mode: the dtype each region's bytes are stored in (region -> dtype name)
    region_dtypes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, size in self.regions.items():
            if not name or type(size) is not int or size <= 0:
                raise InvariantViolation(
                    f"region {name!r} needs a positive integer size, got {size!r}"
                )
        unknown = set(self.region_dtypes) - set(self.regions)
        if unknown:
            raise InvariantViolation(f"the slice gives a dtype for {min(unknown)!r}, not a region")

    @property
    def read_keys(self) -> set[str]:
        return {op.key for stage in self.stages for batch in stage for op in batch.reads}

    @property
    def read_bytes(self) -> int:
        return sum(op.length for stage in self.stages for batch in stage for op in batch.reads)

    @property
    def pushed_bytes(self) -> int:
        return sum(op.length for stage in self.stages for batch in stage for op in batch.pushes)


def with_checksums(worker_slice: WorkerSlice, table: Mapping[str, ObjectChecksum]) -> WorkerSlice:
    """The slice carrying the checksums of exactly the objects it reads."""
    return replace(worker_slice, checksums=checksums_of(worker_slice.read_keys, table))


def checksums_of(
    keys: Iterable[str], table: Mapping[str, ObjectChecksum]
) -> dict[str, ObjectChecksum]:
    """``table``'s rows of ``keys``, in key order; every key must have one."""
    ordered = sorted(keys)
    missing = [k for k in ordered if k not in table]
    if missing:
        raise InvariantViolation(f"the checksum table has no entry for {missing[0]}")
    return {k: table[k] for k in ordered}


class NameTable:
    """The strings one slice names, each once, in the order first named; the slice's arrays
    carry their indices (``names``)."""

    def __init__(self) -> None:
        self._indices: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        return self._indices.setdefault(name, len(self._indices))

    def many(self, names: Iterable[str]) -> list[int]:
        indices = self._indices
        index = indices.setdefault
        return [index(name, len(indices)) for name in names]

    @property
    def names(self) -> list[str]:
        return list(self._indices)

    def checksums(self, checksums: Mapping[str, ObjectChecksum]) -> list[tuple[Any, ...]]:
        """A slice's ``checksums``: ``(key, nbytes, whole, blocks, cuts)`` arrays."""
        return [(self(key), c.nbytes, c.whole, c.blocks, c.cuts) for key, c in checksums.items()]

    def regions(
        self, regions: Mapping[str, int], dtypes: Mapping[str, str]
    ) -> list[tuple[int, ...]]:
        """A slice's ``regions``: ``(name, bytes)`` arrays, the stored dtype appended where
        ``dtypes`` names one."""
        indices = self.many(regions)
        kinds = {dtype: self(dtype) for dtype in sorted(set(dtypes.values()))}
        return [
            (index, size) if name not in dtypes else (index, size, kinds[dtypes[name]])
            for index, (name, size) in zip(indices, regions.items(), strict=True)
        ]


def encode_slice(worker_slice: WorkerSlice) -> dict[str, Any]:
    name = NameTable()
    encoded: dict[str, Any] = {
        "regions": name.regions(worker_slice.regions, worker_slice.region_dtypes),
        "stages": [
            [
                {
                    "reads": [
                        (name(r.key), r.src_offset, name(r.region), r.dst_offset, r.length)
                        for r in batch.reads
                    ],
                    "pushes": [
                        (
                            name(p.peer),
                            name(p.src_region),
                            p.src_offset,
                            name(p.dst_region),
                            p.dst_offset,
                            p.length,
                        )
                        for p in batch.pushes
                    ],
                }
                for batch in stage
            ]
            for stage in worker_slice.stages
        ],
    }
    if worker_slice.checksums is not None:
        encoded["checksums"] = name.checksums(worker_slice.checksums)
    encoded["names"] = name.names
    return encoded


def _ints(values: Sequence[Any], what: str) -> list[int]:
    if any(type(v) is not int or v < 0 for v in values):
        raise InvariantViolation(f"{what} must hold non-negative integers, got {list(values)}")
    return list(values)


MAX_RANGES = 1 << 24
"""Ranges one slice may expand to (the wire model's bound on arrays per batch)."""


def decode_slice(raw: Mapping[str, Any]) -> WorkerSlice:
    """Parse and validate a slice received over HTTP; raises InvariantViolation if malformed."""
    try:
        name = _namer(raw["names"])
        regions: dict[str, int] = {}
        dtypes: dict[str, str] = {}
        for index, size, *dtype in raw["regions"]:
            region = name(index)
            if region in regions:
                raise InvariantViolation(f"the slice gives region {region!r} twice")
            regions[region] = size
            if len(dtype) > 1:
                raise InvariantViolation(f"region {region!r}: [name, bytes(, dtype)], got more")
            if dtype:
                dtypes[region] = name(dtype[0])
        stages = []
        ranges = 0
        for stage in raw["stages"]:
            batches = []
            for batch in stage:
                reads = []
                for key, src, region, dst, length, *run in batch["reads"]:
                    src, dst, length = _ints([src, dst, length], "read offsets")
                    ranges = _counted(ranges, run, length)
                    key, region = name(key), name(region)
                    reads.extend(
                        ReadOp(key, s, region, d, n) for s, d, n in _ranges(src, dst, length, run)
                    )
                pushes = []
                for peer, src_region, src, dst_region, dst, length, *run in batch["pushes"]:
                    src, dst, length = _ints([src, dst, length], "push offsets")
                    ranges = _counted(ranges, run, length)
                    peer, src_region, dst_region = name(peer), name(src_region), name(dst_region)
                    pushes.extend(
                        PushOp(peer, src_region, s, dst_region, d, n)
                        for s, d, n in _ranges(src, dst, length, run)
                    )
                if any(op.length == 0 for op in (*reads, *pushes)):
                    raise InvariantViolation("zero-length range in slice")
                batches.append(Batch(tuple(reads), tuple(pushes)))
            stages.append(tuple(batches))
        checksums: dict[str, ObjectChecksum] | None = None
        if raw.get("checksums") is not None:
            checksums = {}
            for index, nbytes, whole, blocks, *cuts in raw["checksums"]:  # cuts: newer
                key = name(index)
                if key in checksums:
                    raise InvariantViolation(f"the slice gives the checksum of {key!r} twice")
                checksums[key] = ObjectChecksum(
                    int(nbytes),
                    str(whole),
                    tuple(str(b) for b in blocks),
                    tuple(int(c) for c in (cuts[0] if cuts else ())),
                )
    except (KeyError, TypeError, ValueError) as error:
        raise InvariantViolation(f"malformed routing slice: {error}") from error
    return WorkerSlice(regions, tuple(stages), checksums, dtypes)


def _namer(names: Any) -> Callable[[Any], str]:
    """The slice's ``names`` looked up by index, each index checked."""
    if not isinstance(names, list) or not all(type(n) is str and n for n in names):
        raise InvariantViolation("a slice's names must be a list of non-empty strings")
    count = len(names)

    def name(index: Any) -> str:
        if type(index) is not int or not 0 <= index < count:
            raise InvariantViolation(
                f"name index {index!r} is not one of the slice's {count} names"
            )
        return names[index]

    return name


def _counted(total: int, run: Sequence[Any], length: int) -> int:
    """``total`` plus the ranges a (strided) array stands for, checked before any is made:
    a ``count`` of at least 1, strides no shorter than ``length``, and no more than
    ``MAX_RANGES`` ranges in the slice."""
    count = 1
    if run:
        if len(run) != 3:
            raise InvariantViolation(
                f"a strided run appends [count, src_stride, dst_stride], got {list(run)}"
            )
        count, src_stride, dst_stride = _ints(run, "strided run")
        if count < 1 or min(src_stride, dst_stride) < length:
            raise InvariantViolation(
                f"strided run of {count} ranges of {length} bytes with strides {src_stride} "
                f"and {dst_stride}: needs at least one range and strides of at least the length"
            )
    if total + count > MAX_RANGES:
        raise InvariantViolation(f"the routing slice expands to over {MAX_RANGES} ranges")
    return total + count


def _ranges(src: int, dst: int, length: int, run: Sequence[int]) -> Iterable[tuple[int, int, int]]:
    if not run:
        return ((src, dst, length),)
    count, src_stride, dst_stride = run
    return ((src + k * src_stride, dst + k * dst_stride, length) for k in range(count))
