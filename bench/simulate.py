"""Cluster simulator: bytes per NIC from the REAL planner, then estimated update seconds.

``mooncake-rl bench simulate`` (``python -m bench simulate``) builds a model shape
(``mooncake_rl.plan.shapes``, bf16 or fp8 rollout weights) and a cluster (TP or wide-EP
engine instances), runs the planner (``plan_routing``, the routing
plan ``plan_update`` wraps) for this design in direct and compat mode (compat also with a
pull per node, ``compat_per_node``), and turns the routing
table into bytes per trainer node, per rollout GPU NIC and per NVLink; naive Store reads
come from the same table's demand records, NCCL broadcast from a ring model. A pure
estimator turns bytes into seconds under a stated bandwidth and pipelining model; every
assumption is written into the JSON. Every approach is also compared with the scenario's
physical bound (:func:`physical_bound`): the bytes the busiest NIC must carry whatever the
transport.

Why a simulator: this machine has 2 cores and no RDMA; the planner is the part that decides
what crosses every NIC, and it runs here at full 1T scale.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mooncake_rl.generations.assignment import TrainerTopology, assign_publishers
from mooncake_rl.plan import CompatDemand, DirectDemand, PlanParams, RoutingTable, plan_routing
from mooncake_rl.plan.merge import merge_demands
from mooncake_rl.plan.shapes import (
    DTYPES,
    LAYOUTS,
    MODELS,
    ModelShape,
    cluster,
    model_shape,
    weight_manifest,
)
from mooncake_rl.plan.source import source_layout
from mooncake_rl.plan.targets import demand_set
from mooncake_rl.plan.topology import Topology

POOLING = ("per_node", "per_gpu")
# compat_per_node: compat with a pull per node (``PlanParams.pull``), each node reading the
# model itself and fanning it out over NVLink as its reads land.
MODES = ("direct", "compat", "compat_per_node")
I64 = np.int64


@dataclass(frozen=True)
class Cluster:
    """Trainer and rollout hardware. One NIC per GPU; bandwidths are per GPU, per direction."""

    trainer_gpus: int = 256
    trainer_gpus_per_node: int = 8
    rollout_instances: int = 16
    rollout_tp: int = 8  # GPUs of one engine instance (TP size, or EP size with layout "ep")
    rollout_layout: str = "tp"  # "tp", or "ep": wide EP with data-parallel attention (shapes)
    rollout_gpus_per_node: int = 8
    nic_gbps: float = 400.0  # line rate of each GPU's NIC, Gb/s
    nvlink_gbs: float = 450.0  # GB/s per GPU per direction (NVLink 4: 900 GB/s both ways)
    pcie_gbs: float = 55.0  # GB/s per GPU host<->device (pinned H2D measured on the H200)
    nic_efficiency: float = 0.9  # fraction of NIC line rate large RDMA transfers reach
    nvlink_efficiency: float = 0.8  # fraction of NVLink bandwidth copies reach
    gpu_memory_gb: float = 141.0  # H200
    nic_pooling: str = "per_node"  # how rollout GPUs share NICs; see assumptions()

    def __post_init__(self) -> None:
        for name in (
            "trainer_gpus",
            "trainer_gpus_per_node",
            "rollout_instances",
            "rollout_tp",
            "rollout_gpus_per_node",
        ):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("nic_gbps", "nvlink_gbs", "pcie_gbs", "gpu_memory_gb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("nic_efficiency", "nvlink_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if self.trainer_gpus % self.trainer_gpus_per_node:
            raise ValueError("trainer GPUs must fill whole nodes")
        if self.nic_pooling not in POOLING:
            raise ValueError(f"nic_pooling must be one of {POOLING}")
        if self.rollout_layout not in LAYOUTS:
            raise ValueError(f"rollout_layout must be one of {LAYOUTS}")

    @property
    def trainer_nodes(self) -> int:
        return self.trainer_gpus // self.trainer_gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        return self.rollout_instances * self.rollout_tp

    @property
    def rollout_nodes(self) -> int:
        return math.ceil(self.rollout_gpus / self.rollout_gpus_per_node)

    @property
    def nic_bytes_per_s(self) -> float:
        """What one NIC moves per direction, efficiency applied."""
        return self.nic_gbps / 8 * 1e9 * self.nic_efficiency

    @property
    def gpu_nic_bytes_per_s(self) -> float:
        """NIC <-> GPU memory (GPUDirect RDMA): the NIC, capped by the GPU's PCIe link."""
        return min(self.nic_bytes_per_s, self.pcie_gbs * 1e9)

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gbs * 1e9 * self.nvlink_efficiency


