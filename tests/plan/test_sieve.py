"""Sieved spans: a TP-split pack of small tensors is read a few spans at a time, each span
pushed whole to the node's other consumers and copied out locally; every byte still lands
once, where it belongs, and the validator refuses copies that break the contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.common import synthetic_model
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import TensorSpec, build_manifest
from mooncake_rl.generations.checksums import BLOCK_BYTES
from mooncake_rl.generations.packing import pack_layout
from mooncake_rl.plan import RoutingTable, validate_routing_table
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.sieve import SIEVE_MIN_GAIN, SIEVE_PIECE_BYTES
from mooncake_rl.plan.synthetic import shard_bytes, simulated_engines
from mooncake_rl.plan.update import RoutingCache, plan_update


def _packed(tensors: int, total: int):
    model = synthetic_model(total, tensors)
    specs = [TensorSpec.of(name, t, "bfloat16") for name, t in model]
    rows = [(s.name, s.nbytes, s.dtype, 0) for s in specs]
    return model, specs, build_manifest("m", 1, specs, "x", pack_layout(rows, 128 << 20))


def _plan(tensors: int, tp: int, total: int = 8 << 20, batch: int = 64 << 20):
    model, specs, manifest = _packed(tensors, total)
    engines = simulated_engines(specs, [("node0", tp)], "direct")
    plan = plan_update(manifest, engines, "direct", batch, RoutingCache())
    return model, manifest, engines, plan


def _run(table: RoutingTable, manifest, model) -> dict[tuple[int, str], bytearray]:
    """The table on real bytes: reads, stage 1 pushes, barrier, stage 2 pushes (copies)."""
    objects: dict[str, bytearray] = {}
    raw = {name: t.view(torch.int16).numpy().tobytes() for name, t in model}
    for f in manifest.fragments:
        key = f.object_key.split("/payload/", 1)[1]  # the name relative to the generation
        data = raw[f.tensor_id]
        obj = objects.setdefault(key, bytearray())
        end = f.object_offset + len(data)
        obj.extend(b"\0" * max(0, end - len(obj)))
        obj[f.object_offset : end] = data
    sizes = {
        (int(r["worker"]), table.regions[int(r["region"])]): int(r["size"])
        for r in table.region_sizes
    }
    mem = {k: bytearray(v) for k, v in sizes.items()}

    def rows(offset, stride, length, count):
        return [(int(offset) + k * int(stride), int(length)) for k in range(int(count))]

    def move(src: bytearray, dst: bytearray, record) -> None:
        for (s, n), (d, _) in zip(
            rows(record["src_offset"], record["src_stride"], record["length"], record["count"]),
            rows(record["dst_offset"], record["dst_stride"], record["length"], record["count"]),
            strict=True,
        ):
            dst[d : d + n] = src[s : s + n]

    for r in table.reads:
        dst = mem[int(r["worker"]), table.regions[int(r["dst_region"])]]
        move(objects[table.objects[int(r["object"])]], dst, r)
    for stage in (1, 2):
        for p in table.pushes[table.pushes["stage"] == stage]:
            src = mem[int(p["worker"]), table.regions[int(p["src_region"])]]
            move(src, mem[int(p["peer"]), table.regions[int(p["dst_region"])]], p)
    return mem


@settings(max_examples=8, deadline=None)
@given(st.integers(40, 400), st.sampled_from([1, 2, 4]))
def test_a_sieved_pack_lands_every_shard_exactly(tensors: int, tp: int) -> None:
    model, manifest, engines, plan = _plan(tensors, tp)
    table = plan.routing.table
    mem = _run(table, manifest, model)
    expected = shard_bytes(engines, dict(model))
    ids = table.worker_ids
    for worker, regions in expected.items():
        for region, want in regions.items():
            got = mem[ids[worker], region]
            assert bytes(got[: len(want)]) == want, (worker, region)
    totals = table.totals
    assert totals.store_read_bytes == sum(t.numel() * 2 for _, t in model)  # each byte once
    assert int(totals.delivered_bytes.sum()) == table.lower_bound_bytes


def test_five_thousand_tp2_shards_take_a_read_per_span_not_per_shard() -> None:
    """5,000 small tensors in one pack, TP2 on one node: each rank's 5,000 shards interleave
    with the other's, so unsieved each rank would make 5,000 ranged reads. Sieved, the node
    reads each 4 MiB block once (the large tensor stays two ranges, one per rank), pushes
    each span once to the other rank, and each rank copies its 5,000 shards out locally."""
    model, _, _, plan = _plan(5000, 2, total=64 << 20)
    table = plan.routing.table
    small = sum(t.numel() * 2 for name, t in model if name != "w0")
    spans = -(-small // BLOCK_BYTES)
    assert len(table.reads) <= spans + 2 + 1  # + the large tensor's halves (+ a cut span)
    local = table.pushes["peer"] == table.pushes["worker"]
    # The reader copies its shards out as its read lands, the other rank after the barrier.
    stages = table.pushes["stage"][local]
    assert int((stages == 1).sum()) >= 4999 - 2 and int((stages == 2).sum()) >= 4999 - 2
    assert int(local.sum()) >= 2 * 4999  # every small shard of both ranks, once
    remote = table.pushes[~local]
    assert len(remote) == len(table.reads) - 2  # each span once to the other rank
    # A span is whole checksum blocks where the pack is dense (so every byte is checked).
    lengths = table.reads["length"] * table.reads["count"]
    assert int((lengths == BLOCK_BYTES).sum()) >= len(lengths) - 3
    # Local copies are no traffic: the pushed bytes are the spans.
    assert table.totals.intra_node_push_bytes == int((remote["length"] * remote["count"]).sum())


def test_few_pieces_per_consumer_are_read_as_before() -> None:
    """A tensor split over TP ranks, one object each: as many pieces as consumers, nothing to
    gain, so each rank reads its own shard (no staging, no copies)."""
    _, _, _, plan = _plan(2 * SIEVE_MIN_GAIN - 1, 2, total=1 << 20)
    table = plan.routing.table
    assert not (table.pushes["peer"] == table.pushes["worker"]).any()


def test_large_pieces_are_not_sieved() -> None:
    _, _, _, plan = _plan(40, 2, total=40 * 4 * SIEVE_PIECE_BYTES)
    table = plan.routing.table
    assert not (table.pushes["peer"] == table.pushes["worker"]).any()


def _copy_index(table: RoutingTable) -> int:
    local = np.flatnonzero(table.pushes["peer"] == table.pushes["worker"])
    assert len(local)
    return int(local[0])


def _corrupt(table: RoutingTable, i: int, **changes) -> RoutingTable:
    pushes = table.pushes.copy()
    for name, value in changes.items():
        pushes[i][name] = value
    fields = {f: getattr(table, f) for f in table.__dataclass_fields__}
    return RoutingTable(**(fields | {"pushes": pushes}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: {"dst_region": 0}, "targets the staging region"),
        # another shard's bytes
        (lambda p: {"src_offset": int(p["src_offset"]) + 1}, "no demand maps to that place"),
        # more than the span it copies from holds
        (
            lambda p: dict.fromkeys(("length", "src_stride", "dst_stride"), 8 * BLOCK_BYTES),
            "past the end|no earlier write landed",
        ),
        (lambda p: {"dst_offset": int(p["dst_offset"]) + 2}, "runs past the end of region"),
        (lambda p: {"stage": 3}, "malformed push|not in worker/stage/batch order"),
    ],
)
def test_the_validator_refuses_a_broken_copy(change, message) -> None:
    _, _, _, plan = _plan(200, 2)
    table = plan.routing.table
    i = _copy_index(table)
    with pytest.raises(InvariantViolation, match=message):
        validate_routing_table(_corrupt(table, i, **change(table.pushes[i])))


def test_sieving_keeps_within_one_chunk_and_batch_whatever_the_params() -> None:
    """Spans stay one chunk and one batch even with small batches (the copies then have one
    landing to come from): the plan validates and runs exactly."""
    model, specs, manifest = _packed(300, 2 << 20)
    engines = simulated_engines(specs, [("node0", 2)], "direct")
    for batch in (64 << 10, 256 << 10, 1 << 20):
        plan = plan_update(manifest, engines, "direct", batch, RoutingCache())
        table = plan.routing.table
        assert (table.reads["length"] * table.reads["count"] <= max(batch, 1 << 20)).all()
        mem = _run(table, manifest, model)
        for worker, regions in shard_bytes(engines, dict(model)).items():
            for region, want in regions.items():
                assert bytes(mem[table.worker_ids[worker], region][: len(want)]) == want
    assert PlanParams().min_chunk_bytes >= BLOCK_BYTES
