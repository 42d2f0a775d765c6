"""Rank-major packs: the order learnt from engines, the pieces a pack is laid out by, and
rank-major generations end to end on a real master (published, loaded whole, delivered by
the broadcast source, verified, and a corrupted run named)."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import TensorSpec
from mooncake_rl.generations.checksums import ChecksumTable, ObjectChecksum
from mooncake_rl.generations.commands import verify_generation
from mooncake_rl.generations.keys import pack_order_key
from mooncake_rl.generations.pack_order import (
    PackOrder,
    RowBlocks,
    load_pack_order,
    piece_placements,
    rank_major,
    rank_major_packs,
    run_starts,
    save_pack_order,
)
from mooncake_rl.generations.packing import object_extents, pack_layout
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.source import Source, read_buckets
from tests.conftest import settings_for


def _worker(rank: int, shards: list[tuple[str, tuple, tuple, tuple]]) -> dict:
    return {
        "worker_id": f"e/tp{rank}",
        "tp_rank": rank,
        "shards": [
            {"tensor": n, "global_shape": list(g), "global_offset": list(o), "local_shape": list(s)}
            for n, g, o, s in shards
        ],
    }


def test_the_order_keeps_row_cuts_and_single_owners_and_drops_the_rest() -> None:
    engine = [
        _worker(
            0,
            [
                ("rows", (8, 4), (0, 0), (4, 4)),  # column-parallel: rows split
                ("cols", (8, 4), (0, 0), (8, 2)),  # row-parallel: columns split
                ("norm", (4,), (0,), (4,)),  # replicated
                ("expert.0", (2, 2), (0, 0), (2, 2)),  # EP: owned whole by rank 0
            ],
        ),
        _worker(
            1,
            [
                ("rows", (8, 4), (4, 0), (4, 4)),
                ("cols", (8, 4), (0, 2), (8, 2)),
                ("norm", (4,), (0,), (4,)),
                ("expert.1", (2, 2), (0, 0), (2, 2)),
            ],
        ),
    ]
    smaller = [_worker(0, [("rows", (8, 4), (0, 0), (8, 4))])]
    order = PackOrder.of_engines({"http://b": engine, "http://a": smaller, "http://c": []})
    assert dict(order.tensors) == {
        "rows": RowBlocks(8, (0, 4), (0, 1)),
        "expert.0": RowBlocks(2, (0,), (0,)),
        "expert.1": RowBlocks(2, (0,), (1,)),
    }
    assert PackOrder.decode(order.encode()) == order
    assert PackOrder.of_engines({"http://a": [{"worker_id": "x"}]}).tensors == {}


def test_row_blocks_are_validated() -> None:
    for starts, ranks in [
        ((1, 4), (0, 1)),
        ((0, 4, 4), (0, 1, 2)),
        ((0, 8), (0, 1)),
        ((0,), (-1,)),
    ]:
        with pytest.raises(Exception, match="malformed row blocks"):
            RowBlocks(8, starts, ranks)


contents = st.lists(
    st.tuples(st.integers(1, 12), st.integers(1, 5), st.integers(0, 3), st.booleans()),
    min_size=1,
    max_size=25,
)


@given(contents, st.integers(1, 4))
def test_rank_major_pieces_cover_the_pack_once_each_rank_one_run(rows_list, tp: int) -> None:
    """Whatever the pack's tensors and the order: the pieces tile the pack on both sides,
    move each tensor's rows whole, and put every rank's rows in one run, ranks in order."""
    layout, tensors, offset = [], {}, 0
    for i, (rows, width, owner, split) in enumerate(rows_list):
        name = f"t{i}"
        nbytes = rows * width * 2
        layout.append((name, (rows, width), offset, nbytes))
        offset += nbytes
        cuts = sorted({rows * k // tp for k in range(tp)})
        if split and len(cuts) > 1:
            tensors[name] = RowBlocks(rows, tuple(cuts), tuple(range(len(cuts))))
        elif owner < tp:
            tensors[name] = RowBlocks(rows, (0,), (owner,))
    pieces = rank_major(layout, PackOrder(tensors))
    for side in ("source", "target"):
        spans = sorted((getattr(p, side), getattr(p, side) + p.nbytes) for p in pieces)
        assert [s for s, _ in spans] == [0, *(e for _, e in spans[:-1])]
        assert spans[-1][1] == offset
    by_name = {name: (shape, start, nbytes) for name, shape, start, nbytes in layout}
    for piece in pieces:
        shape, start, nbytes = by_name[piece.tensor]
        first, end = piece.rows or (0, shape[0])
        row_bytes = nbytes // shape[0]
        assert (piece.source, piece.nbytes) == (
            start + first * row_bytes,
            (end - first) * row_bytes,
        )
    ranks = [_rank_of(p, tensors) for p in pieces]
    assert ranks == sorted(ranks)  # each rank one run, in rank order, unordered tensors last


def _rank_of(piece, tensors) -> int:
    blocks = tensors.get(piece.tensor)
    if blocks is None:
        return 1 << 62
    first = piece.rows[0] if piece.rows else 0
    return blocks.ranks[blocks.starts.index(first)]


def test_a_tensor_whose_rows_changed_keeps_one_fragment() -> None:
    order = PackOrder({"t": RowBlocks(8, (0, 4), (0, 1))})
    pieces = rank_major([("t", (6, 2), 0, 24)], order)
    assert [(p.rows, p.source, p.target) for p in pieces] == [(None, 0, 0)]


def _model() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(9)
    shapes = {"a": (8, 16), "norm": (3, 5), "b": (4, 6), "c": (16, 8), "big": (1100, 1024)}
    return [(n, torch.randn(s, generator=generator)) for n, s in shapes.items()]


@pytest.fixture(scope="module")
def store(master: EmbeddedMaster):
    with StoreClient(settings_for(master, "pack-order")) as client:
        yield client


def test_a_rank_major_generation_loads_delivers_and_verifies_whole_tensors(store) -> None:
    model, tensors = "rank-major-loaded", _model()
    specs = [TensorSpec.of(n, t, "float32") for n, t in tensors]
    order = PackOrder.of_engines(simulated_engines(specs, [("n", 2)], "direct"))
    assert save_pack_order(store, model, order)
    assert not save_pack_order(store, model, order)  # unchanged: no second write
    assert load_pack_order(store, model) == order
    publish_local(store, model, tensors, dtype="float32", pack_bytes=1 << 20, keep=None)
    manifest = GenerationRegistry(store, model).load_active_manifest()
    pack = next(o for o in object_extents(manifest).values() if len(o.fragments) > 1)
    # Rank 0's rows of a, b and c, then rank 1's, then the norm (replicated: not cut).
    assert [(f.fragment_id, f.object_offset) for f in pack.fragments] == [
        ("a[0:4]", 0),
        ("b[0:2]", 256),
        ("c[0:8]", 304),
        ("a[4:8]", 560),
        ("b[2:4]", 816),
        ("c[8:16]", 864),
        ("norm", 1120),
    ]
    record = GenerationRegistry(store, model).active()
    # The simulator's layout (pack_layout, then rank_major_packs) is the publisher's.
    rows = [(s.name, s.nbytes, s.dtype, 0) for s in specs]
    shapes = [(s.name, s.shape, s.nbytes) for s in specs]
    packs = rank_major_packs(pack_layout(rows, 1 << 20), shapes, order)
    simulated = piece_placements(packs)
    stored = {(f.tensor_id, f.object_offset, f.fragment_id) for f in pack.fragments}
    assert stored == {
        (name, p.offset, p.fragment_id(name)) for name, ps in simulated.items() for p in ps
    }
    checksums = (
        GenerationRegistry(store, model)
        .load_checksums(record.generation, record.checksums_digest)
        .objects
    )
    assert checksums[pack.key].cuts == (560, 1120)  # where rank 1's run and the rest start
    assert [run_starts(pieces) for pieces in packs.values()] == [[560, 1120]]  # the simulator's
    expected = {name: t.numpy().tobytes() for name, t in tensors}
    _, loaded = active_weights(store, model)
    assert {name: t.numpy().tobytes() for name, t in loaded} == expected
    _, buckets = read_buckets(store, Source.of(record, bucket_bytes=4096))
    delivered = {n: t.numpy().tobytes() for _, ts in buckets for n, t in ts.items()}
    assert delivered == expected
    assert verify_generation(store, model)["ok"]

    size = store.size(pack.key)
    data = bytearray(store.get_bytes(pack.key))
    data[600] ^= 0xFF  # inside rank 1's rows of a
    assert not store.remove([pack.key], force=True)
    store.put_bytes(pack.key, bytes(data))
    assert len(data) == size
    assert verify_generation(store, model)["problems"] == [
        f"corrupted {pack.key}: its bytes differ from the published checksum"
    ]
    _, loaded = active_weights(store, model)
    with pytest.raises(Exception, match=re.escape(f"object {pack.key} does not match")):
        dict(loaded)


def test_an_unreadable_stored_order_is_ignored_and_packs_stay_tensor_major(
    store, caplog: pytest.LogCaptureFixture
) -> None:
    model, tensors = "bad-order", _model()
    store.upsert_bytes(pack_order_key(model), b'{"version": 99, "tensors": {}}')
    with caplog.at_level(logging.WARNING):
        publish_local(store, model, tensors, dtype="float32", pack_bytes=1 << 20, keep=None)
    assert "ignoring the stored pack order of bad-order" in caplog.text
    manifest = GenerationRegistry(store, model).load_active_manifest()
    assert sorted(f.fragment_id for f in manifest.fragments) == sorted(n for n, _ in tensors)
    _, loaded = active_weights(store, model)
    assert {n: t.numpy().tobytes() for n, t in loaded} == {
        n: t.numpy().tobytes() for n, t in tensors
    }
    assert np.all([f.global_offset[0] == 0 for f in manifest.fragments])


def test_engines_that_cut_nothing_replace_a_stored_order_and_write_nothing_else(store) -> None:
    assert save_pack_order(store, "cleared", PackOrder({"t": RowBlocks(8, (0, 4), (0, 1))}))
    single = PackOrder.of_engines({"http://a": [_worker(0, [("t", (8, 4), (0, 0), (8, 4))])]})
    assert single.tensors == {}  # one worker reads every pack alone
    assert save_pack_order(store, "cleared", single)
    assert load_pack_order(store, "cleared") == single
    assert not save_pack_order(store, "never-ordered", single)
    assert load_pack_order(store, "never-ordered") is None


@pytest.mark.parametrize(
    "cuts", [(8, 4), (0,), (64,), (4, 4)], ids=["unordered", "zero", "end", "twice"]
)
def test_checksum_cuts_outside_the_object_or_out_of_order_are_refused(cuts) -> None:
    good = ObjectChecksum.of(bytes(64), (16, 32))
    assert good.cuts == (16, 32) and len(good.blocks) == 3
    with pytest.raises(InvariantViolation, match="malformed object checksum"):
        ObjectChecksum(64, good.whole, good.blocks[: len(cuts) + 1], cuts)
    row = json.dumps({"k": [64, good.whole, list(good.blocks[: len(cuts) + 1]), list(cuts)]})
    with pytest.raises(InvariantViolation, match="malformed object checksum"):
        ChecksumTable.decode(row.encode())
