"""Rank-major packs: each pack holds its tensors' row blocks grouped by the rank serving them.

    engines' boxes (the coordinator's survey) --PackOrder.of_engines--> row blocks per tensor
    coordinator: save_pack_order (a Store write only when the order changed)
    simulator: rank_major_packs over the pack layout publishers would make
    publisher: load_pack_order at publish; a full pack, tensors back to back
        --rank_major(pack contents, order)--> pieces (tensor rows, from, to)
    publisher: copies each piece into the outgoing pack; the manifest stores a fragment per piece

Why: a tensor-parallel engine splits most tensors by rows (column-parallel layers; under
EP each expert goes whole to one rank). Packed tensor after tensor, rank 0's half of tensor 1
sits between rank 1's halves of tensors 0 and 1, so no rank's bytes are contiguous: the
planner reads whole spans and pushes the other ranks' pieces over the node's fabric
(:mod:`mooncake_rl.plan.sieve`), TP - 1 extra crossings of the pack's bytes. In a
rank-major pack, rank r's rows of all the pack's tensors are one run: each rank reads its
own bytes, once, and nothing is pushed.

The order is learnt from the engines (the last direct-mode update that described their
boxes), so a publisher is never told the engines' parallelism; a compat or non-Store update
empties it (its receivers read whole tensors, which rank-major packs scatter), and with no
order packs go tensor after tensor as before. A tensor cut other than by rows (row-parallel
layers), held whole by several ranks (replicated), or whose shape changed keeps one
fragment, after every rank's rows. Pieces stay inside their pack, so a reader of whole
tensors (a restarted engine, broadcast) still reads each pack once.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mooncake_rl.errors import InvariantViolation, ObjectNotFound
from mooncake_rl.generations.keys import pack_order_key
from mooncake_rl.generations.packing import Placement
from mooncake_rl.store import StoreClient

logger = logging.getLogger(__name__)

ORDER_VERSION = 1
UNRANKED = 1 << 62
"""Sorts after every rank: tensors the order does not cut."""


@dataclass(frozen=True)
class RowBlocks:
    """How the engines cut one tensor: ``starts[i]`` is the first row of block ``i`` (the
    blocks tile ``rows``, in order), served by TP rank ``ranks[i]``."""

    rows: int
    starts: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if (
            self.rows < 1
            or not self.starts
            or self.starts[0] != 0
            or len(self.ranks) != len(self.starts)
            or any(b <= a for a, b in zip(self.starts, self.starts[1:], strict=False))
            or self.starts[-1] >= self.rows
            or min(self.ranks) < 0
        ):
            raise InvariantViolation(f"malformed row blocks {self}")

    def blocks(self) -> Iterable[tuple[int, int, int]]:
        """(rank, first row, end row) of each block."""
        ends = (*self.starts[1:], self.rows)
        return zip(self.ranks, self.starts, ends, strict=True)


@dataclass(frozen=True)
class PackOrder:
    """Row blocks by tensor name: what :func:`rank_major` lays packs out by."""

    tensors: Mapping[str, RowBlocks]

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))

    @classmethod
    def of_engines(cls, engines: Mapping[str, Sequence[Mapping[str, Any]]]) -> PackOrder:
        """The order the finest engine (most workers) cuts its tensors in, from its workers'
        ``shards`` (``GET /mooncake/placement`` replies). Any engine whose TP divides that
        one's also reads one run per pack: its rank holds consecutive finer ranks."""
        described = sorted((-len(ws), url) for url, ws in engines.items() if _boxes(ws))
        if not described or described[0][0] == -1:  # one worker reads every pack alone
            return cls({})
        return cls.of_boxes(
            (
                int(worker.get("tp_rank", index)),
                shard["tensor"],
                tuple(shard["global_shape"]),
                tuple(shard["global_offset"]),
                tuple(shard["local_shape"]),
            )
            for index, worker in enumerate(engines[described[0][1]])
            for shard in worker.get("shards", ())
        )

    @classmethod
    def of_boxes(cls, boxes: Iterable[tuple[int, str, tuple, tuple, tuple]]) -> PackOrder:
        """The order of one engine's boxes: (rank, tensor, global shape, offset, local
        shape) each."""
        held: dict[str, list[tuple[int, int, int]]] = {}
        rows: dict[str, int] = {}
        cut_otherwise: set[str] = set()
        for rank, name, shape, offset, local in boxes:
            rows[name] = shape[0]
            if any(offset[1:]) or tuple(local[1:]) != tuple(shape[1:]):
                cut_otherwise.add(name)
            else:
                held.setdefault(name, []).append((offset[0], local[0], rank))
        tensors = {}
        for name, cuts in held.items():
            blocks = _tiling(sorted(set(cuts)), rows[name])
            if name not in cut_otherwise and blocks is not None:
                tensors[name] = blocks
        return cls(tensors)

    def encode(self) -> bytes:
        tensors = {n: [b.rows, list(b.starts), list(b.ranks)] for n, b in self.tensors.items()}
        return json.dumps({"version": ORDER_VERSION, "tensors": tensors}).encode()

    @classmethod
    def decode(cls, data: bytes) -> PackOrder:
        raw = json.loads(data)
        if raw.get("version") != ORDER_VERSION:
            raise InvariantViolation(f"pack order version {raw.get('version')!r} unknown")
        return cls({n: RowBlocks(r, tuple(s), tuple(k)) for n, (r, s, k) in raw["tensors"].items()})