@dataclass(frozen=True)
class Scenario:
    """What to simulate: a model shape from ``shapes.MODELS`` on a cluster."""

    model: str = "kimi-k2"
    cluster: Cluster = field(default_factory=Cluster)
    dtype: str = "bfloat16"  # rollout weights: bfloat16, or fp8 (e4m3 + 128x128 block scales)
    modes: tuple[str, ...] = MODES
    batch_bytes: int = PlanParams().batch_bytes
    balance_slack: float = PlanParams().balance_slack  # the planner's chunking knob
    broadcast_chunk_bytes: int = 4 << 20  # NCCL_BUFFSIZE default: the pipelined unit

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; one of {sorted(MODELS)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}")
        if not self.modes or set(self.modes) - set(MODES):
            raise ValueError(f"modes must be a non-empty subset of {MODES}")
        if "direct" not in self.modes:
            raise ValueError("direct mode is needed: naive reads come from its demands")
        for name in ("batch_bytes", "broadcast_chunk_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int")
        if not 0 < self.balance_slack <= 1:
            raise ValueError(f"balance_slack must lie in (0, 1], got {self.balance_slack}")


@dataclass(frozen=True, eq=False)
class Traffic:
    """Bytes one approach moves, per endpoint (arrays: per trainer node / per rollout GPU)."""

    store_read_bytes: int
    pushed_bytes: int  # GPU-to-GPU sends, intra- and cross-node
    cross_node_pushed_bytes: int
    delivered_bytes: int  # bytes landing in rollout GPUs' buffers
    trainer_node_out: np.ndarray  # Store reads served by each trainer node's NICs
    trainer_gpu_out: int  # bytes one trainer GPU sends through its own NIC (broadcast root)
    reads_per_gpu: np.ndarray  # Store reads landing in each rollout GPU
    gpu_nic_in: np.ndarray  # Store reads + cross-node pushes received
    gpu_nic_out: np.ndarray  # cross-node pushes sent
    nvlink_in: np.ndarray  # stage 1 intra-node pushes received
    nvlink_out: np.ndarray  # stage 1 intra-node pushes sent
    stage2_nvlink_in: np.ndarray  # after the barrier (relays to their node's consumers)
    stage2_nvlink_out: np.ndarray
    gpu_node: np.ndarray  # rollout node index of each GPU
    hops: int  # sequential transfers one batch passes through (fill and drain)
    batch_bytes: int
    extra_receive_bytes_per_gpu: int  # GPU memory beyond the weights: buffers, staging

    def node_nic_bytes(self) -> np.ndarray:
        """Per rollout node: Store reads by its GPUs + bytes they pushed to other nodes."""
        return np.bincount(self.gpu_node, self.reads_per_gpu + self.gpu_nic_out).astype(I64)


def _bincount(index: np.ndarray, weights: np.ndarray, length: int) -> np.ndarray:
    """Exact integer sums (float64 bincount is exact below 2**53 bytes)."""
    return np.rint(np.bincount(index, weights.astype(np.float64), minlength=length)).astype(I64)


def trainer_nodes_of(model: ModelShape, trainer_nodes: int) -> dict[str, int]:
    """Trainer node holding each published tensor: the publisher assignment
    (``generations.assignment``), which picks the node with the fewest bytes first, so one
    rank per node yields the same nodes as the full rank topology."""
    labels = tuple(f"trainer{n:04d}" for n in range(trainer_nodes))
    ranks = assign_publishers(((t.name, t.nbytes) for t in model.tensors), TrainerTopology(labels))
    return dict(ranks)


def ours_traffic(table: RoutingTable, trainer_of_object: np.ndarray, trainer_nodes: int) -> Traffic:
    """This design: every read and push record of the routing table, stage by stage."""
    n = len(table.workers)
    node = np.asarray(table.worker_node, I64)
    reads, pushes = table.reads, table.pushes
    read_bytes = reads["length"].astype(I64) * reads["count"]
    push_bytes = pushes["length"].astype(I64) * pushes["count"]
    sender, peer = pushes["worker"].astype(I64), pushes["peer"].astype(I64)
    cross = node[sender] != node[peer]
    stage1 = pushes["stage"] == 1
    if (cross & ~stage1).any():
        raise ValueError("stage-2 pushes must stay inside a node")
    reads_per_gpu = _bincount(reads["worker"].astype(I64), read_bytes, n)
    gpu_nic_in = reads_per_gpu + _bincount(peer[cross], push_bytes[cross], n)
    local1, local2 = ~cross & stage1, ~stage1
    staging = table.region_sizes[table.region_sizes["region"] == 0]["size"]
    extra = int(staging.max()) if len(staging) else 0
    if table.compat is not None:
        extra += int(table.compat.total_bytes)  # the compat region holds every full tensor
    return Traffic(
        store_read_bytes=int(read_bytes.sum()),
        pushed_bytes=int(push_bytes.sum()),
        cross_node_pushed_bytes=int(push_bytes[cross].sum()),
        delivered_bytes=int(table.totals.delivered_bytes.sum()),
        trainer_node_out=_bincount(
            trainer_of_object[reads["object"].astype(I64)], read_bytes, trainer_nodes
        ),
        trainer_gpu_out=0,
        gpu_nic_in=gpu_nic_in,
        gpu_nic_out=_bincount(sender[cross], push_bytes[cross], n),
        nvlink_in=_bincount(peer[local1], push_bytes[local1], n),
        nvlink_out=_bincount(sender[local1], push_bytes[local1], n),
        stage2_nvlink_in=_bincount(peer[local2], push_bytes[local2], n),
        stage2_nvlink_out=_bincount(sender[local2], push_bytes[local2], n),
        gpu_node=node,
        hops=2,  # a batch is read, then pushed
        batch_bytes=int(min(table.params.batch_bytes, reads_per_gpu.max())),
        extra_receive_bytes_per_gpu=extra,
        reads_per_gpu=reads_per_gpu,
    )


