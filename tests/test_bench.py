"""``mooncake-rl bench``: the simulator's byte accounting from the real planner, and the
side-by-side run on real services at a tiny size (exact bytes, never timings)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.broadcast import binomial_tree_sends, broadcast_accounting
from bench.common import synthetic_model
from bench.simulate import Cluster, Scenario, Traffic, broadcast_traffic, estimate, simulate
from bench.tables import render_compare
from mooncake_rl.plan.shapes import MODELS, instance_parts

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ASSUMPTION_KEYS = {
    "state_dtype",
    "nics_per_node",
    "nic_line_rate_gbps",
    "nic_efficiency",
    "nic_bytes_per_s",
    "full_duplex",
    "gpudirect",
    "nvlink_gbs_per_direction",
    "nvlink_efficiency",
    "rollout_nic_pooling",
    "trainer_store_segments",
    "publisher_assignment",
    "rollout_placement",
    "physical_bound",
    "pipeline",
    "batch_bytes",
    "compat_per_node",
    "naive_store",
    "nccl_broadcast",
    "broadcast_chunk_bytes",
    "publish",
    "gpu_memory",
    "excluded",
    "packing",
    "per_operation",
}
# The byte model alone: per-operation costs have their own tests (test_simulate_ops.py).
TOY = Scenario(
    model="llama-70b",
    cluster=Cluster(trainer_gpus=16, rollout_instances=2, rollout_tp=8).with_op_costs("none"),
)


def _env() -> dict[str, str]:
    return {**os.environ, "MC_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def toy() -> dict:
    return simulate(TOY)


def test_gloo_binomial_tree_is_reproduced() -> None:
    assert binomial_tree_sends(4) == ((0, 1), (0, 2), (1, 3))
    assert binomial_tree_sends(8)[-4:] == ((0, 4), (1, 5), (2, 6), (3, 7))
    for world in range(1, 20):
        sends = binomial_tree_sends(world, root=world // 2)
        receivers = [r for _, r in sends]
        assert sorted(receivers) == sorted(set(range(world)) - {world // 2})
        holders = {world // 2}
        for sender, receiver in sends:  # a rank forwards only what it already holds
            assert sender in holders
            holders.add(receiver)
    accounting = broadcast_accounting(["a", "a", "b", "b"], 100)
    assert accounting["node_nic_bytes"] == {"a": 200, "b": 0}  # 0->2 and 1->3 cross
    assert accounting["ring_node_nic_bytes"] == {"a": 100, "b": 0}
    assert accounting["pushed_bytes"] == 300


def test_simulated_bytes_come_exactly_from_the_planner(toy: dict) -> None:
    model = MODELS["llama-70b"]()
    m = model.nbytes
    placement = sum(f.nbytes for part in instance_parts(model, 8) for f in part.fragments)
    replicas, gpus = 2, 16
    assert toy["scenario"]["model_bytes"] == m
    a = toy["approaches"]
    assert list(a) == [
        "direct",
        "compat",
        "compat_per_node",
        "naive_store",
        "naive_store_full",
        "nccl_broadcast",
    ]

    direct = a["direct"]
    assert direct["store_read_bytes"] == direct["unique_demand_bytes"] == m  # single pull
    assert direct["delivered_bytes"] == replicas * placement  # exactly what engines store
    assert direct["cross_node_pushed_bytes"] == (2 - 1) * m  # every byte crosses once
    assert (
        direct["max_trainer_node_nic_out_bytes"] + direct["min_trainer_node_nic_out_bytes"] == m
    )  # two trainer nodes serve the model once between them

    compat = a["compat"]
    assert compat["store_read_bytes"] == compat["unique_demand_bytes"] == m
    assert compat["delivered_bytes"] == gpus * m
    assert compat["cross_node_pushed_bytes"] == (2 - 1) * m  # nodes - 1 sends per tensor

    per_node = a["compat_per_node"]  # each node reads the model, fans it out in stage 1
    assert per_node["store_read_bytes"] == 2 * m
    assert per_node["unique_demand_bytes"] == m
    assert per_node["delivered_bytes"] == gpus * m
    assert per_node["cross_node_pushed_bytes"] == 0
    assert per_node["pushed_bytes"] == (gpus - 2) * m  # 7 NVLink copies on each node
    assert per_node["stage2_seconds"] == 0 < compat["stage2_seconds"]
    assert per_node["update_seconds"] < compat["update_seconds"]
    # 2 trainer nodes serve the model twice: their NICs, not the rollout NIC-in, end it
    assert per_node["bottleneck"] == "trainer_node_nic_out"
    assert per_node["bound_ratio"] <= 1.05 < 1.4 < compat["bound_ratio"]

    naive = a["naive_store"]  # every GPU reads its own shards: replicas x the placement
    assert naive["store_read_bytes"] == replicas * placement
    assert naive["pushed_bytes"] == 0
    assert naive["max_rollout_gpu_nic_in_bytes"] == toy["scenario"]["rollout_weight_bytes_per_gpu"]
    assert a["naive_store_full"]["store_read_bytes"] == gpus * m

    ring = a["nccl_broadcast"]
    assert ring["store_read_bytes"] == 0
    assert ring["pushed_bytes"] == ring["delivered_bytes"] == gpus * m
    assert ring["cross_node_pushed_bytes"] == 2 * m  # trainer -> node 0 -> node 1
    assert ring["max_rollout_gpu_nic_in_bytes"] == m
    assert ring["max_trainer_node_nic_out_bytes"] == m

    c = TOY.cluster
    gpu_bw = min(c.nic_gbps / 8 * 1e9 * c.nic_efficiency, c.pcie_gbs * 1e9)
    fill = (gpus - 1) * TOY.broadcast_chunk_bytes / gpu_bw
    assert ring["update_seconds"] == round(m / gpu_bw + fill, 3)
    assert ring["bottleneck"] == "trainer_gpu_nic_out"
    assert toy["ratios"]["naive_store"]["store_read_bytes"] == round(replicas * placement / m, 3)
    bound = toy["scenario"]["physical_bound"]  # each node holds a full TP8 replica
    assert bound["max_rollout_node_distinct_bytes"] == m
    assert bound["seconds"] == round(m / (8 * gpu_bw), 4)
    assert math.isclose(
        direct["bound_ratio"], direct["update_seconds"] / (m / (8 * gpu_bw)), abs_tol=0.01
    )


def test_every_assumption_is_in_the_output(toy: dict) -> None:
    assert set(toy["assumptions"]) == ASSUMPTION_KEYS
    assert toy["scenario"]["cluster"]["nic_gbps"] == 400.0
    for figures in toy["approaches"].values():
        assert {"update_seconds", "stage_seconds", "bottleneck", "fits_gpu_memory"} <= set(figures)


def test_simulation_is_deterministic(toy: dict) -> None:
    again = simulate(TOY)
    timing = {"plan_seconds"}
    for name, figures in toy["approaches"].items():
        assert {k: v for k, v in figures.items() if k not in timing} == {
            k: v for k, v in again["approaches"][name].items() if k not in timing
        }


def test_estimator_is_pure_and_validates_inputs(toy: dict) -> None:
    with pytest.raises(ValueError):
        Cluster(trainer_gpus=12, trainer_gpus_per_node=8)
    with pytest.raises(ValueError):
        Cluster(nic_efficiency=1.5)
    with pytest.raises(ValueError):
        Scenario(model="gpt-5")
    with pytest.raises(ValueError):
        Scenario(modes=("compat",))
    with pytest.raises(ValueError, match="balance_slack"):
        Scenario(balance_slack=0.0)
    traffic = broadcast_traffic(10**12, np.repeat(np.arange(2), 8), 2, 4 << 20)
    first, second = estimate(traffic, TOY.cluster), estimate(traffic, TOY.cluster)
    assert first == second
    assert TOY.cluster.nic_pooling == "per_node"  # each node receives the model once
    assert math.isclose(first.stage_seconds["rollout_nic_in"], 10**12 / (8 * 45e9))
    per_gpu = estimate(traffic, TOY.cluster, "per_gpu")  # ... through one GPU's NIC
    assert math.isclose(per_gpu.stage_seconds["rollout_nic_in"], 10**12 / 45e9)
    assert first.bottleneck == per_gpu.bottleneck == "trainer_gpu_nic_out"  # the root's NIC


def _read_then_push(reads: list[int], nic_in: list[int], nic_out: list[int]) -> Traffic:
    """Read, then push, on nodes of one GPU each (so per-node and per-GPU NICs agree)."""
    n = len(reads)
    zeros = np.zeros(n, np.int64)
    return Traffic(
        store_read_bytes=sum(reads), pushed_bytes=sum(nic_out), cross_node_pushed_bytes=0,
        delivered_bytes=sum(nic_in), trainer_node_out=np.array([sum(reads)], np.int64),
        trainer_gpu_out=0, reads_per_gpu=np.array(reads, np.int64),
        gpu_nic_in=np.array(nic_in, np.int64), gpu_nic_out=np.array(nic_out, np.int64),
        nvlink_in=zeros, nvlink_out=zeros, stage2_nvlink_in=zeros, stage2_nvlink_out=zeros,
        gpu_node=np.arange(n), hops=2, batch_bytes=45 * 10**7, extra_receive_bytes_per_gpu=0,
    )  # fmt: skip


def test_a_nic_in_waits_only_for_the_fill_its_own_reads_do_not_cover() -> None:
    cluster = Cluster(trainer_gpus=8, rollout_gpus_per_node=1)
    fill = 0.01  # one 450 MB batch at 45 GB/s
    # Both GPUs read 900 MB (20 ms, more than the fill), then take 45 GB in all: the NIC-in
    # never idles, so it ends at its busy seconds; each NIC-out starts after one batch.
    busy = estimate(_read_then_push([9 * 10**8] * 2, [45 * 10**9] * 2, [44 * 10**9] * 2), cluster)
    assert math.isclose(busy.fill_seconds, fill)
    assert busy.bottleneck == "rollout_nic_in"
    assert math.isclose(busy.update_seconds, 1.0)
    # A GPU that reads 90 MB (2 ms) waits the other 8 ms for its first push.
    short = estimate(_read_then_push([9 * 10**7, 9 * 10**8], [45 * 10**9] * 2, [0, 0]), cluster)
    assert math.isclose(short.update_seconds, 1.0 + fill - 0.002)
    # Pushes start one batch in: a NIC-out with as many bytes as the busiest NIC-in ends last.
    out = estimate(_read_then_push([9 * 10**8] * 2, [45 * 10**9] * 2, [45 * 10**9, 0]), cluster)
    assert out.bottleneck == "rollout_nic_out"
    assert math.isclose(out.update_seconds, 1.0 + fill)
    assert out.stage_seconds["rollout_nic_out"] == out.stage_seconds["rollout_nic_in"] == 1.0


def test_simulate_cli_writes_json_and_png(tmp_path: Path) -> None:
    out = tmp_path / "sim.png"
    done = subprocess.run(
        [sys.executable, "-m", "mooncake_rl.cli", "bench", "simulate", "--model", "llama-70b",
         "--trainer-gpus", "16", "--instances", "2", "--modes", "direct", "--out", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout)
    assert "compat" not in result["approaches"]
    assert result["approaches"]["direct"]["store_read_bytes"] == MODELS["llama-70b"]().nbytes
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_bench_apply_compares_the_two_pulls_on_real_services() -> None:
    """``bench.apply --mode compat`` runs the update planned with each pull on the same
    workers (real Store reads and TE writes): a pull per node reads the model once per node
    and pushes only inside each node."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.apply", "--size", "8MiB", "--tensors", "8",
         "--workers", "4", "--nodes", "2", "--mode", "compat", "--repeats", "1"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    m = result["model_bytes"]
    single, per_node = result["pulls"]["single"], result["pulls"]["node"]
    assert (single["store_read_bytes"], single["pushed_bytes"]) == (m, 3 * m)
    assert (per_node["store_read_bytes"], per_node["pushed_bytes"]) == (2 * m, 2 * m)
    assert per_node["max_node_nic_bytes"] == m <= single["max_node_nic_bytes"]  # mean: m
    assert single["vs_single"] == 1.0 and per_node["vs_single"] > 0


