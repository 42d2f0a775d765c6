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
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations import delta, fp8
from mooncake_rl.generations.assignment import TrainerTopology, assign_publishers
from mooncake_rl.generations.checksums import BLOCK_BYTES, block_spans
from mooncake_rl.generations.pack_order import (
    PackOrder,
    piece_placements,
    rank_major_packs,
    run_starts,
)
from mooncake_rl.generations.packing import DEFAULT_PACK_BYTES, check_pack_bytes, pack_layout
from mooncake_rl.plan import (
    CompatDemand,
    DirectDemand,
    PlanParams,
    RoutingTable,
    grid,
    plan_routing,
)
from mooncake_rl.plan.delta import choose_readers
from mooncake_rl.plan.merge import merge_demands
from mooncake_rl.plan.shapes import (
    DTYPES,
    ITEMSIZE,
    LAYOUTS,
    MODELS,
    ModelShape,
    cluster,
    instance_parts,
    model_shape,
    weight_manifest,
)
from mooncake_rl.plan.source import source_layout
from mooncake_rl.plan.targets import demand_set
from mooncake_rl.plan.topology import Topology

POOLING = ("per_node", "per_gpu")
# Fixed microseconds per native operation, besides its bytes: (Store read per distinct object
# key in one call, per further range of that key, Transfer Engine write per range).
# tcp: measured on this project's host by ``python -m bench.ops`` (loopback TCP, Mooncake
# 0.3.13; docs/performance.md). rdma, writes and ranges: Mooncake's transfer_engine_bench
# on one ConnectX-7 400G NIC, one thread, batches of 1,538 requests, moved 1 KiB blocks at
# 1.54 GB/s (PaddlePaddle/FastDeploy, fastdeploy/cache_manager/transfer_factory/
# kvcache_transfer/README_CN.md): 0.66 us a request, rounded up to 1 us. Mooncake's own docs
# publish no per-request figure we found. rdma, per key: an ESTIMATE, not a citation (the
# key's master lookup and lease stay RPCs; 25 us, a sixth of the TCP key cost).
OP_COSTS = {
    "tcp": (110.0, 70.0, 30.0),
    "rdma": (25.0, 1.0, 1.0),
    "none": (0.0, 0.0, 0.0),
}
OP_COST_SOURCES = {
    "tcp": "measured here: python -m bench.ops (loopback TCP, Mooncake 0.3.13.post1)",
    "rdma": "writes and extra ranges: Mooncake transfer_engine_bench, 1 KiB blocks at 1.54 "
    "GB/s on one ConnectX-7 400G, 1 thread, batch 1,538 = 0.66 us a request, rounded to 1 us "
    "(cited in PaddlePaddle/FastDeploy fastdeploy/cache_manager/transfer_factory/"
    "kvcache_transfer/README_CN.md; Mooncake's own docs publish no per-request figure we "
    "found). Per key: 25 us, an ESTIMATE (master lookup and lease per key), not cited",
    "none": "no per-operation cost (the byte model alone)",
}
OP_COST_FIELDS = ("store_read_key_us", "store_read_range_us", "push_us")
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
    store_read_key_us: float = OP_COSTS["tcp"][0]  # per distinct object in one read call
    store_read_range_us: float = OP_COSTS["tcp"][1]  # per further range of that object
    push_us: float = OP_COSTS["tcp"][2]  # per Transfer Engine write (one range)

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
        for name in OP_COST_FIELDS:
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be a non-negative number of microseconds")
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

    def with_op_costs(self, preset: str) -> Cluster:
        """This cluster with the per-operation costs of ``preset`` (``OP_COSTS``)."""
        return replace(self, **dict(zip(OP_COST_FIELDS, OP_COSTS[preset], strict=True)))


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
    pack_bytes: int = DEFAULT_PACK_BYTES  # the publisher's pack size; 0: one object per tensor
    pack_order: bool = True  # packs rank by rank, as publishes after the first update are
    delta_change_rate: float | None = None  # fraction of elements a step changes; None: no delta

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
        if self.pack_bytes != 0:
            try:
                check_pack_bytes(self.pack_bytes)
            except InvariantViolation as error:
                raise ValueError(f"pack_bytes: 0 (no packs) or {error}") from None
        if self.delta_change_rate is not None and not 0 <= self.delta_change_rate <= 1:
            raise ValueError(f"delta_change_rate must lie in [0, 1], got {self.delta_change_rate}")


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

    def received_per_gpu(self) -> np.ndarray:
        """Per rollout GPU: the bytes landing in it, read from the Store or pushed to it."""
        return self.gpu_nic_in + self.nvlink_in + self.stage2_nvlink_in


@dataclass(frozen=True, eq=False)
class Ops:
    """Native operations each rollout GPU issues for one update (arrays, per GPU).

    Reads: per batch, one call; ``read_keys`` sums its distinct objects, ``read_ranges`` its
    ranges after merging. Pushes: per batch and peer, writes after merging (stage 1, and
    stage 2 after the barrier).
    """

    read_keys: np.ndarray
    read_ranges: np.ndarray
    pushes: np.ndarray
    stage2_pushes: np.ndarray

    def __post_init__(self) -> None:
        if (self.read_ranges < self.read_keys).any():
            raise ValueError("every object read needs at least one range")

    def read_seconds(self, cluster: Cluster) -> np.ndarray:
        """Per GPU: each object's first range at the key cost, each further one cheaper."""
        extra = self.read_ranges - self.read_keys
        return (
            self.read_keys * cluster.store_read_key_us + extra * cluster.store_read_range_us
        ) * 1e-6

    def push_seconds(self, cluster: Cluster) -> np.ndarray:
        return self.pushes * cluster.push_us * 1e-6

    def stage2_seconds(self, cluster: Cluster) -> np.ndarray:
        return self.stage2_pushes * cluster.push_us * 1e-6

    def to_json(self, cluster: Cluster) -> dict[str, Any]:
        def spread(values: np.ndarray, digits: int = 1) -> dict[str, float]:
            return {
                "max": round(float(values.max()), digits),
                "mean": round(float(values.mean()), digits),
            }

        return {
            "read_keys_per_gpu": spread(self.read_keys),
            "read_ranges_per_gpu": spread(self.read_ranges),
            "pushes_per_gpu": spread(self.pushes),
            "stage2_pushes_per_gpu": spread(self.stage2_pushes),
            "read_op_seconds_per_gpu": spread(self.read_seconds(cluster), 4),
            "push_op_seconds_per_gpu": spread(self.push_seconds(cluster), 4),
            "stage2_push_op_seconds_per_gpu": spread(self.stage2_seconds(cluster), 4),
        }