def _reads_only(
    reads_per_gpu: np.ndarray,
    trainer_node_out: np.ndarray,
    node: np.ndarray,
    extra: int,
) -> Traffic:
    zeros = np.zeros(len(reads_per_gpu), I64)
    return Traffic(
        store_read_bytes=int(reads_per_gpu.sum()),
        pushed_bytes=0,
        cross_node_pushed_bytes=0,
        delivered_bytes=int(reads_per_gpu.sum()),
        trainer_node_out=trainer_node_out,
        trainer_gpu_out=0,
        gpu_nic_in=reads_per_gpu,
        gpu_nic_out=zeros,
        nvlink_in=zeros,
        nvlink_out=zeros,
        stage2_nvlink_in=zeros,
        stage2_nvlink_out=zeros,
        gpu_node=node,
        hops=1,
        batch_bytes=0,
        extra_receive_bytes_per_gpu=extra,
        reads_per_gpu=reads_per_gpu,
    )


def naive_traffic(
    table: RoutingTable, trainer_of_object: np.ndarray, trainer_nodes: int
) -> Traffic:
    """Every GPU reads each byte it needs from the Store itself: the table's demand records
    (direct placement: its own shards), no pushes."""
    demands = table.demands
    demand_bytes = demands["length"].astype(I64) * demands["count"]
    n = len(table.workers)
    return _reads_only(
        _bincount(demands["worker"].astype(I64), demand_bytes, n),
        _bincount(trainer_of_object[demands["object"].astype(I64)], demand_bytes, trainer_nodes),
        np.asarray(table.worker_node, I64),
        0,
    )


def naive_full_traffic(
    table: RoutingTable, trainer_of_object: np.ndarray, trainer_nodes: int
) -> Traffic:
    """Every GPU reads every whole tensor from the Store (what compat's loader consumes)."""
    n = len(table.workers)
    sizes = np.asarray(table.object_sizes, I64)
    model_bytes = int(sizes.sum())
    return _reads_only(
        np.full(n, model_bytes, I64),
        _bincount(trainer_of_object, sizes * n, trainer_nodes),
        np.asarray(table.worker_node, I64),
        model_bytes,
    )


def broadcast_traffic(
    model_bytes: int, gpu_node: np.ndarray, trainer_nodes: int, chunk_bytes: int
) -> Traffic:
    """NCCL broadcast from one trainer rank, as a pipelined ring: root -> rollout GPUs in
    order (node by node). A node's first GPU receives the model over its NIC, the others over
    NVLink; each node's last GPU sends it over its NIC to the next node."""
    n = len(gpu_node)
    first = np.r_[True, gpu_node[1:] != gpu_node[:-1]]
    last = np.r_[gpu_node[1:] != gpu_node[:-1], True]
    has_next = np.r_[np.ones(n - 1, bool), False]
    model = np.int64(model_bytes)
    trainer_node_out = np.zeros(trainer_nodes, I64)
    trainer_node_out[0] = model
    return Traffic(
        store_read_bytes=0,
        pushed_bytes=n * model_bytes,
        cross_node_pushed_bytes=int(first.sum()) * model_bytes,
        delivered_bytes=n * model_bytes,
        trainer_node_out=trainer_node_out,
        trainer_gpu_out=model_bytes,
        gpu_nic_in=np.where(first, model, 0).astype(I64),
        gpu_nic_out=np.where(last & has_next, model, 0).astype(I64),
        nvlink_in=np.where(~first, model, 0).astype(I64),
        nvlink_out=np.where(~last, model, 0).astype(I64),
        stage2_nvlink_in=np.zeros(n, I64),
        stage2_nvlink_out=np.zeros(n, I64),
        gpu_node=np.asarray(gpu_node, I64),
        hops=n,  # root -> GPU 0 -> ... -> GPU n-1
        batch_bytes=chunk_bytes,
        extra_receive_bytes_per_gpu=chunk_bytes,
        reads_per_gpu=np.zeros(n, I64),
    )


@dataclass(frozen=True)
class Estimate:
    stage_seconds: Mapping[str, float]  # stage 1 resources' busy seconds, overlapped
    fill_seconds: float
    stage2_seconds: float
    update_seconds: float
    bottleneck: str


