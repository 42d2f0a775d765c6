"""Delta demand: which worker reads each delta entry from the Store, and whom it pushes to.

    each in-place worker's delta reads (:func:`mooncake_rl.apply.delta.delta_reads`)
        --entry_blocks (pure)--> the entries of every checksum block its boxes cover: its
        entry buffer's layout, blocks back to back in (object, block) order
    every worker's blocks + its node --plan_delta_fetch (pure)--> one WorkerSlice per worker:
        one stage of batches that read each entry from the Store once, into the buffer of
        one worker that needs it, and push it into the buffer of every other worker that does

Why plan it: engines that serve the same shards need the same entries. Read by each of
them, the Store would serve a delta's bytes once per engine; planned, it serves them once,
and the copies travel worker to worker like any planned push. Readers take runs of
consecutive entries (so their reads and pushes merge), each run the needing worker's whose
node has moved the fewest bytes so far (reads and pushes that leave the node), so NICs
share the load. The slices are the executor's own
(:class:`~mooncake_rl.apply.wire.WorkerSlice`, one region :data:`DELTA_REGION`), so they
travel, validate, coalesce and run as every other routing slice does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

from mooncake_rl.apply.executor import Batch, PushOp, ReadOp
from mooncake_rl.apply.wire import WorkerSlice
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.chain import DeltaTable, delta_key

DELTA_REGION = "delta_entries"
"""The region a worker receives delta entries in (read or pushed) before it decodes them."""


@dataclass(frozen=True, order=True)
class EntryBlock:
    """Block ``block`` of payload object ``key``: its entry is bytes ``start``..``end`` of
    the delta object ``delta_key(key)``."""

    key: str
    block: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.block < 0 or not 0 <= self.start < self.end:
            raise InvariantViolation(
                f"delta entry {self.key}#{self.block} spans {self.start}..{self.end}: not a "
                "non-empty range"
            )

    @property
    def length(self) -> int:
        return self.end - self.start


def entry_blocks(
    table: DeltaTable, spans: Sequence[tuple[str, int, int]]
) -> tuple[EntryBlock, ...]:
    """The entries of every block that the byte ranges ``spans`` (payload key, offset,
    length) touch, once each, in (object, block) order: a worker's entry buffer layout."""
    wanted: dict[str, set[int]] = defaultdict(set)
    for key, offset, length in spans:
        blocks = table.objects[key].spans()
        end = offset + length
        wanted[key].update(i for i, (s, e) in enumerate(blocks) if s < end and e > offset)
    out = []
    for key in sorted(wanted):
        entries = table.objects[key].entries()
        out.extend(EntryBlock(key, b, *entries[b]) for b in sorted(wanted[key]))
    return tuple(out)


def entry_offsets(blocks: Sequence[EntryBlock]) -> list[int]:
    """Where each block's entry starts in the buffer laid out by ``blocks``, then its size."""
    return list(accumulate((b.length for b in blocks), initial=0))


@dataclass(frozen=True)
class DeltaDemand:
    """Every in-place worker's node and entry blocks (its buffer layout, as
    :func:`entry_blocks` gives it)."""

    nodes: Mapping[str, str]
    blocks: Mapping[str, tuple[EntryBlock, ...]]

    def __post_init__(self) -> None:
        if set(self.nodes) != set(self.blocks):
            raise InvariantViolation("delta demand: every worker needs a node and its blocks")
        for worker, blocks in self.blocks.items():
            if list(blocks) != sorted(set(blocks)):
                raise InvariantViolation(
                    f"delta demand of {worker}: blocks must be unique and in (object, block) "
                    "order, the order its buffer is laid out in"
                )