def _boxes(workers: Sequence[Mapping[str, Any]]) -> bool:
    return any(w.get("shards") for w in workers)


def _tiling(boxes: Sequence[tuple[int, int, int]], rows: int) -> RowBlocks | None:
    """Row blocks if ``boxes`` (start, rows, rank), sorted, tile ``rows`` once each."""
    starts, ranks, cursor = [], [], 0
    for start, count, rank in boxes:
        if start != cursor:  # a gap, or the same rows on a second rank (replicated)
            return None
        starts.append(start)
        ranks.append(rank)
        cursor = start + count
    return RowBlocks(rows, tuple(starts), tuple(ranks)) if cursor == rows else None


@dataclass(frozen=True)
class Piece:
    """Bytes ``[source, source + nbytes)`` of a tensor-major pack go to ``target`` of its
    rank-major form: rows ``rows`` of ``tensor`` (``None``: the whole tensor), served by
    ``rank`` (``None``: the order does not say)."""

    tensor: str
    rows: tuple[int, int] | None
    source: int
    target: int
    nbytes: int
    rank: int | None = None


def run_starts(pieces: Sequence[Piece]) -> list[int]:
    """Where each rank's run (and the unranked tail) starts, past the first: the block cuts
    that let each rank check every byte it reads (``ObjectChecksum.cuts``)."""
    return [b.target for a, b in itertools.pairwise(pieces) if a.rank != b.rank]


def rank_major(
    contents: Sequence[tuple[str, tuple[int, ...], int, int]], order: PackOrder
) -> list[Piece]:
    """Pieces that lay out a pack of ``contents`` (name, shape, offset, bytes; back to back
    from 0) rank by rank, each rank's rows in pack order, then the tensors the order does
    not cut. Pure; the pieces cover the pack exactly once on both sides."""
    keyed: list[tuple[tuple[int, int], str, tuple[int, int] | None, int, int]] = []
    for position, (name, shape, offset, nbytes) in enumerate(contents):
        blocks = order.tensors.get(name)
        if blocks is None or blocks.rows != shape[0]:
            keyed.append(((UNRANKED, position), name, None, offset, nbytes))
            continue
        row_bytes = nbytes // shape[0]
        whole = len(blocks.starts) == 1
        for rank, first, end in blocks.blocks():
            rows = None if whole else (first, end)
            piece_bytes = (end - first) * row_bytes
            keyed.append(((rank, position), name, rows, offset + first * row_bytes, piece_bytes))
    keyed.sort(key=lambda k: k[0])
    pieces, cursor = [], 0
    for (rank, _), name, rows, source, nbytes in keyed:
        pieces.append(Piece(name, rows, source, cursor, nbytes, None if rank == UNRANKED else rank))
        cursor += nbytes
    return pieces


def rank_major_packs(
    placements: Mapping[str, Sequence[Placement]],
    specs: Iterable[tuple[str, tuple[int, ...], int]],
    order: PackOrder,
) -> dict[str, list[Piece]]:
    """The pieces each pack of ``placements`` (tensors packed one after another,
    ``packing.pack_layout``) is laid out by, rank by rank, as publishers with ``order`` lay
    it out; ``specs``: (name, shape, bytes) of every tensor. Pure: for planning and
    simulation (:func:`piece_placements`; a pack's :func:`run_starts` are its checksum cuts)."""
    by_pack: dict[str, list[tuple[str, tuple[int, ...], int, int]]] = {}
    for name, shape, nbytes in specs:
        placed = placements.get(name)
        if placed:
            by_pack.setdefault(placed[0].object_name, []).append(
                (name, shape, placed[0].offset, nbytes)
            )
    return {
        pack: rank_major(sorted(contents, key=lambda c: c[2]), order)
        for pack, contents in by_pack.items()
    }


def piece_placements(packs: Mapping[str, Sequence[Piece]]) -> dict[str, tuple[Placement, ...]]:
    """Where each tensor (or each of its row blocks) sits in ``packs``' pieces."""
    out: dict[str, list[Placement]] = {}
    for pack, pieces in packs.items():
        for piece in pieces:
            out.setdefault(piece.tensor, []).append(Placement(pack, piece.target, piece.rows))
    return {name: tuple(sorted(p, key=lambda p: p.rows or (0, 0))) for name, p in out.items()}


def load_pack_order(store: StoreClient, model: str) -> PackOrder | None:
    """The order the engines of ``model`` last described, or ``None`` (none yet, or one this
    version cannot read: packs are then laid out tensor after tensor, which is always valid)."""
    try:
        return PackOrder.decode(store.get_bytes(pack_order_key(model)))
    except ObjectNotFound:
        return None
    except (InvariantViolation, ValueError, KeyError, TypeError) as error:
        logger.warning("ignoring the stored pack order of %s: %s", model, error)
        return None


def save_pack_order(store: StoreClient, model: str, order: PackOrder) -> bool:
    """Store ``order`` for the next publish of ``model`` unless it is already there (on a
    durable Store every write is logged, and most updates describe the same engines). An
    empty order replaces a stored one (engines that no longer cut anything) and is
    otherwise not written."""
    data = order.encode()
    try:
        if store.get_bytes(pack_order_key(model)) == data:
            return False
    except ObjectNotFound:
        if not order.tensors:
            return False
    store.upsert_bytes(pack_order_key(model), data)
    return True