def test_bench_apply_publishes_in_the_pack_order_the_engines_teach() -> None:
    """``bench.apply --pack-order`` publishes as an RL run's steady state: packs laid out
    rank by rank for the TP=2 engine, so each rank reads its own shards (tensor after
    tensor, 3.7 of these 4.0 MB are pushed between the ranks), every byte read once and
    checked."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.apply", "--size", "4MiB", "--tensors", "400",
         "--workers", "2", "--nodes", "1", "--mode", "direct", "--repeats", "1",
         "--pack-order"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    m = result["model_bytes"]
    assert result["pack_order"] is True
    assert result["store_read_bytes"] == result["verified_bytes"] == m
    assert result["unverified_bytes"] == 0
    assert 0 < result["pushed_bytes"] <= m // 2


def test_bench_apply_compares_a_delta_update_with_the_full_one_on_real_services() -> None:
    """``bench.apply --delta-lr`` publishes a keyframe and, one Adam step later, a delta of
    it, then updates workers at the keyframe both ways (real Store reads and TE writes):
    each leaves every region holding N exactly, and the delta moves only its entries, each
    read once."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.apply", "--size", "4MiB", "--tensors", "6",
         "--workers", "2", "--nodes", "1", "--mode", "direct", "--delta-lr", "1e-6",
         "--repeats", "1"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    m, full, delta = result["model_bytes"], result["full"], result["delta"]
    assert result["exact"] == {"full": True, "delta": True} and result["goals"]["bit_exact"]
    assert 0.005 < result["changed_elements_fraction"] < 0.05  # bf16 after an Adam step
    assert (full["store_read_bytes"], full["pushed_bytes"]) == (m, m)  # 2 x TP1 on one node
    # Both TP=1 workers need every entry: the Store serves each once, and it is pushed once.
    stored = delta["stored_bytes"]
    assert (delta["store_read_bytes"], delta["pushed_bytes"]) == (stored, stored)
    assert delta["moved_bytes"] == delta["received_bytes"] == 2 * stored
    assert 0 < delta["moved_bytes"] < full["moved_bytes"] / 10
    assert delta["checked_bytes"] == 2 * m  # every box checked against N