def plan_delta_fetch(demand: DeltaDemand, batch_bytes: int) -> dict[str, WorkerSlice]:
    """One slice per worker of ``demand``: every distinct entry read from the Store by one
    worker that needs it and pushed to every other that does; a batch reads at most
    ``batch_bytes`` (one entry may exceed it alone), and carries the pushes of what it read.
    """
    if batch_bytes <= 0:
        raise InvariantViolation(f"batch_bytes must be positive, got {batch_bytes}")
    at: dict[str, dict[EntryBlock, int]] = {}
    holders: dict[EntryBlock, list[str]] = defaultdict(list)
    for worker in sorted(demand.blocks):
        blocks = demand.blocks[worker]
        at[worker] = dict(zip(blocks, entry_offsets(blocks)[:-1], strict=True))
        for block in blocks:
            holders[block].append(worker)
    ordered = sorted(holders)
    names = sorted(demand.blocks)
    index = {w: i for i, w in enumerate(names)}
    readers = choose_readers(
        [b.length for b in ordered],
        [tuple(index[w] for w in holders[b]) for b in ordered],
        [demand.nodes[w] for w in names],
        [b.key for b in ordered],
    )
    ops: dict[str, list[tuple[ReadOp, list[PushOp]]]] = defaultdict(list)
    for block, chosen in zip(ordered, readers, strict=True):
        reader = names[chosen]
        src = at[reader][block]
        read = ReadOp(delta_key(block.key), block.start, DELTA_REGION, src, block.length)
        pushes = [
            PushOp(w, DELTA_REGION, src, DELTA_REGION, at[w][block], block.length)
            for w in holders[block]
            if w != reader
        ]
        ops[reader].append((read, pushes))
    return {
        worker: WorkerSlice(
            {DELTA_REGION: max(entry_offsets(demand.blocks[worker])[-1], 1)},
            (_batched(ops.get(worker, []), batch_bytes),),
        )
        for worker in sorted(demand.blocks)
    }


RUN_BYTES = 8 << 20
"""Entries one reader takes in a row (consecutive blocks of one object that the same
workers need): its pushes to each of them merge into one write, and its reads into one
range. Per entry, readers would alternate and every push be a write of its own: about
10,000 writes per GPU for Kimi-K2 at 1 %, 0.5 s of per-write cost over TCP."""


def choose_readers(
    lengths: Sequence[int],
    needing: Sequence[Sequence[int]],
    node_of: Sequence[Hashable],
    objects: Sequence[Hashable],
) -> list[int]:
    """The reader of each entry (``lengths[i]`` bytes of object ``objects[i]``, needed by
    the workers ``needing[i]``, indices into ``node_of``), in order. Entries come in runs:
    consecutive entries of one object that the same workers need, up to :data:`RUN_BYTES`,
    share a reader. A run's reader is the needing worker whose node has moved the fewest
    bytes so far (what its workers read, and what they push to other nodes), then the one
    that read the fewest itself, then the first. Shared with ``bench simulate``, so the
    simulated delta moves exactly what this plans."""
    node_load: dict[Hashable, int] = defaultdict(int)
    worker_load: dict[int, int] = defaultdict(int)
    readers: list[int] = []
    run_bytes, last = 0, None
    for length, workers, obj in zip(lengths, needing, objects, strict=True):
        if (obj, workers) == last and run_bytes + length <= RUN_BYTES:
            reader = readers[-1]
            run_bytes += length
        else:
            reader = min(workers, key=lambda w: (node_load[node_of[w]], worker_load[w], w))
            run_bytes, last = length, (obj, workers)
        leaving = sum(1 for w in workers if node_of[w] != node_of[reader])
        node_load[node_of[reader]] += length * (1 + leaving)
        worker_load[reader] += length
        readers.append(reader)
    return readers


def _batched(ops: Sequence[tuple[ReadOp, list[PushOp]]], batch_bytes: int) -> tuple[Batch, ...]:
    batches: list[Batch] = []
    reads: list[ReadOp] = []
    pushes: list[PushOp] = []
    size = 0
    for read, pushed in ops:
        if reads and size + read.length > batch_bytes:
            batches.append(Batch(tuple(reads), tuple(pushes)))
            reads, pushes, size = [], [], 0
        reads.append(read)
        pushes.extend(pushed)
        size += read.length
    if reads:
        batches.append(Batch(tuple(reads), tuple(pushes)))
    return tuple(batches)
