"""The routing table: the contract between the planner and the apply pipeline.

Records are numpy structured arrays (a 1T MoE onto 128 workers is ~1.3M records; Python
objects per record would dominate planning time). Every record describes ``count`` byte
ranges of ``length`` bytes; range ``k`` starts at ``src_offset + k * src_stride`` on the
source side and ``dst_offset + k * dst_stride`` on the destination side. When ``count == 1``
both strides equal ``length``; a side whose stride equals ``length`` is contiguous.

Reads (``READ_DTYPE``): worker ``worker`` reads object ``object`` (index into
``objects``) into its own region ``dst_region`` (index into ``regions``).
Pushes (``PUSH_DTYPE``): worker ``worker`` writes bytes of its own region ``src_region``
into region ``dst_region`` of worker ``peer`` with one TE one-sided write. Stage 1 pushes
move bytes the sender read itself in the same or an earlier batch; stage 2 pushes (relay
fan-out inside a node) move bytes the sender received in stage 1, so they may start only
after the coordinator's barrier: consumers are passive and learn nothing else.
Batches: per worker and stage, batch ``b``'s reads land at most ``batch_bytes`` (one read
never exceeds it unless a single row does); stage 1 pushes ride in the batch of their read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from mooncake_rl.apply.executor import PushOp, ReadOp
from mooncake_rl.apply.wire import NameTable
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.keys import payload_prefix
from mooncake_rl.plan import grid
from mooncake_rl.plan.demand import STAGING_REGION, CompatLayout
from mooncake_rl.plan.params import PlanParams

SOURCE_SPAN = [("src_offset", np.int64), ("src_stride", np.int64)]
DESTINATION_SPAN = [("dst_offset", np.int64), ("dst_stride", np.int64)]
REPEAT = [("length", np.int64), ("count", np.int64)]
"""Every record moves ``count`` runs of ``length`` bytes, each span stepping by its stride."""
READ_DTYPE = np.dtype(
    [
        ("worker", np.int32),
        ("batch", np.int32),
        ("object", np.int32),
        *SOURCE_SPAN,
        ("dst_region", np.int32),
        *DESTINATION_SPAN,
        *REPEAT,
    ]
)
PUSH_DTYPE = np.dtype(
    [
        ("worker", np.int32),
        ("stage", np.int8),
        ("batch", np.int32),
        ("peer", np.int32),
        ("src_region", np.int32),
        *SOURCE_SPAN,
        ("dst_region", np.int32),
        *DESTINATION_SPAN,
        *REPEAT,
    ]
)
# What each worker must end up holding: object bytes -> its region (the coverage contract).
DEMAND_DTYPE = np.dtype(
    [
        ("worker", np.int32),
        ("dst_region", np.int32),
        *DESTINATION_SPAN,
        ("object", np.int32),
        *SOURCE_SPAN,
        *REPEAT,
    ]
)
REGION_DTYPE = np.dtype([("worker", np.int32), ("region", np.int32), ("size", np.int64)])


class RecordBatch(NamedTuple):
    """One pipeline step of one worker, as table records: its reads, then the pushes they feed.

    ``bind(...).read_ops``/``push_ops`` lower it to the executor's ``ReadOp``/``PushOp``.
    """

    stage: int
    index: int
    reads: np.ndarray
    pushes: np.ndarray


@dataclass(frozen=True, eq=False)
class Totals:
    """Traffic a table causes: the figures benchmarks report and tests check."""

    store_read_bytes: int
    cross_node_push_bytes: int
    intra_node_push_bytes: int
    node_nic_bytes: np.ndarray  # per node: reads + cross-node pushes sent
    worker_nic_bytes: np.ndarray  # per worker (GPU): the same, for a NIC per GPU
    node_nic_in: np.ndarray  # per node: reads + cross-node pushes received (full duplex)
    node_nic_out: np.ndarray  # per node: cross-node pushes sent
    delivered_bytes: np.ndarray  # per worker: bytes landed outside staging
    demanded_bytes: np.ndarray  # per worker
    unique_demand_bytes: int  # size of the union of demanded source bytes


@dataclass(frozen=True, eq=False)
class RoutingTable:
    """A generation-independent routing table (see module docstring for record semantics).

    ``region_sizes`` declares every region a record may touch, including each reader's
    ``staging`` region; ``demands`` is the coverage contract the validator checks against.
    ``compat`` is the compat-mode receive-buffer layout (None in direct mode).
    ``max_chunk_cost`` is the term of the documented duplex balance bound: per node,
    ``out <= max(in + staged, mean(out) + max_chunk_cost)`` (see :mod:`.assign`).
    """

    mode: str
    source_digest: str
    target_digest: str
    topology_digest: str
    params: PlanParams
    workers: tuple[str, ...]
    nodes: tuple[str, ...]
    worker_node: np.ndarray
    objects: tuple[str, ...]
    object_sizes: np.ndarray
    regions: tuple[str, ...]
    region_sizes: np.ndarray
    reads: np.ndarray
    pushes: np.ndarray
    demands: np.ndarray
    compat: CompatLayout | None
    lower_bound_bytes: int
    max_chunk_cost: int

    def __post_init__(self) -> None:
        if self.mode not in ("compat", "direct"):
            raise InvariantViolation(f"unknown routing mode {self.mode!r}")
        for name, dtype in (
            ("reads", READ_DTYPE),
            ("pushes", PUSH_DTYPE),
            ("demands", DEMAND_DTYPE),
            ("region_sizes", REGION_DTYPE),
        ):
            value = getattr(self, name)
            if not isinstance(value, np.ndarray) or value.dtype != dtype or value.ndim != 1:
                raise InvariantViolation(f"routing table {name} must be a 1-D {dtype} array")
        if len(self.worker_node) != len(self.workers) or len(self.object_sizes) != len(
            self.objects
        ):
            raise InvariantViolation("routing table worker/object metadata lengths differ")
        if not self.regions or self.regions[0] != STAGING_REGION:
            raise InvariantViolation(f"region 0 must be {STAGING_REGION!r}")
        if not _is_sorted(self.reads["worker"], self.reads["batch"]) or not _is_sorted(
            self.pushes["worker"], self.pushes["stage"], self.pushes["batch"]
        ):
            raise InvariantViolation("routing table records are not in worker/stage/batch order")
        for array in (
            self.worker_node,
            self.object_sizes,
            self.region_sizes,
            self.reads,
            self.pushes,
            self.demands,
        ):
            array.flags.writeable = False  # tables are shared through the cache

    def batches(self, worker: str) -> tuple[RecordBatch, ...]:
        """The worker's batches in execution order: stage 1 batches, then stage 2.

        Records are sorted by worker, so this slices instead of scanning the table.
        """
        w = self.worker_ids[worker]
        reads = _rows_of(self.reads, w)
        pushes = _rows_of(self.pushes, w)
        out = []
        for stage in (1, 2):
            staged = pushes[pushes["stage"] == stage]
            stage_reads = reads if stage == 1 else reads[:0]
            for b in np.union1d(stage_reads["batch"], staged["batch"]).tolist():
                out.append(
                    RecordBatch(
                        stage,
                        b,
                        _rows_of(stage_reads, b, "batch"),
                        _rows_of(staged, b, "batch"),
                    )
                )
        return tuple(out)

    @cached_property
    def worker_ids(self) -> dict[str, int]:
        return {w: i for i, w in enumerate(self.workers)}

    @cached_property
    def unique_demand_bytes(self) -> int:
        """The size of the union of the demanded source bytes, from the table's own demands;
        the validator's single-pull total and :attr:`totals` read one computation."""
        return demanded_union_bytes(self.demands)

    @cached_property
    def totals(self) -> Totals:
        reads, pushes, demands = self.reads, self.pushes, self.demands
        node = self.worker_node
        copies = pushes["peer"] == pushes["worker"]  # local copies (sieve): no traffic
        delivered = pushes[pushes["dst_region"] != 0]  # a span into staging lands nothing
        pushes = pushes[~copies]
        read_bytes = reads["length"] * reads["count"]
        push_bytes = pushes["length"] * pushes["count"]
        cross = node[pushes["worker"]] != node[pushes["peer"]]
        per_worker = np.bincount(reads["worker"], read_bytes, len(self.workers))
        per_worker += np.bincount(pushes["worker"][cross], push_bytes[cross], len(self.workers))
        nic = np.bincount(node, per_worker, len(self.nodes))
        landed = np.bincount(
            reads["worker"][reads["dst_region"] != 0],
            read_bytes[reads["dst_region"] != 0],
            len(self.workers),
        ).astype(np.int64)
        landed += np.bincount(
            delivered["peer"], delivered["length"] * delivered["count"], len(self.workers)
        ).astype(np.int64)
        demanded = np.bincount(
            demands["worker"], demands["length"] * demands["count"], len(self.workers)
        )
        nic_in, nic_out = duplex_nic_bytes(self)
        return Totals(
            store_read_bytes=int(read_bytes.sum()),
            cross_node_push_bytes=int(push_bytes[cross].sum()),
            intra_node_push_bytes=int(push_bytes[~cross].sum()),
            node_nic_bytes=nic.astype(np.int64),
            worker_nic_bytes=per_worker.astype(np.int64),
            node_nic_in=nic_in,
            node_nic_out=nic_out,
            delivered_bytes=landed.astype(np.int64),
            demanded_bytes=demanded.astype(np.int64),
            unique_demand_bytes=self.unique_demand_bytes,
        )


