"""Worked examples with hand-checked byte offsets and counts."""

from __future__ import annotations

import numpy as np
import pytest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.checksums import BLOCK_BYTES
from mooncake_rl.plan import (
    CompatDemand,
    Destinations,
    DirectDemand,
    PlanParams,
    Topology,
    Worker,
    bind,
    plan_routing,
)
from mooncake_rl.plan.shapes import (
    MODELS,
    ModelShape,
    TensorSpec,
    cluster,
    instance_parts,
    weight_manifest,
)

from .helpers import (
    Spec,
    check_delivery,
    contents,
    execute,
    fragment_bytes,
    landings,
    manifest,
    parts,
)


def reads_of(table, worker: str) -> list[tuple]:
    w = table.workers.index(worker)
    return sorted(
        (
            table.objects[int(r["object"])],
            int(r["src_offset"]),
            int(r["src_stride"]),
            table.regions[int(r["dst_region"])],
            int(r["dst_offset"]),
            int(r["dst_stride"]),
            int(r["length"]),
            int(r["count"]),
        )
        for r in table.reads[table.reads["worker"] == w]
    )


def one_instance(tp: int, node_of=lambda r: "n0") -> Topology:
    return Topology.of(Worker(f"w{r}", node_of(r), "i0", r) for r in range(tp))


LAYER = [
    Spec("q_proj", (64, 32), kind="split", dim=0),  # q shard: 32 rows x 64 B = 2048 B
    Spec("k_proj", (16, 32), kind="split", dim=0),  # k shard: 8 rows = 512 B
    Spec("v_proj", (16, 32), kind="split", dim=0),
    Spec("o_proj", (32, 64), kind="split", dim=1),  # row shard: 32 rows x 64 of 128 B
    Spec("gate_proj", (48, 32), kind="split", dim=0),  # gate shard: 24 rows = 1536 B
    Spec("up_proj", (48, 32), kind="split", dim=0),
    Spec("norm", (32,)),  # replicated, 64 B
]


def fused(part) -> Destinations:
    """vLLM-style fused parameters: qkv_proj = [q; k; v], gate_up_proj = [gate; up]."""
    by_tensor = {f.tensor_id: f.placement_fragment_id for f in part.fragments}
    return Destinations.of(
        {"qkv_proj": 3072, "gate_up_proj": 3072, "o_proj": 2048, "norm": 64},
        {
            by_tensor["q_proj"]: ("qkv_proj", 0),
            by_tensor["k_proj"]: ("qkv_proj", 2048),
            by_tensor["v_proj"]: ("qkv_proj", 2560),
            by_tensor["gate_proj"]: ("gate_up_proj", 0),
            by_tensor["up_proj"]: ("gate_up_proj", 1536),
            by_tensor["o_proj"]: ("o_proj", 0),
            by_tensor["norm"]: ("norm", 0),
        },
    )


