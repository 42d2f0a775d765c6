"""Publisher assignment, manifests and GC planning: pure functions, exact answers."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_ext.receiver import PrepareRequest, ServedRecord
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations import TensorSpec, TrainerTopology, assign_publishers, build_manifest
from mooncake_rl.generations.gc import plan_gc
from mooncake_rl.generations.layout import layout_digest
from mooncake_rl.generations.registry import ActiveRecord, FenceError, GenerationIndex, seal

sizes_strategy = st.lists(st.integers(1, 10_000), min_size=1, max_size=80)
topology_strategy = st.lists(st.sampled_from(["n0", "n1", "n2"]), min_size=1, max_size=8).map(
    lambda nodes: TrainerTopology(tuple(nodes))
)


@given(sizes_strategy, topology_strategy)
def test_assignment_is_deterministic_and_node_balanced(
    sizes: list[int], topology: TrainerTopology
) -> None:
    named = [(f"t{i}", size) for i, size in enumerate(sizes)]
    first = assign_publishers(named, topology)
    assert first == assign_publishers(named, topology)
    assert set(first) == {name for name, _ in named}
    per_node: dict[str, int] = dict.fromkeys(set(topology.nodes_by_rank), 0)
    per_rank: dict[int, int] = dict.fromkeys(range(topology.world_size), 0)
    for name, size in named:
        per_node[topology.node_of(first[name])] += size
        per_rank[first[name]] += size
    # Greedy on the least-loaded node: totals differ by at most the largest tensor.
    assert max(per_node.values()) - min(per_node.values()) <= max(sizes)
    for node in per_node:
        ranks = [r for r in per_rank if topology.node_of(r) == node]
        loads = [per_rank[r] for r in ranks]
        assert max(loads) - min(loads) <= max(sizes)


def test_assignment_worked_example() -> None:
    topology = TrainerTopology(("a", "a", "b"))
    got = assign_publishers([("x", 10), ("y", 4), ("z", 4), ("w", 3)], topology)
    # x -> node a (tie, label order) rank 0; y -> b rank 2; z -> b (4 < 10) rank 2; w -> b (8<10)
    assert got == {"x": 0, "y": 2, "z": 2, "w": 2}


def test_assignment_refuses_duplicates_and_bad_sizes() -> None:
    with pytest.raises(InvariantViolation, match="duplicate tensor name 'x'"):
        assign_publishers([("x", 1), ("x", 2)], TrainerTopology.single())
    with pytest.raises(InvariantViolation, match="positive"):
        assign_publishers([("x", 0)], TrainerTopology.single())


def test_manifest_has_one_object_per_tensor_under_the_group() -> None:
    specs = [TensorSpec("a.weight", (4, 8), "bfloat16"), TensorSpec("b", (3,), "float32")]
    manifest = build_manifest("m", 7, specs, "2026-11-30T00:00:00+00:00")
    assert manifest.group_id == "mooncake-rl/m/g000000000007"
    assert manifest.manifest_key == "mooncake-rl/m/g000000000007/manifest"
    assert [f.object_key for f in manifest.fragments] == [
        "mooncake-rl/m/g000000000007/payload/a.weight",
        "mooncake-rl/m/g000000000007/payload/b",
    ]
    assert [f.nbytes for f in manifest.fragments] == [64, 12]
    again = build_manifest("m", 7, specs, "2026-11-30T00:00:00+00:00")
    assert again.manifest_digest == manifest.manifest_digest


@pytest.mark.parametrize(
    "specs,message",
    [
        ([], "empty model"),
        (
            [TensorSpec("a", (1,), "float32"), TensorSpec("a", (2,), "float32")],
            "duplicate tensor name",
        ),
    ],
)
def test_manifest_bad_input(specs: list[TensorSpec], message: str) -> None:
    with pytest.raises(InvariantViolation, match=message):
        build_manifest("m", 1, specs, "now")


def test_unknown_dtype_and_bad_names() -> None:
    with pytest.raises(InvariantViolation, match="unknown rollout dtype 'int4'"):
        TensorSpec("a", (1,), "int4")
    with pytest.raises(InvariantViolation, match="model name"):
        build_manifest("bad/name", 1, [TensorSpec("a", (1,), "float32")], "now")


def test_plan_gc_keeps_newest_active_and_leased() -> None:
    assert plan_gc([1, 2, 3, 4, 5], active=5, leased=[1], keep=2) == [2, 3]
    assert plan_gc([1, 2, 3], active=1, leased=[], keep=1) == [2]
    assert plan_gc([], active=None, leased=[], keep=2) == []
    with pytest.raises(InvariantViolation):
        plan_gc([1], active=None, leased=[], keep=0)


def record_for(manifest, fence: int, previous: int | None = None, at: float = 0.0):
    return ActiveRecord(
        "m", manifest.weight_generation, manifest.manifest_key, manifest.manifest_digest,
        layout_digest(manifest), "c" * 32, "0123456789abcdef", fence,
        manifest.weight_generation, previous, at, 1, 64, manifest.created_at,
    )  # fmt: skip


def test_active_record_carries_the_layout_digest() -> None:
    """Announce seals the layout digest into the record; a record of another format (or a
    forged digest) is refused, naming what is wrong."""
    specs = [TensorSpec("a", (4, 8), "bfloat16")]
    one, two = build_manifest("m", 1, specs, "now"), build_manifest("m", 2, specs, "later")
    assert layout_digest(one) == layout_digest(two)
    assert layout_digest(build_manifest("m", 1, [TensorSpec("a", (8, 4), "bfloat16")], "x")) != (
        layout_digest(one)
    )
    record = record_for(one, 1)
    assert ActiveRecord.decode(record.encode()) == record
    old = seal({"model": "m", "generation": 1, "manifest_key": one.manifest_key,
                   "manifest_digest": one.manifest_digest})  # fmt: skip
    with pytest.raises(FenceError, match="active record has unexpected fields"):
        ActiveRecord.decode(old)
    with pytest.raises(FenceError, match="layout digest"):
        replace(record, layout_digest="abc")
    forged = seal({**asdict(record), "layout_digest": "Z" * 64})
    with pytest.raises(FenceError, match="layout digest"):
        ActiveRecord.decode(forged)


def test_index_folds_fence_records_in_order_and_dates_retirement() -> None:
    """Fence records fold into the index idempotently; the generation a record replaced is
    retired at that record's time, and an activated one is active (not retired) again."""
    specs = [TensorSpec("a", (4, 8), "bfloat16")]
    m = {g: build_manifest("m", g, specs, f"t{g}") for g in (1, 2, 3)}
    records = [
        record_for(m[1], 1, None, 10.0),
        record_for(m[2], 2, 1, 20.0),
        record_for(m[3], 3, 2, 30.0),
        replace(record_for(m[1], 4, 3, 40.0), newest=3),
    ]
    index = GenerationIndex(0, ()).with_records(records)
    assert index.through_fence == 4
    retired = {i.generation: i.retired_at for i in index.generations}
    assert retired == {1: None, 2: 30.0, 3: 40.0}
    assert index.with_records(records) == index
    assert GenerationIndex.decode(index.encode()) == index
    partial = GenerationIndex(0, ()).with_records(records[:2]).with_records(records)
    assert partial == index


def test_served_record_orders_by_fence_within_an_incarnation() -> None:
    served = ServedRecord(5, 7, "0123456789abcdef")

    def request(generation: int, fence: int, incarnation: str | None) -> PrepareRequest:
        return PrepareRequest(
            session="a" * 32, model="m", generation=generation, manifest_digest="ab" * 32,
            mode="compat", stages=0, workers={}, fence=fence, incarnation=incarnation,
        )  # fmt: skip

    assert served.superseded_by(request(4, 8, "0123456789abcdef"))  # activate moved back
    assert not served.superseded_by(request(6, 7, "0123456789abcdef"))
    assert served.superseded_by(request(1, 1, "fedcba9876543210"))  # a new master's numbering
    assert ServedRecord().superseded_by(request(1, 1, "fedcba9876543210"))
    assert not ServedRecord(3).superseded_by(request(3, 0, None))