def estimate(traffic: Traffic, cluster: Cluster, pooling: str | None = None) -> Estimate:
    """Seconds for one update under the pipelining model (pure).

    Stage 1 overlaps every resource batch by batch; each resource finishes after its bytes
    plus the time it must wait for work (``_lags``). Stage 2 (relays copying to their node's
    other consumers) starts after the barrier, as implemented.
    """
    pooling = pooling or cluster.nic_pooling
    gpu_bw, nvlink = cluster.gpu_nic_bytes_per_s, cluster.nvlink_bytes_per_s
    trainer_node_bw = cluster.trainer_gpus_per_node * cluster.nic_bytes_per_s
    if pooling == "per_gpu":
        nic_bw, group = gpu_bw, np.arange(len(traffic.gpu_node))
    else:
        nic_bw, group = cluster.rollout_gpus_per_node * gpu_bw, traffic.gpu_node
    nic_in = np.bincount(group, traffic.gpu_nic_in) / nic_bw
    reads = np.bincount(group, traffic.reads_per_gpu) / nic_bw
    fill = (traffic.hops - 1) * traffic.batch_bytes / gpu_bw
    busy = {
        "trainer_node_nic_out": float(traffic.trainer_node_out.max() / trainer_node_bw),
        "trainer_gpu_nic_out": traffic.trainer_gpu_out / gpu_bw,
        "rollout_nic_in": nic_in,
        "rollout_nic_out": float(np.bincount(group, traffic.gpu_nic_out).max() / nic_bw),
        "nvlink": float(max(traffic.nvlink_in.max(), traffic.nvlink_out.max()) / nvlink),
    }
    lag = _lags(traffic.hops, fill, reads)
    finish = {k: float(np.max(v + lag[k] * (np.asarray(v) > 0))) for k, v in busy.items()}
    stage2 = float(max(traffic.stage2_nvlink_in.max(), traffic.stage2_nvlink_out.max()) / nvlink)
    bottleneck = max(finish, key=lambda k: finish[k])
    stages = {k: float(np.max(v)) for k, v in busy.items()}
    return Estimate(stages, fill, stage2, finish[bottleneck] + stage2, bottleneck)


def _lags(hops: int, fill: float, own_reads: np.ndarray) -> dict[str, Any]:
    """How long each stage-1 resource waits for work beyond its own bytes (pure).

    A ring (broadcast) passes its last chunk through every hop after the busiest one has
    sent it, so every resource drains for ``fill``. Read-then-push (hops 2): what a reader
    reads it consumes, so its batches take no staging and the executor's reads run ahead of
    its pushes. Pushes (NIC-out, NVLink) start after a reader's first batch, and the
    trainers' last read batch still has its pushes to make: both lag ``fill``. A rollout
    NIC-in starts at once with its own reads and then takes the pushes other readers have
    had ``fill`` to prepare: it waits only for the part of ``fill`` its own reads do not
    cover (the stage can end no earlier, and the trainers' and senders' lags bound the tail).
    """
    if hops != 2:
        return dict.fromkeys(_STAGE1, fill)
    return {
        **dict.fromkeys(_STAGE1, fill),
        "rollout_nic_in": np.maximum(fill - own_reads, 0.0),
    }


_STAGE1 = (
    "trainer_node_nic_out",
    "trainer_gpu_nic_out",
    "rollout_nic_in",
    "rollout_nic_out",
    "nvlink",
)


def publish_seconds(trainer_node_bytes: np.ndarray, cluster: Cluster) -> float:
    """Trainer GPUs copy their published tensors into the node-local host segment (D2H)."""
    return float(
        trainer_node_bytes.max() / (cluster.trainer_gpus_per_node * cluster.pcie_gbs * 1e9)
    )


def node_demand_bytes(manifest: Any, topology: Topology, demand: DirectDemand) -> np.ndarray:
    """Distinct bytes each rollout node's GPUs hold, from the planner's own demand merge
    (disjoint source ranges with their consumers): a range counts once per node that
    consumes it, however many of the node's GPUs hold it."""
    ranges = merge_demands(demand_set(manifest, source_layout(manifest), topology, demand))
    nodes = len(topology.nodes)
    nbytes = (ranges.r1 - ranges.r0) * (ranges.c1 - ranges.c0)
    owner = np.repeat(np.arange(len(ranges), dtype=I64), np.diff(ranges.ptr))
    pairs = np.unique(owner * nodes + np.asarray(topology.worker_node, I64)[ranges.worker])
    return _bincount(pairs % nodes, nbytes[pairs // nodes], nodes)


@dataclass(frozen=True)
class Bound:
    """The least time any transport needs at these NICs (the physical bound).

    Every byte a rollout node's GPUs hold enters that node through its NICs at least once
    (copies between its GPUs may use NVLink), and every published byte leaves its trainer
    node's NICs at least once; each side at its NICs' pooled bandwidth. Fill, control
    round trips and stage 2 are not in it, so no estimate reaches ratio 1 exactly.
    """

    rollout_node_bytes: int  # distinct bytes the busiest rollout node needs
    trainer_node_bytes: int  # published bytes of the busiest trainer node
    rollout_seconds: float
    trainer_seconds: float

    @property
    def seconds(self) -> float:
        return max(self.rollout_seconds, self.trainer_seconds)

    @property
    def bottleneck(self) -> str:
        if self.rollout_seconds >= self.trainer_seconds:
            return "rollout_node_nic_in"
        return "trainer_node_nic_out"

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 4),
            "bottleneck": self.bottleneck,
            "max_rollout_node_distinct_bytes": self.rollout_node_bytes,
            "rollout_node_nic_in_seconds": round(self.rollout_seconds, 4),
            "max_trainer_node_published_bytes": self.trainer_node_bytes,
            "trainer_node_nic_out_seconds": round(self.trainer_seconds, 4),
        }