def test_fused_qkv_gate_up_and_tp_row_and_column_shards():
    m = manifest(LAYER)
    ps = parts(LAYER, 2)
    demand = DirectDemand.of(
        {f"w{r}": ps[r] for r in range(2)}, {f"w{r}": fused(ps[r]) for r in range(2)}
    )
    table = plan_routing(m, one_instance(2), demand)
    reads = {w: reads_of(table, w) for w in ("w0", "w1")}
    # Each row-split object (at most one checksum block) is read whole by one rank, so that
    # rank checks it against its hash: its own rows land directly in the fused parameter,
    # the other rank's rows in staging, pushed on after the check.
    fused_at = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 2048)}
    fused_at |= {"v_proj": ("qkv_proj", 2560), "gate_proj": ("gate_up_proj", 0)}
    fused_at |= {"up_proj": ("gate_up_proj", 1536)}
    for name, (param, at) in fused_at.items():
        half = {s.name: s.nbytes for s in LAYER}[name] // 2
        (reader,) = [w for w in reads if any(x[0] == name for x in reads[w])]
        r = int(reader[1])
        got = sorted(x for x in reads[reader] if x[0] == name)
        assert [(x[1], x[2]) for x in got] == [(0, half), (half, half)]
        own, other = got[r], got[1 - r]
        assert own[3:] == (param, at, half, half, 1)
        assert other[3] == "staging"
    # column shards (row-parallel o_proj): 32 rows of 64 B at column 64r of 128 B source rows
    for r in range(2):
        assert [x for x in reads[f"w{r}"] if x[0] == "o_proj"] == [
            ("o_proj", 64 * r, 128, "o_proj", 0, 64, 64, 32)
        ]
    # The replicated norm: one read of 64 B, one free intra-node push to the other rank.
    norm_reads = [x for w in ("w0", "w1") for x in reads_of(table, w) if x[0] == "norm"]
    assert [(x[1], x[6], x[7]) for x in norm_reads] == [(0, 64, 1)]
    assert len(table.pushes) == 1 + len(fused_at)
    assert (table.pushes["stage"] == 1).all()
    totals = table.totals
    assert totals.store_read_bytes == sum(s.nbytes for s in LAYER) == 16448
    halves = sum(s.nbytes // 2 for s in LAYER if s.name in fused_at)
    assert totals.cross_node_push_bytes == 0 and totals.intra_node_push_bytes == 64 + halves
    assert list(totals.delivered_bytes) == [8256, 8256]  # (16448 - 64) / 2 + 64

    data = contents(LAYER)
    buffers, written, _ = execute(table, data)
    spec = {s.name: s for s in LAYER}
    expected = {}
    for r in range(2):
        dest = landings(fused(ps[r]))
        for f in ps[r].fragments:
            region, base = dest[f.placement_fragment_id]
            chunk = fragment_bytes(
                spec[f.tensor_id], data[f.tensor_id], f.global_offset, f.local_shape
            )
            expected.setdefault((r, region), []).append((base, chunk))
    check_delivery(table, buffers, written, expected)


def test_default_destinations_one_region_per_fragment():
    specs = [Spec("w", (8, 4), kind="split", dim=1)]
    ps = parts(specs, 2)
    table = plan_routing(
        manifest(specs), one_instance(2), DirectDemand.of({"w0": ps[0], "w1": ps[1]})
    )
    fid = ps[1].fragments[0].placement_fragment_id
    # 8 rows x 4 B of a 8 B row, starting at byte 4, into the fragment's own region.
    assert reads_of(table, "w1") == [("w", 4, 8, fid, 0, 4, 4, 8)]


def test_experts_under_ep_across_two_instances():
    experts = tuple(
        TensorSpec(f"experts.{e}.w", (16, 8), "expert", layer_id=1, expert_id=e) for e in range(4)
    )
    model = ModelShape("moe", experts, num_experts=4)
    ps = instance_parts(model, 2)  # rank 0 owns experts 0,1; rank 1 owns 2,3 (256 B each)
    owned = {r: sorted(f.tensor_id for f in ps[r].fragments) for r in range(2)}
    assert owned == {0: ["experts.0.w", "experts.1.w"], 1: ["experts.2.w", "experts.3.w"]}
    workers = [Worker(f"i{i}r{r}", f"n{i}", f"i{i}", r) for i in range(2) for r in range(2)]
    demand = DirectDemand.of({w.worker_id: ps[w.tp_rank] for w in workers})
    table = plan_routing(weight_manifest(model, 1), Topology.of(workers), demand)
    totals = table.totals
    assert totals.store_read_bytes == 4 * 256
    assert totals.cross_node_push_bytes == 4 * 256  # one copy per expert to the other node
    assert totals.intra_node_push_bytes == 0
    assert list(totals.node_nic_bytes) == [1024, 1024]  # LPT alternates the equal experts
    assert int(totals.delivered_bytes.sum()) == table.lower_bound_bytes == 2048
    for read in table.reads:  # every read lands in its reader's own expert parameter
        assert table.regions[int(read["dst_region"])] != "staging"


def test_replicated_tensor_is_pushed_hierarchically():
    specs = [Spec("norm", (32,))]
    ps = parts(specs, 2)
    workers = [Worker(f"i{i}r{r}", f"n{i}", f"i{i}", r) for i in range(2) for r in range(2)]
    demand = DirectDemand.of({w.worker_id: ps[w.tp_rank] for w in workers})
    table = plan_routing(manifest(specs), Topology.of(workers), demand)
    assert len(table.reads) == 1 and int(table.reads[0]["length"]) == 64
    stages = sorted(
        (int(p["stage"]), table.worker_node[p["worker"]] != table.worker_node[p["peer"]])
        for p in table.pushes
    )
    # stage 1: one push to the reader's node peer, one to a relay on the remote node;
    # stage 2: the relay fans out to its own peer.
    assert stages == [(1, False), (1, True), (2, False)]
    (cross,) = [p for p in table.pushes if p["stage"] == 1 and p["worker"] // 2 != p["peer"] // 2]
    (fan_out,) = table.pushes[table.pushes["stage"] == 2]
    assert fan_out["worker"] == cross["peer"] and fan_out["peer"] // 2 == cross["peer"] // 2
    assert table.totals.cross_node_push_bytes == 64 and table.totals.intra_node_push_bytes == 128


def test_compat_layout_and_one_send_per_remote_node():
    specs = [Spec("a", (50,)), Spec("b", (10,)), Spec("c", (64,), "float32")]
    workers = [Worker(f"n{n}w{i}", f"n{n}") for n in range(2) for i in range(2)]
    table = plan_routing(manifest(specs), Topology.of(workers), CompatDemand(align=64))
    layout = table.compat
    assert [layout.offset(t) for t in ("a", "b", "c")] == [0, 128, 192]
    assert layout.total_bytes == 448
    totals = table.totals
    assert totals.store_read_bytes == 376
    assert totals.cross_node_push_bytes == 376  # nodes - 1 = 1 copy of each tensor
    assert totals.intra_node_push_bytes == 2 * 376
    assert list(totals.delivered_bytes) == [376] * 4
    for read in table.reads:
        name = table.objects[int(read["object"])]
        assert table.regions[int(read["dst_region"])] == "compat"
        assert int(read["dst_offset"]) == layout.offset(name)
    data = contents(specs)
    buffers, written, nic = execute(table, data)
    expected = {
        (w, "compat"): [(layout.offset(s.name), data[s.name]) for s in specs] for w in range(4)
    }
    check_delivery(table, buffers, written, expected)
    assert list(nic) == list(totals.node_nic_bytes)


def test_chunks_split_wide_fan_out_and_respect_batch_bytes():
    specs = [Spec("big", (4096,), "float32")]  # 16 KiB, needed on 4 nodes
    workers = [Worker(f"n{n}", f"n{n}") for n in range(4)]
    params = PlanParams(batch_bytes=4096, min_chunk_bytes=4096, balance_slack=1.0)
    table = plan_routing(manifest(specs), Topology.of(workers), CompatDemand(), params=params)
    sizes = sorted(int(r["length"]) for r in table.reads)
    assert sizes == [4096] * 4  # split into batch-sized chunks ...
    assert len({int(r["worker"]) for r in table.reads}) == 4  # ... read by four readers
    assert list(table.totals.node_nic_bytes) == [16384] * 4  # 4 KiB read + 3 x 4 KiB pushed


def test_bind_resolves_generation_keys():
    specs = [Spec("x.weight", (4,))]
    table = plan_routing(manifest(specs, generation=7), one_instance(1), CompatDemand())
    bound = bind(table, "mooncake-rl/m/g000000000008")
    (batch,) = bound.table.batches("w0")
    ops = bound.read_ops(batch)
    assert ops[0].key == "mooncake-rl/m/g000000000008/payload/x.weight"
    assert (ops[0].src_offset, ops[0].region, ops[0].dst_offset, ops[0].length) == (
        0,
        "compat",
        0,
        8,
    )


def test_strided_push_ops_expand_per_row():
    specs = [Spec("o", (4, 8), kind="split", dim=1)]
    ps = parts(specs, 2)
    workers = [Worker(f"i{i}r{r}", f"n{i}", f"i{i}", r) for i in range(2) for r in range(2)]
    table = plan_routing(
        manifest(specs),
        Topology.of(workers),
        DirectDemand.of({w.worker_id: ps[w.tp_rank] for w in workers}),
    )
    bound = bind(table, "g")
    for worker in table.workers:
        for batch in table.batches(worker):
            for op in bound.read_ops(batch):  # 4 rows of 8 B from 16 B source rows
                assert op.length == 8 and op.src_offset % 16 in (0, 8)
            for op in bound.push_ops(batch):  # contiguous on both sides: fused
                assert op.length == 32
    assert np.all(table.reads["count"] == 4)


@pytest.mark.parametrize("bad", ["missing", "unknown"])
def test_direct_demand_must_match_the_topology(bad):
    specs = [Spec("w", (4,))]
    ps = parts(specs, 1)
    workers = {"missing": {}, "unknown": {"w0": ps[0], "ghost": ps[0]}}[bad]
    with pytest.raises(InvariantViolation, match=r"declares no placement part|unknown worker"):
        plan_routing(manifest(specs), one_instance(1), DirectDemand.of(workers))


def test_each_gpu_nic_balances_not_only_each_node():
    """Equal-sized TP shards once aliased onto node index: node n read only rank n mod TP's
    shards, so one GPU per node carried all its node's NIC bytes (max/mean per GPU 2.25).
    A checksum block that TP shards share is read whole by one of its readers
    (``plan/blocks.py``): that coarsens the balance by at most a block per chunk a GPU
    takes over, here 4 MiB read and sent to 3 other nodes."""
    model = MODELS["small"]()
    topology, demand = cluster(model, 4, 4, workers_per_node=4)
    table = plan_routing(weight_manifest(model, 1), topology, demand, params=PlanParams())
    per_gpu, per_node = table.totals.worker_nic_bytes, table.totals.node_nic_bytes
    assert per_gpu.sum() == per_node.sum()
    assert per_gpu.max() < 1.02 * per_gpu.mean() + 4 * BLOCK_BYTES
    nic_in, nic_out = table.totals.node_nic_in, table.totals.node_nic_out  # nothing staged
    assert (nic_out <= np.maximum(nic_in, nic_out.mean() + table.max_chunk_cost)).all()
