"""The simulator's native-operation count and per-operation cost (issue 48): a tiny routing
table whose merged operations are known by hand, the cost term exactly ops x cost, and the
simulated manifest packed the way the publisher packs."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.simulate import (
    OP_COSTS,
    Cluster,
    Ops,
    Scenario,
    Traffic,
    estimate,
    publish_layout,
    push_ops,
    read_ops,
)
from mooncake_rl.generations.packing import PACK_PREFIX
from mooncake_rl.plan.shapes import model_shape
from mooncake_rl.plan.table import PUSH_DTYPE, READ_DTYPE


def _reads(rows: list[tuple[int, int, int, int, int, int, int]]) -> np.ndarray:
    """(worker, batch, object, src, region, dst, length) rows, one range each."""
    out = np.zeros(len(rows), READ_DTYPE)
    for i, (w, b, o, src, region, dst, n) in enumerate(rows):
        out[i] = (w, b, o, src, n, region, dst, n, n, 1)
    return out


def _pushes(rows: list[tuple[int, int, int, int, int, int, int, int, int]]) -> np.ndarray:
    """(worker, stage, batch, peer, src_region, src, dst_region, dst, length) rows."""
    out = np.zeros(len(rows), PUSH_DTYPE)
    for i, (w, stage, b, peer, sr, src, dr, dst, n) in enumerate(rows):
        out[i] = (w, stage, b, peer, sr, src, n, dr, dst, n, n, 1)
    return out


def test_reads_merge_only_when_adjacent_on_both_sides_in_one_call() -> None:
    reads = _reads(
        [
            (0, 0, 0, 0, 1, 0, 10),  # object 0 -> region 1 [0, 10)
            (0, 0, 0, 10, 1, 10, 10),  # adjacent on both sides: merges
            (0, 0, 0, 20, 2, 20, 10),  # another region: a range of its own
            (0, 0, 0, 40, 1, 20, 10),  # source gap: its own
            (0, 0, 1, 0, 1, 30, 10),  # another object (a key) in the same call
            (0, 1, 0, 50, 1, 40, 10),  # the next batch: another call, the key again
            (1, 0, 0, 60, 1, 0, 10),  # another worker
        ]
    )
    keys, ranges = read_ops(reads, 3)
    assert keys.tolist() == [3, 1, 0]  # (batch 0: objects 0, 1) + (batch 1: object 0)
    assert ranges.tolist() == [5, 1, 0]
    # A strided record whose sides are not contiguous is count ranges; one that is, one.
    strided = _reads([(0, 0, 0, 0, 1, 0, 4)] * 2)
    strided[0]["count"], strided[0]["src_stride"], strided[0]["dst_stride"] = 3, 8, 4
    strided[1]["count"], strided[1]["src_offset"], strided[1]["dst_offset"] = 2, 100, 100
    assert read_ops(strided, 1)[1].tolist() == [4]


def test_pushes_merge_per_peer_and_stage() -> None:
    pushes = _pushes(
        [
            (0, 1, 0, 1, 0, 0, 3, 0, 8),
            (0, 1, 0, 1, 0, 8, 3, 8, 8),  # merges with the first
            (0, 1, 0, 2, 0, 16, 3, 16, 8),  # another peer
            (0, 1, 0, 1, 0, 16, 4, 16, 8),  # another destination region
            (0, 2, 0, 1, 3, 0, 3, 0, 8),  # stage 2, after the barrier
        ]
    )
    stage1, stage2 = push_ops(pushes, 2)
    assert stage1.tolist() == [3, 0] and stage2.tolist() == [1, 0]


@given(
    lengths=st.lists(st.integers(1, 1 << 20), min_size=1, max_size=40),
    gaps=st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_contiguous_runs_are_one_range_each(lengths: list[int], gaps: list[bool]) -> None:
    """Ranges laid back to back merge unless a gap separates them, in any input order."""
    rows, at = [], 0
    for n, gap in zip(lengths, gaps, strict=False):
        at += gap
        rows.append((0, 0, 0, at, 1, at, n))
        at += n
    runs = 1 + sum(gaps[1 : len(lengths)])
    shuffled = _reads(rows)[np.random.default_rng(len(rows)).permutation(len(rows))]
    keys, ranges = read_ops(shuffled, 1)
    assert (keys.tolist(), ranges.tolist()) == ([1], [runs])


def _one_gpu_traffic(read_bytes: int) -> Traffic:
    z = np.zeros(1, np.int64)
    reads = np.array([read_bytes], np.int64)
    return Traffic(
        store_read_bytes=read_bytes, pushed_bytes=0, cross_node_pushed_bytes=0,
        delivered_bytes=read_bytes, trainer_node_out=reads, trainer_gpu_out=0,
        reads_per_gpu=reads, gpu_nic_in=reads, gpu_nic_out=z, nvlink_in=z, nvlink_out=z,
        stage2_nvlink_in=z, stage2_nvlink_out=z, gpu_node=np.zeros(1, np.int64), hops=1,
        batch_bytes=0, extra_receive_bytes_per_gpu=0,
    )  # fmt: skip


@given(
    keys=st.integers(0, 10_000),
    extra=st.integers(0, 10_000),
    key_us=st.floats(0, 500),
    range_us=st.floats(0, 500),
)
def test_the_read_term_is_exactly_ops_times_cost(
    keys: int, extra: int, key_us: float, range_us: float
) -> None:
    cluster = Cluster(
        trainer_gpus=8, rollout_gpus_per_node=1, store_read_key_us=key_us,
        store_read_range_us=range_us,
    )  # fmt: skip
    traffic = _one_gpu_traffic(45 * 10**9)  # 1 s on one 45 GB/s NIC
    ops = Ops(np.array([keys]), np.array([keys + extra]), np.zeros(1), np.zeros(1))
    charged = estimate(traffic, cluster, ops=ops).update_seconds
    assert math.isclose(
        charged - estimate(traffic, cluster).update_seconds,
        (keys * key_us + extra * range_us) * 1e-6,
        rel_tol=1e-9,
        abs_tol=1e-12,
    )


def test_push_costs_land_on_the_pushers_resources() -> None:
    cluster = Cluster(trainer_gpus=8, rollout_gpus_per_node=2, push_us=100.0)
    z = np.zeros(2, np.int64)
    out = np.array([45 * 10**9, 0], np.int64)
    traffic = replace(
        _one_gpu_traffic(0),
        reads_per_gpu=z, gpu_nic_in=z, gpu_nic_out=out, nvlink_in=z, nvlink_out=z,
        stage2_nvlink_in=z, stage2_nvlink_out=z, gpu_node=np.zeros(2, np.int64),
        trainer_node_out=np.zeros(1, np.int64),
    )  # fmt: skip
    ops = Ops(z, z, np.array([0, 1000]), np.array([0, 500]))
    bare = estimate(traffic, cluster)
    charged = estimate(traffic, cluster, ops=ops)
    # The node's pooled NIC-out waits for its slowest pusher (0.1 s), stage 2 for 0.05 s.
    assert math.isclose(charged.stage_seconds["rollout_nic_out"], 0.5 + 0.1)
    assert math.isclose(charged.stage2_seconds, 0.05)
    assert math.isclose(charged.update_seconds - bare.update_seconds, 0.15)
    with pytest.raises(ValueError):
        Ops(np.array([2]), np.array([1]), z[:1], z[:1])


def test_op_cost_knobs_validate_and_presets_apply() -> None:
    with pytest.raises(ValueError):
        Cluster(push_us=-1.0)
    with pytest.raises(ValueError):
        Scenario(pack_bytes=-1)
    rdma = Cluster().with_op_costs("rdma")
    assert (rdma.store_read_key_us, rdma.store_read_range_us, rdma.push_us) == OP_COSTS["rdma"]
    assert Cluster().push_us == OP_COSTS["tcp"][2]


def test_the_simulated_manifest_is_packed_as_the_publishers_pack() -> None:
    model = model_shape("small", "fp8")
    cluster = Cluster(trainer_gpus=16)
    packed = publish_layout(model, cluster, 1 << 20)
    alone = publish_layout(model, cluster, 0)
    assert alone.objects == alone.tensors == len(model.tensors)
    assert packed.objects < packed.tensors and packed.packed_tensors > 0
    assert packed.node_bytes.tolist() == alone.node_bytes.tolist()  # same publishers
    assert packed.node_bytes.sum() == model.nbytes
    by_tensor = {f.tensor_id: f.object_key for f in packed.manifest.fragments}
    for spec in model.tensors:  # a weight and its block scales: one publisher rank
        scale = by_tensor.get(spec.name + "_scale_inv", "")
        if PACK_PREFIX in scale and PACK_PREFIX in by_tensor[spec.name]:
            assert _rank(scale) == _rank(by_tensor[spec.name])


def _rank(pack_key: str) -> str:
    return pack_key.split(PACK_PREFIX)[1].split("-")[0]