def physical_bound(node_bytes: np.ndarray, published: np.ndarray, cluster: Cluster) -> Bound:
    """The bound of one scenario (pure): see :class:`Bound`."""
    rollout_bw = cluster.rollout_gpus_per_node * cluster.gpu_nic_bytes_per_s
    trainer_bw = cluster.trainer_gpus_per_node * cluster.nic_bytes_per_s
    return Bound(
        int(node_bytes.max()),
        int(published.max()),
        float(node_bytes.max() / rollout_bw),
        float(published.max() / trainer_bw),
    )


def summarize(
    traffic: Traffic,
    cluster: Cluster,
    weights_per_gpu: int,
    published: np.ndarray | None,
    extra: Mapping[str, Any],
    bound: Bound,
) -> dict[str, Any]:
    """One approach's figures: bytes per endpoint, the estimate, memory feasibility."""
    chosen = estimate(traffic, cluster)
    pooled = {p: estimate(traffic, cluster, p).update_seconds for p in POOLING}
    node_in = np.bincount(traffic.gpu_node, traffic.gpu_nic_in)
    node_out = np.bincount(traffic.gpu_node, traffic.gpu_nic_out)
    publish = publish_seconds(published, cluster) if published is not None else 0.0
    memory = weights_per_gpu + traffic.extra_receive_bytes_per_gpu
    return {
        **extra,
        "store_read_bytes": traffic.store_read_bytes,
        "pushed_bytes": traffic.pushed_bytes,
        "cross_node_pushed_bytes": traffic.cross_node_pushed_bytes,
        "delivered_bytes": traffic.delivered_bytes,
        "max_node_nic_bytes": int(traffic.node_nic_bytes().max()),
        "max_trainer_node_nic_out_bytes": int(traffic.trainer_node_out.max()),
        "min_trainer_node_nic_out_bytes": int(traffic.trainer_node_out.min()),
        "max_rollout_gpu_nic_in_bytes": int(traffic.gpu_nic_in.max()),
        "max_rollout_gpu_nic_out_bytes": int(traffic.gpu_nic_out.max()),
        "max_rollout_node_nic_in_bytes": int(node_in.max()),
        "max_rollout_node_nic_out_bytes": int(node_out.max()),
        "max_gpu_nvlink_bytes_stage1": int(max(traffic.nvlink_in.max(), traffic.nvlink_out.max())),
        "max_gpu_nvlink_bytes_stage2": int(
            max(traffic.stage2_nvlink_in.max(), traffic.stage2_nvlink_out.max())
        ),
        "stage_seconds": {k: round(v, 4) for k, v in chosen.stage_seconds.items()},
        "fill_seconds": round(chosen.fill_seconds, 4),
        "stage2_seconds": round(chosen.stage2_seconds, 4),
        "bottleneck": chosen.bottleneck,
        "update_seconds": round(chosen.update_seconds, 3),
        "bound_ratio": round(chosen.update_seconds / bound.seconds, 3),
        **{f"update_seconds_{p}_nics": round(s, 3) for p, s in pooled.items()},
        "publish_seconds": round(publish, 3),
        "end_to_end_seconds": round(publish + chosen.update_seconds, 3),
        "gpu_memory_bytes_needed": memory,
        "fits_gpu_memory": memory <= cluster.gpu_memory_gb * 1e9,
    }


