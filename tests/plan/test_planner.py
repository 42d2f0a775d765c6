"""Planner properties on random models and topologies, checked by simulating the plan.

Every routing table is executed on byte arrays (reads from random object bytes, pushes in
stage and batch order) and each worker's regions are compared with the bytes its declared
shards must hold, computed independently with numpy slicing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import TensorSpec, build_manifest
from mooncake_rl.plan.demand import COMPAT_REGION, Demand, Shard, direct_demands
from mooncake_rl.plan.routing import validate_routing
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.plan.update import RoutingCache, plan_routing, plan_update

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@st.composite
def models(draw: Any) -> list[TensorSpec]:
    count = draw(st.integers(1, 12))
    specs = []
    for index in range(count):
        rank = draw(st.integers(1, 3))
        shape = tuple(draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12])) for _ in range(rank))
        specs.append(TensorSpec(f"t{index}", shape, draw(st.sampled_from(sorted(DTYPES)))))
    return specs


@st.composite
def clusters(draw: Any) -> list[tuple[str, int]]:
    """Engines as (node, tp size)."""
    return draw(
        st.lists(
            st.tuples(st.sampled_from(["n0", "n1", "n2", "n3"]), st.sampled_from([1, 2, 4])),
            min_size=1,
            max_size=4,
        )
    )


def object_bytes(specs: list[TensorSpec], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {s.name: rng.integers(0, 256, s.nbytes, dtype=np.uint8) for s in specs}


def simulate(plan: Any, objects: dict[str, np.ndarray]) -> dict[tuple[str, str], np.ndarray]:
    routing = plan.routing
    memory: dict[tuple[str, str], np.ndarray] = {
        (w, r): np.zeros(size, dtype=np.uint8)
        for w, regions in routing.regions.items()
        for r, size in regions.items()
    }
    for stage in range(2):
        for worker in sorted(routing.table.stages):
            for batch in routing.table.batches(worker)[stage]:
                for read in batch.reads:
                    memory[(worker, read.region)][
                        read.dst_offset : read.dst_offset + read.length
                    ] = objects[read.key][read.src_offset : read.src_offset + read.length]
                for push in batch.pushes:
                    memory[(push.peer, push.dst_region)][
                        push.dst_offset : push.dst_offset + push.length
                    ] = memory[(worker, push.src_region)][
                        push.src_offset : push.src_offset + push.length
                    ]
    return memory


def expected_shard(spec: TensorSpec, raw: np.ndarray, shard_json: dict) -> np.ndarray:
    tensor = raw.view(DTYPES[spec.dtype]).reshape(spec.shape)
    index = tuple(
        slice(o, o + n)
        for o, n in zip(shard_json["global_offset"], shard_json["local_shape"], strict=True)
    )
    return np.ascontiguousarray(tensor[index]).view(np.uint8).reshape(-1)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    models(),
    clusters(),
    st.sampled_from(["compat", "direct"]),
    st.sampled_from([16, 64, 1 << 20]),
    st.integers(0, 99),
)
def test_plans_deliver_exactly_the_demanded_bytes_reading_each_once(
    specs: list[TensorSpec], cluster: list[tuple[str, int]], mode: str, batch_bytes: int, seed: int
) -> None:
    manifest = build_manifest("m", 1, specs, "now")
    engines = simulated_engines(specs, cluster, mode)
    plan = plan_update(manifest, engines, mode, batch_bytes, RoutingCache())
    objects = object_bytes(specs, seed)
    memory = simulate(plan, objects)

    by_name = {s.name: s for s in specs}
    if mode == "compat":
        for worker in plan.routing.regions:
            for entry in plan.routing.layout:
                got = memory[(worker, COMPAT_REGION)][
                    entry["offset"] : entry["offset"] + by_name[entry["name"]].nbytes
                ]
                assert np.array_equal(got, objects[entry["name"]])
        demanded = {s.name for s in specs}
    else:
        demanded = set()
        for workers in engines.values():
            for worker in workers:
                for shard in worker["shards"]:
                    want = expected_shard(by_name[shard["tensor"]], objects[shard["tensor"]], shard)
                    assert np.array_equal(memory[(worker["worker_id"], shard["region"])], want)
                    demanded.add(shard["tensor"])
    # Single pull: reads equal the union of demanded source bytes, exactly.
    assert (
        plan.store_read_bytes
        == plan.unique_demand_bytes
        == sum(by_name[n].nbytes for n in demanded)
    )
    # Determinism: the same inputs give the same table.
    assert (
        plan_update(manifest, engines, mode, batch_bytes, RoutingCache()).routing.table
        == plan.routing.table
    )
    # Compat crosses each NIC boundary once per remote consumer node.
    nodes = {node for node, _ in cluster}
    if mode == "compat":
        cross, _ = plan.routing.table.pushed_bytes(plan.routing.topology)
        assert cross == plan.store_read_bytes * (len(nodes) - 1)
        # Balance: every node consumes everything, so greedy keeps each node within one
        # piece's fan-out cost of the mean.
        loads = plan.routing.node_nic_bytes
        mean = sum(loads.values()) / len(loads)
        assert max(loads.values()) <= mean + batch_bytes * len(nodes)


def test_cache_hit_recomputes_nothing_and_binds_the_new_generation() -> None:
    specs = [TensorSpec("a", (4, 4), "float32"), TensorSpec("b", (8,), "float16")]
    engines = simulated_engines(specs, [("n0", 2), ("n1", 1)], "direct")
    cache = RoutingCache()
    first = plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, cache)
    second = plan_update(build_manifest("m", 2, specs, "later"), engines, "direct", 64, cache)
    assert cache.misses == 1 and second.routing is first.routing
    keys = {
        op.key for stage in second.worker_slice("e0/tp0").stages for b in stage for op in b.reads
    }
    assert keys and all(k.startswith("mooncake-rl/m/g000000000002/payload/") for k in keys)


def test_worked_example_row_column_and_replicated_shards() -> None:
    """q (4x8, f32) split by rows, o (8x4) by columns, n (8,) replicated, TP=2."""
    manifest = build_manifest(
        "m",
        3,
        [
            TensorSpec("q", (4, 8), "float32"),
            TensorSpec("o", (8, 4), "float32"),
            TensorSpec("n", (8,), "float32"),
        ],
        "now",
    )
    shards = []
    for rank in range(2):
        worker = f"e/tp{rank}"
        shards += [
            Shard(worker, rank, "q", (2 * rank, 0), (2, 8), "qkv", 0),
            Shard(worker, rank, "o", (0, 2 * rank), (8, 2), "o", 0),
            Shard(worker, rank, "n", (0,), (8,), "n", 0),
        ]
    demands = sorted(direct_demands(manifest, shards, 2))
    rank1 = [d for d in demands if d.worker == "e/tp1"]
    # Rank 1 holds q rows 2..3 (bytes 64..127), o columns 2..3 of every row (8 bytes at
    # 8 + 16 * row), and the whole norm.
    assert Demand("q", 64, 64, "e/tp1", "qkv", 0) in rank1
    assert [d for d in rank1 if d.obj == "o"] == [
        Demand("o", 8 + 16 * r, 8, "e/tp1", "o", 8 * r) for r in range(8)
    ]
    assert Demand("n", 0, 32, "e/tp1", "n", 0) in rank1
    assert sum(d.length for d in demands) == 2 * (64 + 64 + 32)


def test_fused_qkv_and_gate_up_boxes_land_back_to_back() -> None:
    """Two checkpoint tensors stacked in one fused parameter, as vLLM's qkv/gate_up do."""
    specs = [TensorSpec("gate", (4, 2), "float32"), TensorSpec("up", (4, 2), "float32")]
    manifest = build_manifest("m", 1, specs, "now")
    shards = []
    for rank in range(2):
        worker = f"e/tp{rank}"
        shards += [
            Shard(worker, rank, "gate", (2 * rank, 0), (2, 2), "gate_up", 0),
            Shard(worker, rank, "up", (2 * rank, 0), (2, 2), "gate_up", 16),
        ]
    demands = sorted(direct_demands(manifest, shards, 2))
    assert [d for d in demands if d.worker == "e/tp1"] == [
        Demand("gate", 16, 16, "e/tp1", "gate_up", 0),
        Demand("up", 16, 16, "e/tp1", "gate_up", 16),
    ]