@pytest.mark.parametrize(
    "flags", [["--mode", "compat"], ["--mode", "direct", "--delta-rate", "0.01"]]
)
def test_bench_apply_refuses_row_parallel_outside_a_direct_full_update(flags: list[str]) -> None:
    """Column splits exist only in direct mode's shards of a full update: elsewhere the flag
    would be ignored, so it is refused by name before any service starts."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.apply", "--row-parallel", *flags],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert "--row-parallel splits the shards of a direct-mode full update" in done.stderr


def test_bench_apply_refuses_pack_order_with_a_delta_update() -> None:
    """The delta comparison publishes its own keyframe and delta: ``--pack-order`` would be
    ignored there, so it is refused by name before any service starts."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.apply", "--pack-order", "--delta-rate", "0.01"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert "--pack-order lays out the packs of a full update's generation" in done.stderr


def test_bench_publish_claims_and_announces_from_two_ranks() -> None:
    """``bench.publish`` publishes like a trainer (rank 0 claims, every rank puts its share,
    rank 0 announces): every byte once, each in its own node's segment."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.publish", "--size", "8MiB", "--tensors", "300",
         "--ranks", "2", "--nodes", "2"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    model = synthetic_model(8 << 20, 300)
    assert result["published_bytes"] == sum(t.numel() * 2 for _, t in model)  # bf16
    assert sum(result["bytes_per_node"].values()) == result["published_bytes"]
    assert result["nonlocal_put_bytes"] == 0


def test_bench_runs_every_approach_on_real_services(tmp_path: Path) -> None:
    out = tmp_path / "compare.png"
    done = subprocess.run(
        [sys.executable, "-m", "mooncake_rl.cli", "bench", "--size", "8MiB", "--tensors", "16",
         "--workers", "4", "--nodes", "2", "--out", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    m = result["model_bytes"]
    a = result["approaches"]
    assert {"compat", "direct", "naive_store", "broadcast"} <= set(a)

    assert a["direct"]["store_read_bytes"] == a["direct"]["unique_demand_bytes"] == m
    # 2 x TP2: each shard crosses to the other node once (node_nic_bytes below); a rank
    # reading a checksum block whole pushes its TP peer the peer's rows inside the node.
    assert m <= a["direct"]["pushed_bytes"] < 2 * m
    assert a["direct"]["delivered_bytes"] == 2 * m
    assert a["compat"]["store_read_bytes"] == a["compat"]["unique_demand_bytes"] == m
    assert a["compat"]["pushed_bytes"] == 3 * m  # 4 workers each hold the model
    for mode in ("direct", "compat"):  # each node: its reads + what it sent across
        assert sum(a[mode]["node_nic_bytes"].values()) == 2 * m
    assert a["naive_store"]["store_read_bytes"] == 2 * m  # 2 replicas read their shards
    assert a["naive_store"]["pushed_bytes"] == 0
    assert a["naive_store_full"]["store_read_bytes"] == 4 * m  # 4 workers read everything
    assert a["naive_store_full"]["max_node_nic_bytes"] == 2 * m

    bcast = a["broadcast"]
    assert bcast["store_read_bytes"] == 0
    assert bcast["received_bytes"] == bcast["pushed_bytes"] == 3 * m  # workers - 1 receivers
    assert bcast["max_node_nic_bytes"] == 2 * m  # gloo's tree: 0->2 and 1->3 cross nodes
    assert bcast["ring_max_node_nic_bytes"] == m

    for name, figures in a.items():
        assert figures["seconds"] > 0, name
        assert result["ratios"][name]["vs_direct"]["store_read_bytes"] == round(
            figures["store_read_bytes"] / m, 3
        )
    assert result["ceilings"]["memcpy_gbps"] > 0 and result["ceilings"]["raw_te_gbps"] > 0
    assert out.read_bytes()[:8] == PNG_MAGIC

    # docs/performance.md's table comes from this JSON (python -m bench.tables)
    # (the hottest NIC of direct and compat depends on how tensors split across nodes)
    table = {line.split(" | ")[0]: line.split(" | ")[3:6] for line in render_compare([result])}
    assert table["| `direct`"][0] == "1.00x"  # Store reads
    assert 1.0 <= float(table["| `direct`"][1].rstrip("x")) < 2.0  # pushed (as above)
    assert table["| `compat`"][:2] == ["1.00x", "3.00x"]
    assert table["| `naive_store_full`"] == ["4.00x", "0.00x", "2.00x"]  # and hottest NIC
    assert table["| `broadcast`"] == ["0.00x", "3.00x", "2.00x"]


def test_deepseek_v3_shape_matches_its_public_config() -> None:
    model = MODELS["deepseek-v3"]()
    parameters = sum(math.prod(t.shape) for t in model.tensors)
    assert round(parameters / 1e9) == 671  # DeepSeek-V3's published count (MTP module excluded)
    assert model.num_experts == 256
    experts = [t for t in model.tensors if t.kind == "expert"]
    assert len(experts) == (61 - 3) * 256 * 3  # first 3 layers dense; gate/up/down per expert
    assert {t.layer_id for t in experts} == set(range(3, 61))


def test_models_table_counts_bytes_by_landing_kind(tmp_path) -> None:
    """``python -m bench.models --table-from LOG`` rebuilds the docs table from JSON rows."""
    from dataclasses import asdict

    from bench.models import FamilyRun, ModeRun, rows_of, table

    run = FamilyRun("qwen2", True, 2)
    run.direct = ModeRun(ok=True, received_bytes=1000, fallback_bytes=96, checked=7)
    run.compat = ModeRun(ok=False, received_bytes=2048, error="commit failed: x")
    row = asdict(run)
    for mode in ("compat", "direct"):
        row[mode].pop("result")
    log = tmp_path / "models.log"
    log.write_text("vLLM noise\n" + json.dumps(row) + "\n")
    lines = table(rows_of(log)).splitlines()
    assert len(lines) == 3
    assert lines[2].startswith("| qwen2 | yes | 2 | OK | FAIL | n/a | 904 | 96 | 2,048 |")
    assert lines[2].endswith("| 7 | commit failed: x |")
