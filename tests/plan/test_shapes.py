"""Benchmark shapes follow the public configs; the bench prints one JSON object."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import TensorSpec
from mooncake_rl.plan.shapes import MODELS, cluster, instance_parts, parse_target
from mooncake_rl.plan.synthetic import described_engines

from .helpers import bench_plan


def params(model) -> int:
    return sum(math.prod(t.shape) for t in model.tensors)


def test_llama3_70b_matches_the_published_parameter_count():
    model = MODELS["llama-70b"]()
    assert len(model.tensors) == 80 * 9 + 3
    assert params(model) == 70_553_706_496  # Meta-Llama-3-70B: 70.55B parameters


def test_kimi_k2_has_every_expert_as_its_own_tensor():
    model = MODELS["kimi-k2"]()
    kinds = Counter(t.kind for t in model.tensors)
    assert kinds["expert"] == 60 * 384 * 3 == 69_120
    assert len(model.tensors) == 69_975
    assert 1.02e12 < params(model) < 1.03e12  # "1T total parameters"


def test_small_instance_parts_shard_by_kind():
    model = MODELS["small"]()
    tp4 = instance_parts(model, 4)
    experts = [sorted({t.expert_id for t in p.tensors if t.expert_id is not None}) for p in tp4]
    assert experts == [list(range(4 * r, 4 * r + 4)) for r in range(4)]  # EP: contiguous blocks
    assert all(len([f for f in p.fragments if ".experts." in f.tensor_id]) == 36 for p in tp4)
    o_proj = [
        f for f in tp4[2].fragments if f.tensor_id == "model.layers.0.self_attn.o_proj.weight"
    ]
    assert [(f.global_offset, f.local_shape) for f in o_proj] == [((0, 128), (1024, 64))]
    topology, demand = cluster(model, 2, 4, workers_per_node=4)
    assert len(topology.nodes) == 2 and len(demand.parts) == 8
    assert parse_target("16xTP8") == (16, 8)
    with pytest.raises(InvariantViolation):
        parse_target("TP8")


def test_bench_prints_one_json_object():
    result = bench_plan("--model", "small", "--target", "2xTP4")
    assert result["store_read_bytes / unique_demand_bytes"] == 1.0
    assert result["delivered_bytes / lower_bound_bytes"] == 1.0
    assert result["workers"] == 8 and result["mode"] == "direct"


def test_the_described_bench_plans_from_engine_replies():
    """``bench.described``: identical engines' placement replies through the coordinator's
    ``plan.update`` (its hit, and the fleet change's reuse of parts, are asserted inside):
    every box lands once per engine."""
    result = bench_plan("--model", "small", "--engines", "3", "--tp", "4", module="bench.described")
    assert (result["engines"], result["tp"]) == (3, 4)
    assert result["plan_seconds_fleet_change"] > 0
    assert result["demands"] == 3 * result["boxes_per_engine"] > 0
    assert result["reads"] > 0 and result["pushes"] > 0
    assert result["prepare_body_bytes"] > 0 and result["prepare_bodies_seconds"] > 0


def test_engines_describing_owned_experts_plan_what_the_planner_bench_plans():
    """``--experts owned``: engines describing ``plan.shapes``' placement (each expert whole
    on one rank) through ``plan.update`` get the table ``bench.plan`` plans from the parts."""
    described = bench_plan(
        "--model", "small", "--engines", "3", "--experts", "owned", module="bench.described"
    )
    planned = bench_plan("--model", "small", "--target", "3xTP8")
    assert described["experts"] == "owned"
    assert described["demands"] == 3 * described["boxes_per_engine"]
    assert (described["reads"], described["pushes"]) == (planned["reads"], planned["pushes"])


def test_engines_spanning_nodes_plan_what_the_planner_bench_plans_for_the_matched_placement():
    """``--experts ep --tp 32 --nodes-per-engine 4``: each engine's 32 ranks fill four
    8-GPU nodes in order, and the coordinator's path plans ``bench.plan``'s 4xEP32 table."""
    flags = ("--model", "small", "--engines", "2", "--tp", "16", "--experts", "ep")
    described = bench_plan(*flags, "--nodes-per-engine", "2", module="bench.described")
    planned = bench_plan("--model", "small", "--target", "2xEP16")
    assert (described["experts"], described["nodes_per_engine"]) == ("ep", 2)
    assert (described["reads"], described["pushes"]) == (planned["reads"], planned["pushes"])
    assert described["demands"] == 2 * described["boxes_per_engine"]


def test_described_engines_fill_their_nodes_rank_by_rank():
    model = MODELS["small"]()
    specs = [TensorSpec(t.name, t.shape, t.dtype) for t in model.tensors]
    nodes = [f"n{i}" for i in range(9)]
    engines = described_engines(specs, instance_parts(model, 8, "ep"), nodes, 4)
    assert list(engines) == ["http://engine0", "http://engine1"]  # n8 is left over
    for i, workers in enumerate(engines.values()):
        assert [w["tp_rank"] for w in workers] == list(range(8))
        assert [w["node"] for w in workers] == [nodes[4 * i + r // 2] for r in range(8)]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--engines", "0"], "--engines and --tp must be at least 1, got 0 and 8"),
        (["--experts", "owned", "--tp", "7"], "--experts owned: 16 experts do not split over 7"),
        (["--experts", "bogus"], "argument --experts: invalid choice: 'bogus'"),
        (["--nodes-per-engine", "3"], "--nodes-per-engine must divide --tp 8, got 3"),
        (["--nodes-per-engine", "2"], "--nodes-per-engine needs --experts owned or ep"),
    ],
    ids=[
        "empty-fleet",
        "experts-do-not-split",
        "unknown-placement",
        "nodes-do-not-divide",
        "split-spans-no-nodes",
    ],
)
def test_the_described_bench_refuses_what_it_cannot_describe(flags, message):
    run = subprocess.run(
        [sys.executable, "-m", "bench.described", "--model", "small", *flags],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and run.stdout == ""
    assert message in run.stderr