def test_experts_owned_by_one_rank_are_read_once_by_their_owner() -> None:
    """Under EP each expert tensor lives on one rank: no pushes, one read per expert."""
    specs = [TensorSpec(f"experts.{i}.w", (4, 4), "bfloat16") for i in range(4)]
    manifest = build_manifest("m", 1, specs, "now")
    engines = {
        "http://e": [
            {
                "worker_id": f"e/tp{r}",
                "node": "n0",
                "tp_rank": r,
                "tp_size": 2,
                "regions": {f"experts.{i}.w": {"bytes": 32} for i in range(4) if i % 2 == r},
                "shards": [
                    {
                        "tensor": f"experts.{i}.w",
                        "global_shape": [4, 4],
                        "global_offset": [0, 0],
                        "local_shape": [4, 4],
                        "region": f"experts.{i}.w",
                        "region_offset": 0,
                    }
                    for i in range(4)
                    if i % 2 == r
                ],
            }
            for r in range(2)
        ]
    }
    routing = plan_routing(manifest, engines, "direct", 64)
    reads = [(w, op.key) for w, _, batch in routing.table.ops() for op in batch.reads]
    assert sorted(reads) == [(f"e/tp{i % 2}", f"experts.{i}.w") for i in (0, 2, 1, 3)]
    assert routing.table.pushed_bytes(routing.topology) == (0, 0)
    assert routing.table.store_read_bytes == 4 * 32


