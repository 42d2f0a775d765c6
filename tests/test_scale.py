"""Matched simulation and scale: fp8 shapes, wide-EP placements, the physical bound, and the
coordinator's control plane against a fleet of fake engines (a smoke of
``python -m bench.control_plane``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.simulate import Cluster, Scenario, node_demand_bytes, physical_bound, simulate
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations import fp8 as fp8_format
from mooncake_rl.plan.shapes import Target, cluster, instance_parts, model_shape, weight_manifest

ROOT = Path(__file__).resolve().parents[1]


def test_fp8_quantizes_linear_weights_with_block_scales() -> None:
    bf16, fp8 = model_shape("small"), model_shape("small", "fp8")
    by_name = {t.name: t for t in fp8.tensors}
    linear = [t for t in bf16.tensors if fp8_format.quantizes(t.name, t.shape)]
    assert len(fp8.tensors) == len(bf16.tensors) + len(linear)
    assert fp8.parameters == bf16.parameters
    for spec in linear:
        weight, scale = by_name[spec.name], by_name[spec.name + "_scale_inv"]
        assert (weight.dtype, weight.nbytes) == ("float8_e4m3fn", math.prod(spec.shape))
        assert scale.dtype == "float32" and scale.kind == spec.kind
        assert scale.shape == tuple(math.ceil(n / 128) for n in spec.shape)
    kept = {t.name for t in fp8.tensors if t.dtype == "bfloat16" and len(t.shape) == 2}
    assert kept == {
        t.name
        for t in bf16.tensors
        if len(t.shape) == 2
        and ("embed_tokens" in t.name or "lm_head" in t.name or t.name.endswith("mlp.gate.weight"))
    }
    assert by_name["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "float32"
    # A scale's blocks split with its weight's rows: 64 rows per rank is half a block.
    with pytest.raises(InvariantViolation):
        instance_parts(model_shape("llama-70b", "fp8"), 16)


def test_wide_ep_stores_each_expert_once_per_instance() -> None:
    model = model_shape("small", "fp8")
    parts = instance_parts(model, 8, "ep")
    held = [{f.tensor_id for f in p.fragments} for p in parts]
    experts = [t.name for t in model.tensors if t.kind == "expert"]
    assert sorted(n for names in held for n in names if n in set(experts)) == sorted(experts)
    others = {t.name for t in model.tensors if t.kind != "expert"}
    assert all(others <= names for names in held)  # data-parallel attention: whole on each
    shape = {t.name: t.shape for t in model.tensors}
    assert all(f.local_shape == shape[f.tensor_id] for p in parts for f in p.fragments)
    assert Target.parse("4xEP32") == Target(4, 32, "ep")
    assert str(Target.parse("16xtp8")) == "16xTP8"
    with pytest.raises(InvariantViolation):
        instance_parts(model_shape("llama-70b"), 8, "ep")  # no experts to lay out
    with pytest.raises(InvariantViolation):
        Target.parse("4xDP32")


def test_node_demand_and_the_physical_bound() -> None:
    model = model_shape("small", "fp8")
    topology, demand = cluster(model, 2, 8, workers_per_node=4, layout="ep")
    per_node = node_demand_bytes(weight_manifest(model, 1), topology, demand)
    others = sum(t.nbytes for t in model.tensors if t.kind != "expert")
    experts = sum(t.nbytes for t in model.tensors if t.kind == "expert")
    assert per_node.tolist() == [others + experts // 2] * 4  # half the experts per node
    c = Cluster(trainer_gpus=16, rollout_instances=2, rollout_tp=8, rollout_gpus_per_node=4)
    bound = physical_bound(per_node, np.array([10, 20]), c)
    assert bound.bottleneck == "rollout_node_nic_in"
    assert math.isclose(bound.seconds, (others + experts // 2) / (4 * 45e9))


def test_simulated_ep_fp8_reads_once_and_reports_its_bound() -> None:
    scenario = Scenario(
        model="small",
        dtype="fp8",
        cluster=Cluster(
            trainer_gpus=16,
            rollout_instances=2,
            rollout_tp=8,
            rollout_layout="ep",
            rollout_gpus_per_node=4,
        ),
        modes=("direct",),
    )
    result = simulate(scenario)
    model = model_shape("small", "fp8")
    bound = result["scenario"]["physical_bound"]
    assert result["scenario"]["dtype"] == "fp8"
    assert result["scenario"]["model_bytes"] == model.nbytes
    assert "ep" in result["assumptions"]["rollout_placement"]
    direct = result["approaches"]["direct"]
    assert direct["store_read_bytes"] == model.nbytes  # single pull
    assert bound["max_rollout_node_distinct_bytes"] == direct["max_rollout_node_nic_in_bytes"]
    for figures in result["approaches"].values():
        assert figures["bound_ratio"] >= 1.0


@pytest.mark.timeout(60)
def test_control_plane_smoke_on_twenty_fake_engines() -> None:
    """The real Coordinator, routes and receivers; fake ranks that refuse an apply body
    lacking a peer they push to."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.control_plane", "--engines", "20", "--tp", "2",
         "--engines-per-node", "4"],
        cwd=ROOT, env={**os.environ, "MC_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert (result["committed"], result["failed"], result["workers"]) == (20, 0, 40)
    assert result["serving_generation"] == {"1": 20}
    assert result["store_read_bytes"] == result["planned_read_bytes"] > 0
    assert result["pushed_bytes"] == result["planned_pushed_bytes"] > 0
    assert result["calls"]["apply"] == 2 * 20 and result["calls"]["commit"] == 20
    assert set(result["phase_seconds"]) >= {"placement", "drain", "plan", "prepare", "apply"}


def test_scale_point_plans_cold_then_hits_the_cache() -> None:
    from bench.scale import Point, growth, measure

    small, large = measure(Point("small", 2, 4)), measure(Point("small", 8, 4))
    for point in (small, large):
        assert point["store_read_bytes"] == point["model_bytes"]  # single pull at any scale
        assert point["plan_seconds_cached"] < point["plan_seconds_cold"]
        assert point["workers"] == 4 * point["engines"] and point["table_bytes"] > 0
        # Peak memory counts swapped pages too, and is never below the kernel's own peak.
        assert point["peak_rss_bytes"] >= point["rss_before_plan_bytes"]
        assert point["peak_swap_bytes"] >= 0
    assert large["delivered_bytes"] == 4 * small["delivered_bytes"]
    assert large["demands"] == 4 * small["demands"]  # every replica names its own ranges
    assert growth(small, large)["engines_x"] == 4.0
    with pytest.raises(ValueError):
        Point("small", 0)


def test_scale_extrapolates_memory_by_the_measured_growth() -> None:
    from bench.scale import predicted_peak

    one = [{"engines": 16, "rss_before_plan_bytes": 100, "plan_peak_rss_bytes": 1000}]
    assert predicted_peak(one, 32) == 100 + 2000  # linear from a single point
    two = [*one, {"engines": 64, "rss_before_plan_bytes": 100, "plan_peak_rss_bytes": 16000}]
    assert predicted_peak(two, 128) == pytest.approx(100 + 64000)  # quadratic growth seen


def test_fake_ranks_refuse_an_apply_body_without_their_push_targets() -> None:
    import asyncio

    from bench.control_plane import FakeRanks
    from mooncake_rl.apply.executor import Batch, PushOp, ReadOp
    from mooncake_rl.apply.wire import WorkerSlice, encode_slice

    batch = Batch((ReadOp("k", 0, "w", 0, 8),), (PushOp("peer", "w", 0, "w", 0, 8),))
    raw = encode_slice(WorkerSlice({"w": 8}, ((batch,),)))
    ranks = FakeRanks("fake0", [{"worker_id": "e0/tp0", "node": "n0"}], 8000)
    prepared = asyncio.run(ranks.call_workers("prepare", {"workers": {"e0/tp0": {"slice": raw}}}))
    assert prepared[0]["regions"] == {"w": {"base": 0, "size": 8}}
    refused = asyncio.run(ranks.call_workers("apply", {"stage": 0, "peers": {}}))
    assert refused[0]["refused"] == {"status": 422, "code": "untrusted_peer"}
    started = asyncio.run(ranks.call_workers("apply", {"stage": 0, "peers": {"peer": {}}}))
    assert started[0]["started"] == 0
    applied = asyncio.run(ranks.call_workers("collect"))
    assert (applied[0]["store_read_bytes"], applied[0]["pushed_bytes"]) == (8, 8)


def test_simulate_flags_reach_the_scenario() -> None:
    from bench.simulate import parser, scenario_from

    args = ["--model", "kimi-k2", "--dtype", "fp8", "--instances", "4", "--tp", "32"]
    scenario = scenario_from(parser().parse_args([*args, "--layout", "ep", "--modes", "direct"]))
    assert (scenario.dtype, scenario.modes) == ("fp8", ("direct",))
    assert (scenario.cluster.rollout_layout, scenario.cluster.rollout_gpus) == ("ep", 128)
    with pytest.raises(ValueError):
        Cluster(rollout_layout="dp")