def _ranges(records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(record row, src, dst, length) of the records whose bytes are one range on both
    sides (``plan.table.record_ranges``), as the ranges they are; the others are
    :func:`_strided`."""
    length, count = records["length"].astype(I64), records["count"].astype(I64)
    row = np.flatnonzero(~_is_strided(records))
    return row, records["src_offset"][row], records["dst_offset"][row], (length * count)[row]


def _is_strided(records: np.ndarray) -> np.ndarray:
    length = records["length"]
    return (records["count"] > 1) & (
        (records["src_stride"] != length) | (records["dst_stride"] != length)
    )


def _strided_ranges(records: np.ndarray, workers: int) -> np.ndarray:
    """Per worker, the ranges its strided records issue: one per row, none merging (a row
    of a record that is not contiguous on both sides is never adjacent to the next on
    both). Counted, not expanded: a dense model's TP shards are millions of rows."""
    strided = _is_strided(records)
    return np.bincount(
        records["worker"][strided].astype(I64),
        records["count"][strided].astype(np.float64),
        workers,
    ).astype(I64)


def _merged(
    calls: Sequence[np.ndarray], spaces: Sequence[np.ndarray], src: np.ndarray,
    dst: np.ndarray, length: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Sort ranges as the executor does (by call, then source) and mark which start a native
    operation: a range merges into the previous one only in the same call and source and
    destination spaces, starting where it ends on both sides (``apply.coalesce``). Returns
    the order and the start flags in that order."""
    order = np.lexsort((dst, src, *reversed([*calls, *spaces])))
    same = np.ones(max(len(order) - 1, 0), bool)
    for key in (*calls, *spaces):
        k = key[order]
        same &= k[1:] == k[:-1]
    s, d, n = src[order], dst[order], length[order]
    adjacent = (s[1:] == s[:-1] + n[:-1]) & (d[1:] == d[:-1] + n[:-1])
    return order, np.r_[True, ~(same & adjacent)] if len(order) else np.zeros(0, bool)


def read_ops(
    records: np.ndarray, workers: int, per_batch: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Per worker: (distinct objects, merged ranges) summed over its read calls (one per
    batch; ``per_batch=False``: one call for all). Works on read or demand records."""
    row, src, dst, length = _ranges(records)
    worker = records["worker"].astype(I64)[row]
    batch = records["batch"].astype(I64)[row] if per_batch else np.zeros(len(row), I64)
    obj = records["object"].astype(I64)[row]
    region = records["dst_region"].astype(I64)[row]
    order, starts = _merged((worker, batch, obj), (region,), src, dst, length)
    ranges = np.bincount(worker[order][starts], minlength=workers)
    every = records["worker"].astype(I64)
    calls = records["batch"].astype(I64) if per_batch else np.zeros(len(records), I64)
    keyed = grid.lex_order(every, calls, records["object"].astype(I64))
    new_key = grid.group_starts(every[keyed], calls[keyed], records["object"].astype(I64)[keyed])
    keys = np.bincount(every[keyed][new_key], minlength=workers)
    return keys, ranges + _strided_ranges(records, workers)


def push_ops(records: np.ndarray, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """Per worker: merged writes of stage 1 and of stage 2 (calls: per batch and peer)."""
    row, src, dst, length = _ranges(records)
    worker, stage, batch, peer, src_region, dst_region = (
        records[name].astype(I64)[row]
        for name in ("worker", "stage", "batch", "peer", "src_region", "dst_region")
    )
    calls = (worker, stage, batch, peer)
    order, starts = _merged(calls, (src_region, dst_region), src, dst, length)
    w, st = worker[order], stage[order]
    strided = [_strided_ranges(records[records["stage"] == k], workers) for k in (1, 2)]
    return (
        np.bincount(w[starts & (st == 1)], minlength=workers) + strided[0],
        np.bincount(w[starts & (st == 2)], minlength=workers) + strided[1],
    )


def table_ops(table: RoutingTable) -> Ops:
    """The native operations the executor issues for ``table`` (``apply.executor``)."""
    n = len(table.workers)
    keys, ranges = read_ops(table.reads, n)
    pushes, stage2 = push_ops(remote_pushes(table.pushes), n)
    return Ops(keys, ranges, pushes, stage2)


def remote_pushes(pushes: np.ndarray) -> np.ndarray:
    """Pushes less local copies (a sieved span's pieces, ``plan.sieve``): those are in-memory
    copies inside one GPU, neither Transfer Engine operations nor link traffic."""
    return pushes[pushes["peer"] != pushes["worker"]]


def naive_ops(table: RoutingTable) -> Ops:
    """Every GPU reads its own demand records in one call (favours the baseline)."""
    n = len(table.workers)
    keys, ranges = read_ops(table.demands, n, per_batch=False)
    zeros = np.zeros(n, I64)
    return Ops(keys, ranges, zeros, zeros)


def naive_full_ops(table: RoutingTable) -> Ops:
    """Every GPU reads every object whole: one range per object."""
    n = len(table.workers)
    every = np.full(n, len(table.objects), I64)
    zeros = np.zeros(n, I64)
    return Ops(every, every, zeros, zeros)


def _bincount(index: np.ndarray, weights: np.ndarray, length: int) -> np.ndarray:
    """Exact integer sums (float64 bincount is exact below 2**53 bytes)."""
    return np.rint(np.bincount(index, weights.astype(np.float64), minlength=length)).astype(I64)


@dataclass(frozen=True, eq=False)
class Published:
    """A generation as the publishers store it: the manifest, each object's trainer node,
    dtype (a pack holds one) and checksum block cuts (a rank-major pack's rank runs), and the
    bytes each trainer node published."""

    manifest: Any
    node_of_object: Mapping[str, int]
    dtype_of_object: Mapping[str, str]
    cuts_of_object: Mapping[str, tuple[int, ...]]
    node_bytes: np.ndarray
    tensors: int
    packed_tensors: int

    @property
    def objects(self) -> int:
        return len(self.node_of_object)


def publish_layout(
    model: ModelShape, cluster: Cluster, pack_bytes: int, order: PackOrder | None = None
) -> Published:
    """What the publishers would store (pure): the real publisher assignment over every
    trainer rank (``generations.assignment``: a source tensor, with its fp8 block scales, to
    one rank), then each rank's packs (``packing.pack_layout``; ``pack_bytes`` 0: none),
    laid out rank by rank with ``order`` (``pack_order.rank_major_packs``), each pack's
    blocks cut where a rank's run starts, as the publisher's checksums cut them."""
    per_node = cluster.trainer_gpus_per_node
    labels = tuple(f"trainer{r // per_node:04d}" for r in range(cluster.trainer_gpus))
    heads: list[str] = []  # the source tensor each stored tensor belongs to
    sizes: dict[str, int] = {}
    for spec in model.tensors:
        previous = heads[-1] if heads else ""
        head = previous if previous and spec.name == fp8.scale_name(previous) else spec.name
        heads.append(head)
        sizes[head] = sizes.get(head, 0) + spec.nbytes
    ranks = assign_publishers(sizes.items(), TrainerTopology(labels))
    rank_of = [ranks[head] for head in heads]
    placements = (
        pack_layout(
            ((t.name, t.nbytes, t.dtype, r) for t, r in zip(model.tensors, rank_of, strict=True)),
            pack_bytes,
        )
        if pack_bytes
        else {}
    )
    cuts: dict[str, tuple[int, ...]] = {}
    if order is not None:
        specs = ((t.name, t.shape, t.nbytes) for t in model.tensors)
        packs = rank_major_packs(placements, specs, order)
        placements = piece_placements(packs)
        cuts = {pack: tuple(run_starts(pieces)) for pack, pieces in packs.items()}
    node_of_object: dict[str, int] = {}
    dtype_of_object: dict[str, str] = {}
    node_bytes = np.zeros(cluster.trainer_nodes, I64)
    for spec, rank in zip(model.tensors, rank_of, strict=True):
        placed = placements.get(spec.name)
        key = placed[0].object_name if placed else spec.name
        node_of_object[key], dtype_of_object[key] = rank // per_node, spec.dtype
        node_bytes[rank // per_node] += spec.nbytes
    return Published(
        weight_manifest(model, 1, placements),
        node_of_object,
        dtype_of_object,
        cuts,
        node_bytes,
        len(model.tensors),
        len(placements),
    )


def ours_traffic(table: RoutingTable, trainer_of_object: np.ndarray, trainer_nodes: int) -> Traffic:
    """This design: every read and push record of the routing table, stage by stage."""
    reads, pushes = table.reads, remote_pushes(table.pushes)
    read_bytes = reads["length"].astype(I64) * reads["count"]
    staging = table.region_sizes[table.region_sizes["region"] == 0]["size"]
    extra = int(staging.max()) if len(staging) else 0
    if table.compat is not None:
        extra += int(table.compat.total_bytes)  # the compat region holds every full tensor
    return _read_push_traffic(
        np.asarray(table.worker_node, I64),
        trainer_nodes,
        reads=(
            reads["worker"].astype(I64),
            trainer_of_object[reads["object"].astype(I64)],
            read_bytes,
        ),
        pushes=(
            pushes["worker"].astype(I64),
            pushes["peer"].astype(I64),
            pushes["length"].astype(I64) * pushes["count"],
            pushes["stage"] == 1,
        ),
        delivered_bytes=int(table.totals.delivered_bytes.sum()),
        batch_bytes=table.params.batch_bytes,
        extra=extra,
    )


def _read_push_traffic(
    node: np.ndarray,
    trainer_nodes: int,
    *,
    reads: tuple[np.ndarray, np.ndarray, np.ndarray],
    pushes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    delivered_bytes: int,
    batch_bytes: int,
    extra: int,
) -> Traffic:
    """A read-then-push update from its Store reads (reading GPU, serving trainer node,
    bytes) and pushes (sender, peer, bytes, whether stage 1), ``node`` each GPU's rollout
    node: pushes between nodes cross both NICs, the others NVLink. Shared by every planned
    approach (routing tables, the delta fetch), so they are charged alike."""
    n = len(node)
    reader, source, read_bytes = reads
    sender, peer, push_bytes, stage1 = pushes
    cross = node[sender] != node[peer]
    if (cross & ~stage1).any():
        raise ValueError("stage-2 pushes must stay inside a node")
    reads_per_gpu = _bincount(reader, read_bytes, n)
    local1, local2 = ~cross & stage1, ~stage1
    return Traffic(
        store_read_bytes=round(float(read_bytes.sum())),
        pushed_bytes=round(float(push_bytes.sum())),
        cross_node_pushed_bytes=round(float(push_bytes[cross].sum())),
        delivered_bytes=delivered_bytes,
        trainer_node_out=_bincount(source, read_bytes, trainer_nodes),
        trainer_gpu_out=0,
        gpu_nic_in=reads_per_gpu + _bincount(peer[cross], push_bytes[cross], n),
        gpu_nic_out=_bincount(sender[cross], push_bytes[cross], n),
        nvlink_in=_bincount(peer[local1], push_bytes[local1], n),
        nvlink_out=_bincount(sender[local1], push_bytes[local1], n),
        stage2_nvlink_in=_bincount(peer[local2], push_bytes[local2], n),
        stage2_nvlink_out=_bincount(sender[local2], push_bytes[local2], n),
        gpu_node=node,
        hops=2,  # a batch is read, then pushed
        batch_bytes=int(min(batch_bytes, reads_per_gpu.max())),
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


GAPS16_LIMIT = 1 << 16
"""A gaps16 position holds a distance below this."""


def gaps16_fits(numel: int, rate: float) -> bool:
    """Whether every gap between the changed elements of a block of ``numel`` fits 16 bits
    when each element changes with probability ``rate`` (independent, uniformly placed).

    Exact where no gap can reach 2**16 (a block of at most 2**16 elements, or no change).
    Else an approximation: a gap reaches 2**16 where 2**16 - 1 unchanged elements follow a
    change (or start the block), each of the about 1 + rate x numel starts with probability
    (1 - rate)**(2**16 - 1); with that expected count of long gaps L, no gap is long with
    probability about exp(-L) (Poisson), and gaps16 is taken when that is at least 1/2.
    Either side of the line, gaps16 and gaps32 differ by 2 bytes a change at about 1 change
    in 65,536 elements: under 0.01 % of the block.
    """
    if numel <= GAPS16_LIMIT or rate == 0:
        return True
    long_gaps = (1 + rate * numel) * (1 - rate) ** (GAPS16_LIMIT - 1)
    return math.exp(-long_gaps) >= 0.5


def expected_entry(numel: int, itemsize: int, rate: float) -> tuple[delta.Encoding, float]:
    """The encoding ``delta.diff`` picks for a block of ``numel`` elements of ``itemsize``
    bytes with ``rate`` x ``numel`` changed (expected, not drawn), and the entry's bytes,
    header included: the same sizes (``delta.positions_bytes``) and tie rule (the smallest;
    ``whole`` only when strictly smaller), gaps16 where :func:`gaps16_fits`."""
    changed = rate * numel
    sizes = {
        e: delta.positions_bytes(e, numel, changed)
        + (numel if e == "whole" else changed) * itemsize
        for e in delta.ENCODINGS
        if e != "gaps16" or gaps16_fits(numel, rate)
    }
    encoding = min(sizes, key=lambda e: (sizes[e], e == "whole"))
    return encoding, delta.HEADER.size + sizes[encoding]


@dataclass(frozen=True, eq=False)
class DeltaBlocks:
    """Every checksum block of a generation's objects (``checksums.block_spans``) and its
    delta entry's expected bytes. Objects lie back to back in one address space (object
    ``o`` from ``base[o]``), so a byte of any object finds its block by one search."""

    base: np.ndarray  # per object: where its bytes start
    start: np.ndarray  # per block, ascending: its first byte
    end: np.ndarray  # per block: past its last byte
    obj: np.ndarray  # per block: its object
    encoding: np.ndarray  # per block: its entry's encoding (index into delta.ENCODINGS)
    entry_bytes: np.ndarray  # per block: its entry's expected bytes (float)


def delta_blocks(
    sizes: np.ndarray, itemsizes: np.ndarray, cuts: Sequence[Sequence[int]], rate: float
) -> DeltaBlocks:
    """The blocks of objects of ``sizes`` bytes, elements of ``itemsizes`` bytes (an object
    holds one dtype) and checksum ``cuts``, at change rate ``rate`` (pure). A block's entry
    depends only on its element count and size, so each distinct pair is priced once."""
    spans = np.array(
        [(o, a, b) for o, n in enumerate(sizes) for a, b in block_spans(int(n), cuts[o])], I64
    ).reshape(-1, 3)
    obj = spans[:, 0]
    base = np.r_[0, np.cumsum(sizes, dtype=I64)[:-1]].astype(I64)
    kinds, which = np.unique(
        np.stack([(spans[:, 2] - spans[:, 1]) // itemsizes[obj], itemsizes[obj]], 1),
        axis=0,
        return_inverse=True,
    )
    priced = [expected_entry(int(numel), int(size), rate) for numel, size in kinds]
    code = np.array([delta.ENCODINGS.index(e) for e, _ in priced], np.int8)
    entry = np.array([nbytes for _, nbytes in priced], np.float64)
    which = which.reshape(-1)
    return DeltaBlocks(
        base, base[obj] + spans[:, 1], base[obj] + spans[:, 2], obj, code[which], entry[which]
    )


def touched_blocks(records: np.ndarray, blocks: DeltaBlocks) -> tuple[np.ndarray, np.ndarray]:
    """(worker, block) of every block some of a worker's records' bytes overlap, each pair
    once, in worker then block order (pure). A strided record counts only the blocks one of
    its rows overlaps: a rank run's cut can make a block shorter than its rows' gaps."""
    obj, worker = records["object"].astype(I64), records["worker"].astype(I64)
    length, count = records["length"].astype(I64), records["count"].astype(I64)
    stride = records["src_stride"].astype(I64)
    first_byte = blocks.base[obj] + records["src_offset"]
    last_byte = first_byte + (count - 1) * stride + length - 1
    first = np.searchsorted(blocks.start, first_byte, "right") - 1
    spanned = np.searchsorted(blocks.start, last_byte, "right") - first
    record = np.repeat(np.arange(len(records)), spanned)
    block = (
        first[record] + np.arange(len(record)) - np.repeat(np.cumsum(spanned) - spanned, spanned)
    )
    # The last row starting before the block's end reaches into the block, or none does.
    row = np.minimum(
        (blocks.end[block] - 1 - first_byte[record]) // stride[record], count[record] - 1
    )
    hit = first_byte[record] + row * stride[record] + length[record] > blocks.start[block]
    pairs = np.unique(worker[record[hit]] * len(blocks.start) + block[hit])
    return pairs // len(blocks.start), pairs % len(blocks.start)


def delta_traffic(
    table: RoutingTable, blocks: DeltaBlocks, trainer_of_object: np.ndarray, trainer_nodes: int
) -> tuple[Traffic, Ops, np.ndarray]:
    """An N-1 -> N delta update in direct mode (pure), fetched as ``plan.delta`` plans it:
    every GPU needs the entries of the blocks its demand records overlap (every byte it
    holds); each distinct entry is read from the Store once, by the GPU the planner's own
    :func:`~mooncake_rl.plan.delta.choose_readers` picks, and pushed to every other GPU
    that needs it (NVLink inside a node, NICs across); a trainer node serves the entries of
    the objects it holds. Returns the traffic, the operations and each GPU's block count.

    The planner orders entries by (object key, block) and breaks ties by worker name: the
    table's objects (``source_layout``) and workers (``Topology``) are sorted so, which
    makes block and GPU indices the planner's. Each GPU's buffer lays its blocks out back
    to back in that order, so operations merge as ``apply.coalesce`` merges them: a reader's
    consecutive blocks of one object are one range, and pushes to one peer of blocks
    adjacent in both buffers one write. Counted as one batch per reader: exact while its
    reads fit ``batch_bytes`` (Kimi-K2 at 1 %: under 250 MB a reader), else each further
    batch's edge may cut a run.
    """
    if list(table.objects) != sorted(table.objects) or list(table.workers) != sorted(table.workers):
        raise ValueError("the delta fetch needs a table's objects and workers sorted by name")
    n, nb = len(table.workers), len(blocks.start)
    node = np.asarray(table.worker_node, I64)
    worker, block = touched_blocks(table.demands, blocks)  # by worker, then block
    pair, first = worker * nb + block, np.searchsorted(worker, np.arange(n))

    def slot(w: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Where block ``b`` lies in worker ``w``'s buffer, in blocks."""
        return np.searchsorted(pair, w * nb + b) - first[w]

    by_block = np.lexsort((worker, block))
    needer, needed = worker[by_block], block[by_block]
    bounds = np.flatnonzero(np.r_[True, needed[1:] != needed[:-1], True])
    read = needed[bounds[:-1]]
    needers, cuts = needer.tolist(), bounds.tolist()
    reader = np.array(
        choose_readers(
            blocks.entry_bytes[read].tolist(),
            [tuple(needers[i:j]) for i, j in itertools.pairwise(cuts)],
            node.tolist(),
            blocks.obj[read].tolist(),
        ),
        I64,
    )
    source = np.repeat(reader, np.diff(bounds))  # the reader of each pair's block
    pushed = needer != source
    sender, peer, sent = source[pushed], needer[pushed], needed[pushed]
    entry, obj = blocks.entry_bytes, blocks.obj
    traffic = _read_push_traffic(
        node,
        trainer_nodes,
        reads=(reader, trainer_of_object[obj[read]], entry[read]),
        pushes=(sender, peer, entry[sent], np.ones(len(sent), bool)),
        delivered_bytes=round(float(entry[block].sum())),
        batch_bytes=table.params.batch_bytes,
        extra=0,
    )
    keys = np.unique(reader * len(blocks.base) + obj[read]) // len(blocks.base)
    ops = Ops(
        np.bincount(keys, minlength=n),
        _block_runs((reader, obj[read]), read, slot(reader, read), n),
        _block_runs((sender, peer), slot(sender, sent), (by_block - first[needer])[pushed], n),
        np.zeros(n, I64),
    )
    return traffic, ops, np.bincount(worker, minlength=n)


def _block_runs(
    calls: Sequence[np.ndarray], src: np.ndarray, dst: np.ndarray, workers: int
) -> np.ndarray:
    """Per worker (``calls[0]``): the native operations its whole-block ranges issue, at
    block ``src`` and ``dst`` of their sides (each side's blocks back to back), merged as
    :func:`_merged` merges ranges."""
    order, starts = _merged(calls, (), src, dst, np.ones(len(src), I64))
    return np.bincount(calls[0][order][starts], minlength=workers)


@dataclass(frozen=True)
class Estimate:
    stage_seconds: Mapping[str, float]  # stage 1 resources' busy seconds, overlapped
    fill_seconds: float
    stage2_seconds: float
    update_seconds: float
    bottleneck: str


def estimate(
    traffic: Traffic, cluster: Cluster, pooling: str | None = None, ops: Ops | None = None
) -> Estimate:
    """Seconds for one update under the pipelining model (pure).

    Stage 1 overlaps every resource batch by batch; each resource finishes after its bytes
    plus the time it must wait for work (``_lags``). Stage 2 (relays copying to their node's
    other consumers) starts after the barrier, as implemented. ``ops``: each GPU's native
    operations, charged at the cluster's per-operation costs on the resource its calls
    feed, serially with its bytes (a call's time is ops x cost + bytes / bandwidth): reads
    on the NIC-in of the GPU's group, stage-1 pushes on its NIC-out and its NVLink, stage-2
    pushes on stage 2. A group (a node's pooled NICs) waits for its slowest GPU's calls.
    """
    pooling = pooling or cluster.nic_pooling
    gpu_bw, nvlink = cluster.gpu_nic_bytes_per_s, cluster.nvlink_bytes_per_s
    trainer_node_bw = cluster.trainer_gpus_per_node * cluster.nic_bytes_per_s
    if pooling == "per_gpu":
        nic_bw, group = gpu_bw, np.arange(len(traffic.gpu_node))
    else:
        nic_bw, group = cluster.rollout_gpus_per_node * gpu_bw, traffic.gpu_node
    gpus = len(traffic.gpu_node)
    zeros = np.zeros(gpus)
    read_s, push_s, stage2_s = (
        (ops.read_seconds(cluster), ops.push_seconds(cluster), ops.stage2_seconds(cluster))
        if ops is not None
        else (zeros, zeros, zeros)
    )
    slowest = np.zeros((2, int(group.max()) + 1))  # per group: its slowest reader, pusher
    np.maximum.at(slowest[0], group, read_s)
    np.maximum.at(slowest[1], group, push_s)
    nic_in = np.bincount(group, traffic.gpu_nic_in) / nic_bw + slowest[0]
    reads = np.bincount(group, traffic.reads_per_gpu) / nic_bw
    fill = (traffic.hops - 1) * traffic.batch_bytes / gpu_bw
    nic_out = np.bincount(group, traffic.gpu_nic_out) / nic_bw + slowest[1]
    nvlink_gpu = np.maximum(traffic.nvlink_in / nvlink, traffic.nvlink_out / nvlink + push_s)
    busy = {
        "trainer_node_nic_out": float(traffic.trainer_node_out.max() / trainer_node_bw),
        "trainer_gpu_nic_out": traffic.trainer_gpu_out / gpu_bw,
        "rollout_nic_in": nic_in,
        "rollout_nic_out": float(nic_out.max()),
        "nvlink": float(nvlink_gpu.max()),
    }
    lag = _lags(traffic.hops, fill, reads)
    finish = {k: float(np.max(v + lag[k] * (np.asarray(v) > 0))) for k, v in busy.items()}
    stage2 = float(
        np.maximum(
            traffic.stage2_nvlink_in / nvlink, traffic.stage2_nvlink_out / nvlink + stage2_s
        ).max()
    )
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
    ops: Ops | None = None,
) -> dict[str, Any]:
    """One approach's figures: bytes per endpoint, native operations, the estimate with and
    without per-operation costs (and with each preset's), memory feasibility."""
    chosen = estimate(traffic, cluster, ops=ops)
    bytes_only = estimate(traffic, cluster).update_seconds
    pooled = {p: estimate(traffic, cluster, p, ops).update_seconds for p in POOLING}
    presets = {
        preset: estimate(traffic, cluster.with_op_costs(preset), ops=ops).update_seconds
        for preset in OP_COSTS
    }
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
        "op_seconds_added": round(chosen.update_seconds - bytes_only, 4),
        "ops": ops.to_json(cluster) if ops is not None else None,
        "update_seconds_by_op_costs": {
            preset: {
                "update_seconds": round(seconds, 3),
                "bound_ratio": round(seconds / bound.seconds, 3),
            }
            for preset, seconds in presets.items()
        },
        **{f"update_seconds_{p}_nics": round(s, 3) for p, s in pooled.items()},
        "publish_seconds": round(publish, 3),
        "end_to_end_seconds": round(publish + chosen.update_seconds, 3),
        "gpu_memory_bytes_needed": memory,
        "fits_gpu_memory": memory <= cluster.gpu_memory_gb * 1e9,
    }


def _spread(values: np.ndarray, digits: int | None = None) -> dict[str, float]:
    """Least, median and most over the rollout GPUs (``digits`` None: whole numbers)."""
    return {
        name: round(float(f(values)), digits)
        for name, f in (("min", np.min), ("median", np.median), ("max", np.max))
    }


def delta_section(
    table: RoutingTable,
    layout: Published,
    trainer_of_object: np.ndarray,
    c: Cluster,
    rate: float,
    full: tuple[Traffic, Ops],
) -> dict[str, Any]:
    """The delta update of the direct ``table`` at change ``rate`` against the full update
    of the same table (``full``: its traffic and operations): entry bytes per block, the
    planned fetch's Store reads and pushes, bytes each GPU receives (read or pushed) and its
    operations, seconds with per-operation costs charged. Full bytes per GPU: the bytes it
    holds, which a full update lands."""
    dtypes = [layout.dtype_of_object[name] for name in table.objects]
    blocks = delta_blocks(
        np.asarray(table.object_sizes, I64),
        np.array([ITEMSIZE[d] for d in dtypes], I64),
        [layout.cuts_of_object.get(name, ()) for name in table.objects],
        rate,
    )
    traffic, ops, gpu_blocks = delta_traffic(table, blocks, trainer_of_object, c.trainer_nodes)
    full_bytes = np.asarray(table.totals.demanded_bytes, I64)
    received = traffic.received_per_gpu()

    def seconds(cluster: Cluster) -> dict[str, float]:
        charged = estimate(traffic, cluster, ops=ops).update_seconds
        whole = estimate(full[0], cluster, ops=full[1]).update_seconds
        return {
            "update_seconds": round(charged, 4),
            "full_update_seconds": round(whole, 4),
            "seconds_ratio": round(charged / whole, 4),
        }

    chosen = estimate(traffic, c, ops=ops)
    full_blocks = {}
    for dtype in sorted(set(dtypes)):
        encoding, nbytes = expected_entry(BLOCK_BYTES // ITEMSIZE[dtype], ITEMSIZE[dtype], rate)
        full_blocks[dtype] = {"encoding": encoding, "entry_bytes": round(nbytes, 1)}
    return {
        "change_rate": rate,
        "full_block_entries": full_blocks,
        "blocks": len(blocks.start),
        "blocks_by_encoding": {
            e: int((blocks.encoding == i).sum()) for i, e in enumerate(delta.ENCODINGS)
        },
        "stored_bytes": round(float(blocks.entry_bytes.sum())),
        "stored_vs_model": round(float(blocks.entry_bytes.sum() / blocks.end[-1]), 4),
        "store_read_bytes": traffic.store_read_bytes,
        "pushed_bytes": traffic.pushed_bytes,
        "cross_node_pushed_bytes": traffic.cross_node_pushed_bytes,
        "delivered_bytes": traffic.delivered_bytes,
        "blocks_per_gpu": _spread(gpu_blocks),
        "delta_bytes_per_gpu": _spread(received),
        "store_reads_per_gpu": _spread(traffic.reads_per_gpu),
        "full_bytes_per_gpu": _spread(full_bytes),
        "bytes_ratio_per_gpu": _spread(received / full_bytes, 4),
        "read_keys_per_gpu": _spread(ops.read_keys),
        "read_ranges_per_gpu": _spread(ops.read_ranges),
        "read_op_seconds_per_gpu": _spread(ops.read_seconds(c), 4),
        "pushes_per_gpu": _spread(ops.pushes),
        "push_op_seconds_per_gpu": _spread(ops.push_seconds(c), 4),
        "max_trainer_node_nic_out_bytes": int(traffic.trainer_node_out.max()),
        "full_max_trainer_node_nic_out_bytes": int(full[0].trainer_node_out.max()),
        "bottleneck": chosen.bottleneck,
        **seconds(c),
        "op_seconds_added": round(chosen.update_seconds - estimate(traffic, c).update_seconds, 4),
        "update_seconds_by_op_costs": {
            preset: seconds(c.with_op_costs(preset)) for preset in OP_COSTS
        },
    }


GOAL_SECONDS = 1.3  # Perplexity's published Kimi-K2 update (docs/performance.md)
GOAL_BOUND_RATIO = 1.10


def goal_check(direct: Mapping[str, Any], bound: Bound) -> dict[str, Any]:
    """Issue 48's goal for ``direct`` with per-operation costs charged, under the TCP and
    the RDMA presets: at most 1.3 s and within 1.10x of the physical bound."""
    by_costs = direct["update_seconds_by_op_costs"]
    return {
        "goal": f"direct update_seconds <= {GOAL_SECONDS} and <= {GOAL_BOUND_RATIO} x the "
        "physical bound with per-operation costs charged (issue 48, for Kimi-K2 fp8 on "
        "4 x EP32)",
        "bound_seconds": round(bound.seconds, 4),
        **{
            preset: {
                **by_costs[preset],
                "holds": by_costs[preset]["update_seconds"] <= GOAL_SECONDS
                and by_costs[preset]["bound_ratio"] <= GOAL_BOUND_RATIO,
            }
            for preset in ("tcp", "rdma")
        },
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
        "packing": f"pack_bytes {scenario.pack_bytes}: the publishers' layout "
        "(generations.packing.pack_layout over the publisher ranks of "
        "generations.assignment on every trainer GPU, a source tensor with its fp8 scales to "
        "one rank): stored tensors of at most pack_bytes / 4 share per-rank, per-dtype pack "
        "objects in publish order; larger ones, and every tensor with pack_bytes 0, are one "
        "object each"
        + (
            "; each pack laid out rank by rank by one instance's cut (generations.pack_order)"
            if scenario.pack_order
            else "; packs tensor after tensor (--no-pack-order)"
        ),
        "per_operation": {
            "costs_us": {name: getattr(c, name) for name in OP_COST_FIELDS},
            "presets_us": {
                p: dict(zip(OP_COST_FIELDS, v, strict=True)) for p, v in OP_COSTS.items()
            },
            "sources": OP_COST_SOURCES,
            "counting": "operations per rollout GPU from the routing table, as the executor "
            "issues them (apply.executor, apply.coalesce): per batch one read call; its "
            "distinct objects each cost store_read_key_us (with their first range) and every "
            "further range store_read_range_us, after merging ranges adjacent in the object "
            "and in the destination; per batch and peer, pushes merged the same way, each "
            "push_us (calls of at most 512 writes; the 4 calls the executor keeps in flight "
            "are not credited). The simulator knows no registered spans: each destination "
            "region (one per placement fragment) is its own address space, so ranges merge "
            "only within one region, and one read call names each object once. naive_store: "
            "one call per GPU over its merged demand records (kind to the baseline); "
            "naive_store_full: one range per object; nccl_broadcast: none",
            "overlap": "a native call costs ops x cost + bytes / bandwidth, serially on its "
            "thread: a GPU's read-op seconds add to its group's NIC-in (a node's pooled NICs "
            "wait for the node's slowest reader), its stage-1 push-op seconds to its group's "
            "NIC-out and to its own NVLink, its stage-2 push-op seconds to stage 2. Reads and "
            "pushes still overlap each other (the pipeline); op_seconds_added = update_seconds "
            "minus the same estimate without per-operation costs",
        },
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
        "trips); congestion and switch oversubscription",
        **(
            {
                "delta": f"generation N-1 -> N with {scenario.delta_change_rate} of the "
                "elements changed, at uniformly random positions: one delta object per "
                "payload object, one entry per checksum block (4 MiB, cut at rank runs) of "
                "its expected size (delta.diff's encoding by expected sizes; gaps16 when "
                "bench.simulate.gaps16_fits); each GPU needs the entries of every block its "
                "demand records overlap (all it holds), fetched as plan.delta plans it: each "
                "distinct entry read from the Store once (from the trainer node holding its "
                "object) by the needing GPU plan.delta.choose_readers picks for its run "
                "(consecutive entries of one object the same GPUs need, up to "
                "plan.delta.RUN_BYTES; the node that has moved the fewest bytes), and pushed "
                "to every other GPU needing it (NVLink in "
                "a node, NICs across); a reader's consecutive blocks of an object are one "
                "range, its pushes to a peer of blocks adjacent in both buffers one write; "
                "decoding and applying excluded"
            }
            if scenario.delta_change_rate is not None
            else {}
        ),
    }


def simulate(scenario: Scenario, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Plan the scenario with the real planner and estimate every approach."""
    say = progress or (lambda _: None)
    c = scenario.cluster
    say(f"build {scenario.model} {scenario.dtype} shape and manifest")
    started = time.perf_counter()
    model = model_shape(scenario.model, scenario.dtype)
    topology, direct_demand = cluster(
        model, c.rollout_instances, c.rollout_tp, c.rollout_gpus_per_node, c.rollout_layout
    )
    say("assign published tensors to trainer ranks and packs")
    order = None
    if scenario.pack_order:  # the cut one instance's GPUs report, as the coordinator learns it
        parts = instance_parts(model, c.rollout_tp, c.rollout_layout)
        shapes = {t.name: t.shape for t in model.tensors}
        order = PackOrder.of_boxes(
            (r, f.tensor_id, shapes[f.tensor_id], f.global_offset, f.local_shape)
            for r, part in enumerate(parts)
            for f in part.fragments
        )
    layout = publish_layout(model, c, scenario.pack_bytes, order)
    manifest, by_name, published = layout.manifest, layout.node_of_object, layout.node_bytes
    say("distinct bytes per rollout node (the physical bound)")
    bound = physical_bound(node_demand_bytes(manifest, topology, direct_demand), published, c)
    setup_seconds = time.perf_counter() - started
    params = PlanParams(batch_bytes=scenario.batch_bytes, balance_slack=scenario.balance_slack)
    approaches: dict[str, dict[str, Any]] = {}
    delta_figures: dict[str, Any] = {}
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
        say(f"count {mode} native operations")
        ops = table_ops(table)
        if mode == "direct":
            weights_per_gpu = int(table.totals.demanded_bytes.max())
            full = ours_traffic(table, trainer_of_object, c.trainer_nodes)
            approaches["direct"] = summarize(
                full,
                c,
                weights_per_gpu,
                published,
                planned,
                bound,
                ops,
            )
            approaches["naive_store"] = summarize(
                naive_traffic(table, trainer_of_object, c.trainer_nodes),
                c,
                weights_per_gpu,
                published,
                {"planned_by": "the direct table's demand records (no routing)"},
                bound,
                naive_ops(table),
            )
            approaches["naive_store_full"] = summarize(
                naive_full_traffic(table, trainer_of_object, c.trainer_nodes),
                c,
                weights_per_gpu,
                published,
                {"planned_by": "every GPU reads every object"},
                bound,
                naive_full_ops(table),
            )
            gpu_node = np.asarray(table.worker_node, I64)
            if scenario.delta_change_rate is not None:
                say("price delta entries per checksum block, plan their fetch")
                delta_figures = delta_section(
                    table,
                    layout,
                    trainer_of_object,
                    c,
                    scenario.delta_change_rate,
                    (full, ops),
                )
        else:
            approaches[mode] = summarize(
                ours_traffic(table, trainer_of_object, c.trainer_nodes),
                c,
                weights_per_gpu,
                published,
                planned,
                bound,
                ops,
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
            "objects": layout.objects,
            "objects_per_tensor": round(layout.objects / layout.tensors, 4),
            "packed_tensors": layout.packed_tensors,
            "pack_bytes": scenario.pack_bytes,
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
        "goal": goal_check(approaches["direct"], bound),
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
        **({"delta": delta_figures} if delta_figures else {}),
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
    p.add_argument(
        "--pack-bytes",
        type=int,
        default=Scenario().pack_bytes,
        help="the publisher's pack size (small tensors share objects); 0: one object per tensor",
    )
    p.add_argument(
        "--no-pack-order",
        action="store_true",
        help="packs tensor after tensor, as the first publish before any update (the baseline)",
    )
    p.add_argument(
        "--op-costs",
        choices=sorted(OP_COSTS),
        default="tcp",
        help="per-operation costs: tcp (measured here by bench.ops), rdma (cited/estimated), none",
    )
    for name in OP_COST_FIELDS:
        p.add_argument(
            "--" + name.replace("_", "-"), type=float, help="overrides the --op-costs preset"
        )
    p.add_argument(
        "--delta-change-rate",
        type=float,
        help="also estimate a delta update (direct mode) at this fraction of elements changed "
        "per step, e.g. 0.01 (the JSON's delta section)",
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
            **{
                name: preset if getattr(args, name) is None else getattr(args, name)
                for name, preset in zip(OP_COST_FIELDS, OP_COSTS[args.op_costs], strict=True)
            },
        ),
        dtype=args.dtype,
        modes=tuple(m for m in args.modes.split(",") if m),
        batch_bytes=args.batch_bytes,
        balance_slack=args.balance_slack,
        pack_bytes=args.pack_bytes,
        pack_order=not args.no_pack_order,
        delta_change_rate=args.delta_change_rate,
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