def test_validator_rejects_corrupted_tables() -> None:
    specs = [TensorSpec("a", (16,), "float32")]
    manifest = build_manifest("m", 1, specs, "now")
    engines = simulated_engines(specs, [("n0", 1), ("n1", 1)], "compat")
    routing = plan_routing(manifest, engines, "compat", 1 << 20)
    demands = [Demand("a", 0, 64, w, COMPAT_REGION, 0) for w in routing.topology.node_of]
    sizes = {"a": 64}
    validate_routing(routing.table, demands, sizes, routing.topology)
    from dataclasses import replace

    from mooncake_rl.plan.routing import RoutingTable

    worker, stages = next((w, s) for w, s in routing.table.stages.items() if s[0])
    batch = stages[0][0]
    read = batch.reads[0]
    cases = {
        "outside object": replace(read, length=read.length + 4),
        "uncovered": replace(read, length=read.length - 4),
        "overlapping": replace(read, dst_offset=read.dst_offset),
    }
    corrupted = RoutingTable(
        {
            **routing.table.stages,
            worker: ((replace(batch, reads=(cases["outside object"],)),), stages[1]),
        }
    )
    with pytest.raises(InvariantViolation, match="outside object"):
        validate_routing(corrupted, demands, sizes, routing.topology)
    short = RoutingTable(
        {
            **routing.table.stages,
            worker: ((replace(batch, reads=(cases["uncovered"],)),), stages[1]),
        }
    )
    with pytest.raises(InvariantViolation, match=r"uncovered|before holding"):
        validate_routing(short, demands, sizes, routing.topology)
    doubled = RoutingTable(
        {**routing.table.stages, worker: ((replace(batch, reads=(read, read)),), stages[1])}
    )
    with pytest.raises(InvariantViolation, match="overlapping writes"):
        validate_routing(doubled, demands, sizes, routing.topology)