def assumptions(scenario: Scenario) -> dict[str, Any]:
    """Every modelling choice, with the numbers used (written into the output)."""
    c = scenario.cluster
    return {
        "state_dtype": f"{scenario.dtype} rollout weights. fp8: every 2-D linear weight but "
        "the embeddings, lm_head and MoE router gates in e4m3 (1 byte), each followed by its "
        "float32 weight_scale_inv, one per 128 x 128 block, sharded like the weight (the "
        "DeepSeek-V3 / Kimi-K2 checkpoint layout); norms, biases and those weights bf16, "
        "the e_score_correction_bias vectors float32",
        "nics_per_node": "one NIC per GPU: nics per node = GPUs per node (trainer "
        f"{c.trainer_gpus_per_node}, rollout {c.rollout_gpus_per_node})",
        "nic_line_rate_gbps": c.nic_gbps,
        "nic_efficiency": c.nic_efficiency,
        "nic_bytes_per_s": c.nic_bytes_per_s,
        "full_duplex": "a NIC's inbound and outbound directions are independent; a stage's "
        "time on it is max(in, out) / bandwidth",
        "gpudirect": "rollout NIC <-> GPU memory by GPUDirect RDMA across the GPU's PCIe link: "
        f"per-GPU path = min(NIC, PCIe {c.pcie_gbs} GB/s) = {c.gpu_nic_bytes_per_s:.4g} B/s",
        "nvlink_gbs_per_direction": c.nvlink_gbs,
        "nvlink_efficiency": c.nvlink_efficiency,
        "rollout_nic_pooling": f"{c.nic_pooling} (update_seconds). per_node: a rollout node's "
        "traffic spreads over all its NICs (TE multi-NIC striping; NCCL channels on every "
        "NIC), so a node stage takes max(node NIC-in, node NIC-out) / (NICs x bandwidth), the "
        "model the planner balances. per_gpu: each GPU's reads and pushes use only its own "
        "NIC (the planner balances per node, not per GPU, so this exposes per-GPU skew). "
        "Both are reported as update_seconds_per_node_nics / update_seconds_per_gpu_nics",
        "trainer_store_segments": "published objects live in trainer nodes' host-memory "
        "segments (publisher's node, replica 1); a Store read is NIC-out on the holding node, "
        "striped over all of that node's NICs",
        "publisher_assignment": "mooncake_rl.generations.assignment: byte-balanced over "
        "trainer nodes in checkpoint order (node chosen first, so one rank per node gives "
        "the same nodes)",
        "rollout_placement": f"layout {c.rollout_layout}. Engine instances of "
        f"{c.rollout_tp} GPUs packed onto rollout nodes in order. tp: TP ranks, MoE routed "
        "experts EP over the instance's TP ranks in contiguous blocks. ep (wide EP, as vLLM's "
        "--data-parallel-size N --enable-expert-parallel with TP 1): each routed expert on "
        "exactly one GPU of the instance (contiguous blocks), every other tensor (attention, "
        "dense MLPs, shared experts, embeddings, norms) whole on every GPU "
        "(mooncake_rl.plan.shapes)",
        "physical_bound": "max(distinct bytes the GPUs of the busiest rollout node hold / "
        "that node's pooled NIC bandwidth, published bytes of the busiest trainer node / its "
        "pooled NIC bandwidth): every byte a rollout node holds enters it through its NICs "
        "at least once, every published byte leaves its trainer node at least once. "
        "bound_ratio = update_seconds / bound seconds",
        "pipeline": "stage 1 (Store reads, cross-node pushes, intra-node pushes) overlaps "
        "batch by batch: time = the latest resource's busy seconds + the time it waits for "
        "work, fill = (hops - 1) x batch_bytes / per-GPU NIC bandwidth (hops: read then push "
        "= 2). Read then push: pushes (NIC-out, NVLink) and the trainers (whose last batch "
        "still has pushes to make) wait one fill; a rollout NIC-in starts with its own reads "
        "(readers consume what they read, so the executor's reads run ahead of its pushes) "
        "and waits only for the part of fill they do not cover. A ring waits one fill on "
        "every resource. Stage 2 (relays copying to their node's other consumers over "
        "NVLink) starts after the coordinator's barrier, as implemented",
        "batch_bytes": scenario.batch_bytes,
        "compat_per_node": "compat mode with PlanParams(pull='node'): each rollout node "
        "reads every byte its GPUs need from the Store itself (the Store serves the model "
        "once per node, from the trainers' NICs), spread over its GPUs, and each read is "
        "pushed to the node's other GPUs over NVLink in stage 1, as soon as its batch "
        "lands: no cross-node pushes, no stage 2. Each node starts its walk through the "
        "objects at its own place, so the trainers are asked evenly over time; the estimate "
        "counts each trainer node's bytes, not when they are asked",
        "naive_store": "no pushes: every rollout GPU reads the bytes it needs (direct "
        "placement: its shards, from the planner's demand records) from the Store itself; "
        "naive_store_full: every GPU reads every whole tensor",
        "nccl_broadcast": "one trainer rank (the root) broadcasts the full model to every "
        "rollout GPU (world = 1 + rollout GPUs, as NCCL-broadcast transports build it). Ring, "
        "pipelined in broadcast_chunk_bytes: time = model_bytes / slowest hop + (hops - 1) x "
        "chunk / per-GPU NIC bandwidth; the root hop leaves the trainer node through the "
        "root GPU's one NIC (no other trainer GPU is in the communicator), so pooling NICs "
        "does not help it; each rollout node receives the model once over a NIC and passes "
        "it GPU to GPU over NVLink",
        "broadcast_chunk_bytes": scenario.broadcast_chunk_bytes,
        "publish": "Store approaches first copy each published tensor GPU -> host segment "
        f"(D2H at PCIe {c.pcie_gbs} GB/s per GPU, all GPUs of a node at once); reported as "
        "publish_seconds and end_to_end_seconds, not in update_seconds. Broadcast sends from "
        "GPU memory and has no publish step",
        "gpu_memory": f"{c.gpu_memory_gb} GB per GPU; needed = resident weights of the "
        "placement + receive buffers (compat: the full-model receive region + staging; "
        "direct: staging; broadcast: one chunk)",
        "excluded": "trainer-side full-tensor reconstruction (FSDP all-gather) for every "
        "approach, and for broadcast gathering the full model into the root; engine "
        "load_weights / repacking; control plane (drain, prepare, barrier and commit round "
        "trips); per-operation RDMA latency; congestion and switch oversubscription",
    }