def duplex_nic_bytes(
    table: RoutingTable, object_node: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per node (inbound, outbound) NIC bytes: a full-duplex NIC's time is their max.

    Inbound: Store reads and cross-node pushes received; outbound: cross-node pushes sent.
    ``object_node``: node index of each object's segment (-1: off the rollout nodes); a
    read by a worker on that node stays on the node and is not counted.
    """
    reads, pushes, node = table.reads, table.pushes, table.worker_node
    n = len(table.nodes)
    read_node = node[reads["worker"]]
    over_nic = np.ones(len(reads), bool)
    if object_node is not None:
        over_nic = np.asarray(object_node, np.int64)[reads["object"]] != read_node
    push_bytes = pushes["length"] * pushes["count"]
    src, dst = node[pushes["worker"]], node[pushes["peer"]]
    cross = src != dst
    inbound = np.bincount(
        read_node[over_nic], (reads["length"] * reads["count"])[over_nic], n
    ) + np.bincount(dst[cross], push_bytes[cross], n)
    outbound = np.bincount(src[cross], push_bytes[cross], n)
    return inbound.astype(np.int64), outbound.astype(np.int64)


def demanded_union_bytes(demands: np.ndarray) -> int:
    """Size of the union of the demanded source bytes (what single-pull must read)."""
    fields = [demands[n] for n in ("object", "src_offset", "length", "count", "src_stride")]
    if not len(demands):
        return 0
    # Duplicates are harmless but cost sorting: the consumers of one piece (every replica's
    # worker) sit side by side, so repeats of the previous row go first, read in place.
    kept = grid.group_starts(*fields)
    cols = np.stack([field[kept].astype(np.int64) for field in fields])
    order = grid.lex_order(cols[0], cols[1])  # adjacent duplicates go; any left are harmless
    unique = cols[:, order][:, grid.group_starts(*cols[:, order])]
    rects, _ = grid.to_rects(*unique)
    return int(grid.union_bytes(grid.to_lanes(rects)).sum())


def _rows_of(records: np.ndarray, value: int, field: str = "worker") -> np.ndarray:
    """The contiguous rows whose sorted ``field`` equals ``value``."""
    lo, hi = np.searchsorted(records[field], [value, value + 1])
    return records[lo:hi]


def _is_sorted(*keys: np.ndarray) -> bool:
    """Whether rows are in non-decreasing lexicographic order of ``keys``."""
    undecided = np.ones(max(len(keys[0]) - 1, 0), dtype=bool)
    for field in keys:
        key = np.ascontiguousarray(field)  # a record field is strided: compare a packed copy
        a, b = key[:-1], key[1:]
        if (undecided & (b < a)).any():
            return False
        undecided &= b == a
    return True


def record_ranges(record: np.void) -> list[tuple[int, int, int]]:
    """(src, dst, length) byte ranges of one record, fused when both sides are contiguous."""
    length, count = int(record["length"]), int(record["count"])
    src, dst = int(record["src_offset"]), int(record["dst_offset"])
    s_stride, d_stride = int(record["src_stride"]), int(record["dst_stride"])
    if count == 1 or (s_stride == length and d_stride == length):
        return [(src, dst, length * count)]
    return [(src + k * s_stride, dst + k * d_stride, length) for k in range(count)]


@dataclass(frozen=True)
class ObjectKeys(Sequence[str]):
    """One generation's Store key of each of a table's objects, made when asked for: a
    worker reads its own share of the objects (1/128 of a 1T MoE's 140k on 128 workers),
    and building every key up front was the whole cost of a plan cache hit (10 ms)."""

    prefix: str
    objects: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.objects)

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:  # type: ignore[override]
        if isinstance(index, slice):
            return tuple(map(self.prefix.__add__, self.objects[index]))
        return self.prefix + self.objects[index]


@dataclass(frozen=True, eq=False)
class BoundRoutingTable:
    """A table bound to one generation: object names resolved to that group's keys."""

    table: RoutingTable
    group_id: str
    keys: ObjectKeys

    def read_ops(self, batch: RecordBatch) -> list[ReadOp]:
        regions = self.table.regions
        return [
            ReadOp(self.keys[int(r["object"])], src, regions[int(r["dst_region"])], dst, length)
            for r in batch.reads
            for src, dst, length in record_ranges(r)
        ]

    def push_ops(self, batch: RecordBatch) -> list[PushOp]:
        regions, workers = self.table.regions, self.table.workers
        return [
            PushOp(
                workers[int(p["peer"])],
                regions[int(p["src_region"])],
                src,
                regions[int(p["dst_region"])],
                dst,
                length,
            )
            for p in batch.pushes
            for src, dst, length in record_ranges(p)
        ]

    def slice_names(self) -> SliceNames:
        """A fresh name table for one worker's slice, with this table's ids mapped into it."""
        name = NameTable()
        table = self.table
        return SliceNames(
            name,
            _IdNames(name, self.keys.__getitem__, len(self.keys)),
            _IdNames(name, table.regions.__getitem__, len(table.regions)),
            _IdNames(name, table.workers.__getitem__, len(table.workers)),
        )

    def read_rows(self, batch: RecordBatch, names: SliceNames) -> list[tuple[Any, ...]]:
        """``read_ops`` as the wire's arrays (``apply.wire``), one per record (a strided
        record as one strided run), built from whole columns, each string as its index in
        the slice's ``names``: a 1T MoE's TP8 engine reads some 470k ranges from about 9k
        records per update, and a ``ReadOp`` per range, then an array per op, took seconds
        of the coordinator's prepare."""
        r = batch.reads
        return _wire_rows(r, names.objects(r["object"]), names.regions(r["dst_region"]))

    def push_rows(self, batch: RecordBatch, names: SliceNames) -> list[tuple[Any, ...]]:
        """``push_ops`` as the wire's arrays, built like :meth:`read_rows`."""
        p = batch.pushes
        return _wire_rows(
            p,
            names.workers(p["peer"]),
            names.regions(p["src_region"]),
            names.regions(p["dst_region"]),
        )


class _IdNames:
    """One kind of a table's ids (objects, regions, workers) as indices into a slice's
    name table, each id named once per slice (a 1T MoE's TP8 worker names some 140k
    regions across hundreds of batches)."""

    def __init__(self, name: NameTable, string_of: Callable[[int], str], count: int) -> None:
        self.name, self.string_of = name, string_of
        self.index = np.full(count, -1, dtype=np.int64)

    def __call__(self, ids: np.ndarray) -> list[int]:
        fresh = np.unique(ids[self.index[ids] < 0])
        if len(fresh):
            self.index[fresh] = self.name.many(map(self.string_of, fresh.tolist()))
        return self.index[ids].tolist()


class SliceNames(NamedTuple):
    """A worker slice's name table and the table's ids mapped into it."""

    table: NameTable
    objects: _IdNames
    regions: _IdNames
    workers: _IdNames

    def read_keys(self) -> Iterable[str]:
        """The keys of the objects the slice reads (every object named so far)."""
        named = np.flatnonzero(self.objects.index >= 0).tolist()
        return map(self.table.names.__getitem__, self.objects.index[named].tolist())


def _wire_rows(records: np.ndarray, *names: Iterable[int]) -> list[tuple[Any, ...]]:
    """Wire arrays of ``records``: ``(*names[:-1], src, names[-1], dst, length)``, a record
    whose sides are both contiguous fused into one range (as :func:`record_ranges` does),
    any other with ``count, src_stride, dst_stride`` appended."""
    length, count = records["length"], records["count"]
    src_stride, dst_stride = records["src_stride"], records["dst_stride"]
    fused = (count == 1) | ((src_stride == length) & (dst_stride == length))
    *first, last = names
    rows = list(
        zip(
            *first,
            records["src_offset"].tolist(),
            last,
            records["dst_offset"].tolist(),
            np.where(fused, length * count, length).tolist(),
            strict=True,
        )
    )
    strided = np.flatnonzero(~fused)
    runs = zip(
        count[strided].tolist(),
        src_stride[strided].tolist(),
        dst_stride[strided].tolist(),
        strict=True,
    )
    for i, run in zip(strided.tolist(), runs, strict=True):
        rows[i] += run
    return rows


def bind(table: RoutingTable, group_id: str) -> BoundRoutingTable:
    """Lower a cached table to one generation's concrete keys (made as they are read)."""
    return BoundRoutingTable(table, group_id, ObjectKeys(payload_prefix(group_id), table.objects))
