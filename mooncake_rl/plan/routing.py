"""Routing table: per worker, byte-bounded batches of reads and pushes, in two stages.

Stage 0: each reader reads its ranges into its own destination, pushes them to the other
consumers on its node, and sends ONE copy to one consumer (the entry) on every other
consumer node. Stage 1 (after the coordinator's barrier): each entry fans the bytes out to
the remaining consumers on its node. A range consumed on k nodes therefore crosses NICs
k - 1 times, however many workers consume it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise

from mooncake_rl.apply.executor import Batch, PushOp, ReadOp
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan.assign import Assignment, Topology
from mooncake_rl.plan.demand import Demand

STAGES = 2


@dataclass(frozen=True)
class RoutingTable:
    """Batches per worker per stage; ops name objects relative to the generation."""

    stages: Mapping[str, tuple[tuple[Batch, ...], ...]]

    def batches(self, worker: str) -> tuple[tuple[Batch, ...], ...]:
        return self.stages.get(worker, ((),) * STAGES)

    def ops(self) -> Iterable[tuple[str, int, Batch]]:
        for worker, stages in self.stages.items():
            for stage, batches in enumerate(stages):
                for batch in batches:
                    yield worker, stage, batch

    @property
    def store_read_bytes(self) -> int:
        return sum(op.length for _, _, b in self.ops() for op in b.reads)

    def received_bytes(self) -> dict[str, int]:
        """Bytes landing in each worker's regions: its own reads plus pushes into it."""
        received: dict[str, int] = defaultdict(int)
        for worker, _, batch in self.ops():
            received[worker] += sum(op.length for op in batch.reads)
            for op in batch.pushes:
                received[op.peer] += op.length
        return dict(received)

    def pushed_bytes(self, topology: Topology) -> tuple[int, int]:
        """(cross-node, intra-node) pushed bytes."""
        cross = intra = 0
        for worker, _, batch in self.ops():
            for op in batch.pushes:
                if topology.node_of[op.peer] == topology.node_of[worker]:
                    intra += op.length
                else:
                    cross += op.length
        return cross, intra


def _batched(
    items: list[tuple[ReadOp | None, list[PushOp]]], batch_bytes: int
) -> tuple[Batch, ...]:
    batches: list[Batch] = []
    reads: list[ReadOp] = []
    pushes: list[PushOp] = []
    size = 0
    for read, item_pushes in items:
        length = read.length if read else sum(p.length for p in item_pushes)
        if (reads or pushes) and size + length > batch_bytes:
            batches.append(Batch(tuple(reads), tuple(pushes)))
            reads, pushes, size = [], [], 0
        if read:
            reads.append(read)
        pushes.extend(item_pushes)
        size += length
    if reads or pushes:
        batches.append(Batch(tuple(reads), tuple(pushes)))
    return tuple(batches)


def build_routing(
    assignments: Iterable[Assignment], topology: Topology, batch_bytes: int
) -> RoutingTable:
    stage0: dict[str, list[tuple[ReadOp | None, list[PushOp]]]] = defaultdict(list)
    stage1: dict[str, list[tuple[ReadOp | None, list[PushOp]]]] = defaultdict(list)
    for assignment in assignments:
        piece, reader = assignment.range, assignment.reader
        node = topology.node_of[reader]
        own = next(c for c in piece.consumers if c.worker == reader)
        read = ReadOp(piece.obj, piece.start, own.region, own.dst_offset, piece.length)
        by_node: dict[str, list] = defaultdict(list)
        for consumer in piece.consumers:
            if consumer is not own:
                by_node[topology.node_of[consumer.worker]].append(consumer)
        pushes = [
            PushOp(c.worker, own.region, own.dst_offset, c.region, c.dst_offset, piece.length)
            for c in by_node.pop(node, [])
        ]
        for remote in sorted(by_node):
            entry, *rest = by_node[remote]
            pushes.append(
                PushOp(
                    entry.worker,
                    own.region,
                    own.dst_offset,
                    entry.region,
                    entry.dst_offset,
                    piece.length,
                )
            )
            if rest:
                stage1[entry.worker].append(
                    (
                        None,
                        [
                            PushOp(
                                c.worker,
                                entry.region,
                                entry.dst_offset,
                                c.region,
                                c.dst_offset,
                                piece.length,
                            )
                            for c in rest
                        ],
                    )
                )
        stage0[reader].append((read, pushes))
    workers = sorted(set(stage0) | set(stage1))
    return RoutingTable(
        {
            w: (_batched(stage0.get(w, []), batch_bytes), _batched(stage1.get(w, []), batch_bytes))
            for w in workers
        }
    )


def _disjoint_union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _covered(intervals: list[tuple[int, int]], start: int, end: int) -> bool:
    """Is [start, end) inside the (disjoint, sorted) union?"""
    index = bisect_right(intervals, (start, float("inf"))) - 1
    return index >= 0 and intervals[index][0] <= start and end <= intervals[index][1]


def validate_routing(
    table: RoutingTable,
    demands: Iterable[Demand],
    object_sizes: Mapping[str, int],
    topology: Topology,
) -> None:
    """Coverage exactly once, no overlapping writes, reads in bounds, stage order respected."""
    wanted: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    for d in demands:
        wanted[(d.worker, d.region)].append((d.dst_offset, d.dst_offset + d.length))
    wanted_union = {k: _disjoint_union(v) for k, v in wanted.items()}
    writes: dict[tuple[str, str], list[tuple[int, int, int]]] = defaultdict(list)
    for worker, stage, batch in table.ops():
        if worker not in topology.node_of:
            raise InvariantViolation(f"routing names unknown worker {worker}")
        for read in batch.reads:
            size = object_sizes.get(read.key)
            if size is None or read.src_offset + read.length > size:
                raise InvariantViolation(
                    f"read [{read.src_offset}, +{read.length}) outside object {read.key!r} "
                    f"of {size} bytes"
                )
            writes[(worker, read.region)].append(
                (read.dst_offset, read.dst_offset + read.length, stage)
            )
        for push in batch.pushes:
            writes[(push.peer, push.dst_region)].append(
                (push.dst_offset, push.dst_offset + push.length, stage + 1)
            )
    for (worker, region), spans in writes.items():
        spans.sort()
        for (_, a_end, _), (b_start, _, _) in pairwise(spans):
            if b_start < a_end:
                raise InvariantViolation(f"overlapping writes into {worker}:{region} at {b_start}")
        union = wanted_union.get((worker, region), [])
        for start, end, _ in spans:
            if not _covered(union, start, end):
                raise InvariantViolation(
                    f"write [{start}, {end}) into {worker}:{region} was not demanded"
                )
    for key, union in wanted_union.items():
        written = sum(end - start for start, end, _ in writes.get(key, []))
        demanded = sum(end - start for start, end in union)
        if written != demanded:
            raise InvariantViolation(
                f"{key[0]}:{key[1]} receives {written} of {demanded} demanded bytes "
                "(uncovered bytes)"
            )
    # A push may only send bytes its worker already holds: read earlier in this stage, or
    # landed in an earlier stage.
    for worker, stage, batch in table.ops():
        for push in batch.pushes:
            held = [(s, e) for s, e, landed in writes[(worker, push.src_region)] if landed <= stage]
            if not _covered(_disjoint_union(held), push.src_offset, push.src_offset + push.length):
                raise InvariantViolation(
                    f"{worker} pushes {push.src_region}@{push.src_offset} "
                    "before holding those bytes"
                )