def simulate(scenario: Scenario, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Plan the scenario with the real planner and estimate every approach."""
    say = progress or (lambda _: None)
    c = scenario.cluster
    say(f"build {scenario.model} {scenario.dtype} shape and manifest")
    started = time.perf_counter()
    model = model_shape(scenario.model, scenario.dtype)
    manifest = weight_manifest(model, 1)
    topology, direct_demand = cluster(
        model, c.rollout_instances, c.rollout_tp, c.rollout_gpus_per_node, c.rollout_layout
    )
    say("assign published tensors to trainer nodes")
    by_name = trainer_nodes_of(model, c.trainer_nodes)
    published = np.zeros(c.trainer_nodes, I64)
    for spec in model.tensors:
        published[by_name[spec.name]] += spec.nbytes
    say("distinct bytes per rollout node (the physical bound)")
    bound = physical_bound(node_demand_bytes(manifest, topology, direct_demand), published, c)
    setup_seconds = time.perf_counter() - started
    params = PlanParams(batch_bytes=scenario.batch_bytes, balance_slack=scenario.balance_slack)
    approaches: dict[str, dict[str, Any]] = {}
    weights_per_gpu = 0
    for mode in sorted(scenario.modes, key=MODES.index):  # direct first
        say(f"plan {mode} mode (real planner)")
        started = time.perf_counter()
        demand = direct_demand if mode == "direct" else CompatDemand()
        pulled = replace(params, pull="node") if mode == "compat_per_node" else params
        table = plan_routing(manifest, topology, demand, params=pulled)
        plan_seconds = time.perf_counter() - started
        trainer_of_object = np.array([by_name[name] for name in table.objects], I64)
        say(f"account {mode} bytes")
        planned = {
            "planned_by": "mooncake_rl.plan.plan_routing",
            "plan_seconds": round(plan_seconds, 2),
            "reads": len(table.reads),
            "pushes": len(table.pushes),
            "unique_demand_bytes": table.totals.unique_demand_bytes,
        }
        if mode == "direct":
            weights_per_gpu = int(table.totals.demanded_bytes.max())
            approaches["direct"] = summarize(
                ours_traffic(table, trainer_of_object, c.trainer_nodes),
                c,
                weights_per_gpu,
                published,
                planned,
                bound,
            )
            approaches["naive_store"] = summarize(
                naive_traffic(table, trainer_of_object, c.trainer_nodes),
                c,
                weights_per_gpu,
                published,
                {"planned_by": "the direct table's demand records (no routing)"},
                bound,
            )
            approaches["naive_store_full"] = summarize(
                naive_full_traffic(table, trainer_of_object, c.trainer_nodes),
                c,
                weights_per_gpu,
                published,
                {"planned_by": "every GPU reads every object"},
                bound,
            )
            gpu_node = np.asarray(table.worker_node, I64)
        else:
            approaches[mode] = summarize(
                ours_traffic(table, trainer_of_object, c.trainer_nodes),
                c,
                weights_per_gpu,
                published,
                planned,
                bound,
            )
        del table
    approaches["nccl_broadcast"] = summarize(
        broadcast_traffic(model.nbytes, gpu_node, c.trainer_nodes, scenario.broadcast_chunk_bytes),
        c,
        weights_per_gpu,
        None,
        {"planned_by": "ring model (see assumptions.nccl_broadcast)"},
        bound,
    )
    order = [a for a in ("direct", "compat", "compat_per_node", "naive_store",
                         "naive_store_full", "nccl_broadcast") if a in approaches]  # fmt: skip
    approaches = {a: approaches[a] for a in order}
    params_count = model.parameters
    return {
        "bench": "simulate",
        "scenario": {
            "model": scenario.model,
            "dtype": scenario.dtype,
            "parameters": params_count,
            "tensors": len(model.tensors),
            "model_bytes": model.nbytes,
            "cluster": asdict(c),
            "trainer_nodes": c.trainer_nodes,
            "rollout_gpus": c.rollout_gpus,
            "rollout_nodes": c.rollout_nodes,
            "published_bytes_per_trainer_node": {
                "max": int(published.max()),
                "min": int(published.min()),
            },
            "rollout_weight_bytes_per_gpu": weights_per_gpu,
            "physical_bound": bound.to_json(),
            "setup_seconds": round(setup_seconds, 2),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "summary": (
                f"{scenario.model} ({params_count / 1e9:.0f}B params, {model.nbytes / 1e12:.2f} "
                f"TB {scenario.dtype}): {c.trainer_gpus} trainer GPUs ({c.trainer_nodes} x "
                f"{c.trainer_gpus_per_node}) -> {c.rollout_instances} x "
                f"{c.rollout_layout.upper()}{c.rollout_tp} rollout GPUs, {c.nic_gbps:g} Gb/s "
                "per GPU"
            ),
        },
        "assumptions": assumptions(scenario),
        "approaches": approaches,
        "ratios": {
            name: {
                key: round(figures[key] / approaches["direct"][key], 3)
                if approaches["direct"][key]
                else None
                for key in (
                    "update_seconds",
                    "store_read_bytes",
                    "max_trainer_node_nic_out_bytes",
                    "max_rollout_gpu_nic_in_bytes",
                )
            }
            for name, figures in approaches.items()
        },
    }


def parser() -> argparse.ArgumentParser:
    d = Cluster()
    p = argparse.ArgumentParser(
        prog="mooncake-rl bench simulate", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", choices=sorted(MODELS), default=Scenario().model)
    p.add_argument("--trainer-gpus", type=int, default=d.trainer_gpus)
    p.add_argument("--trainer-gpus-per-node", type=int, default=d.trainer_gpus_per_node)
    p.add_argument("--instances", type=int, default=d.rollout_instances, help="rollout engines")
    p.add_argument("--tp", type=int, default=d.rollout_tp, help="GPUs per rollout engine")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default=d.rollout_layout,
        help="tp: TP ranks (experts EP over them); ep: each expert once per engine, the rest "
        "on every GPU (vLLM's data-parallel attention with expert parallelism)",
    )
    p.add_argument("--dtype", choices=DTYPES, default=Scenario().dtype, help="rollout weights")
    p.add_argument("--rollout-gpus-per-node", type=int, default=d.rollout_gpus_per_node)
    p.add_argument("--nic-gbps", type=float, default=d.nic_gbps, help="per GPU NIC, Gb/s")
    p.add_argument("--nvlink-gbs", type=float, default=d.nvlink_gbs, help="GB/s per direction")
    p.add_argument("--pcie-gbs", type=float, default=d.pcie_gbs)
    p.add_argument("--nic-efficiency", type=float, default=d.nic_efficiency)
    p.add_argument("--nvlink-efficiency", type=float, default=d.nvlink_efficiency)
    p.add_argument("--gpu-memory-gb", type=float, default=d.gpu_memory_gb)
    p.add_argument("--nic-pooling", choices=POOLING, default=d.nic_pooling)
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="a comma list of " + ", ".join(MODES) + " (direct is needed)",
    )
    p.add_argument("--batch-bytes", type=int, default=Scenario().batch_bytes)
    p.add_argument(
        "--balance-slack",
        type=float,
        default=Scenario().balance_slack,
        help="the planner's chunking knob: larger chunks, fewer pushes, a looser NIC balance",
    )
    p.add_argument("--out", help="also write a PNG plot here")
    return p


def scenario_from(args: argparse.Namespace) -> Scenario:
    return Scenario(
        model=args.model,
        cluster=Cluster(
            trainer_gpus=args.trainer_gpus,
            trainer_gpus_per_node=args.trainer_gpus_per_node,
            rollout_instances=args.instances,
            rollout_tp=args.tp,
            rollout_layout=args.layout,
            rollout_gpus_per_node=args.rollout_gpus_per_node,
            nic_gbps=args.nic_gbps,
            nvlink_gbs=args.nvlink_gbs,
            pcie_gbs=args.pcie_gbs,
            nic_efficiency=args.nic_efficiency,
            nvlink_efficiency=args.nvlink_efficiency,
            gpu_memory_gb=args.gpu_memory_gb,
            nic_pooling=args.nic_pooling,
        ),
        dtype=args.dtype,
        modes=tuple(m for m in args.modes.split(",") if m),
        batch_bytes=args.batch_bytes,
        balance_slack=args.balance_slack,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    scenario = scenario_from(args)
    from mooncake_rl.progress import progress

    with progress("simulate") as steps:
        result = simulate(scenario, steps.step)
    if args.out:
        from bench.plot import plot_simulation

        result["plot"] = str(plot_simulation(result, Path(args.out)))
    print(json.dumps(result, indent=2))
    return 0
