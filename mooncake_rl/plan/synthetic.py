"""Engine placements for simulated clusters (tests, benchmarks): TP shards without an engine.

Each engine is (node label, TP size). In direct mode every tensor is split along its first
dimension divisible by the TP size (replicated when none is), one region per tensor; the
tensors named in ``by_columns`` along their last (a row-parallel layer: ``o_proj``,
``down_proj``), where it divides.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from mooncake.reshard.weight import WeightPlacementPart

from mooncake_rl.generations.catalog import TensorSpec

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tp_box(
    spec: TensorSpec, tp: int, rank: int, by_columns: bool = False
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    dims = list(enumerate(spec.shape))
    for dim, extent in dims[-1:] if by_columns else dims:
        if tp > 1 and extent % tp == 0:
            local = list(spec.shape)
            local[dim] = extent // tp
            offset = [0] * len(spec.shape)
            offset[dim] = rank * local[dim]
            return tuple(offset), tuple(local)
    return (0,) * len(spec.shape), spec.shape


def simulated_engines(
    specs: Sequence[TensorSpec],
    cluster: Sequence[tuple[str, int]],
    mode: str,
    by_columns: Collection[str] = (),
) -> dict[str, list[dict[str, Any]]]:
    """Engine URL -> worker descriptions, shaped like ``GET /mooncake/placement`` replies."""
    engines = {}
    for index, (node, tp) in enumerate(cluster):
        ranks = [
            [(spec, *tp_box(spec, tp, rank, spec.name in by_columns)) for spec in specs]
            if mode == "direct"
            else []
            for rank in range(tp)
        ]
        engines[f"http://engine{index}"] = _described(index, [node] * tp, ranks)
    return engines


def described_engines(
    specs: Sequence[TensorSpec],
    parts: Sequence[WeightPlacementPart],
    nodes: Sequence[str],
    nodes_per_engine: int = 1,
) -> dict[str, list[dict[str, Any]]]:
    """Engines over ``nodes``, each rank placing what ``parts[rank]`` places (e.g.
    ``plan.shapes.instance_parts``: experts owned whole under EP), as direct-mode replies.
    Each engine spans ``nodes_per_engine`` consecutive nodes, its ranks filling them in
    order (an instance of 32 GPUs on four 8-GPU nodes); leftover nodes hold no engine."""
    by_name = {spec.name: spec for spec in specs}
    ranks = [
        [(by_name[f.tensor_id], f.global_offset, f.local_shape) for f in part.fragments]
        for part in parts
    ]
    per_node = -(-len(parts) // nodes_per_engine)
    spans = range(len(nodes) // nodes_per_engine)
    return {
        f"http://engine{i}": _described(
            i, [nodes[i * nodes_per_engine + r // per_node] for r in range(len(parts))], ranks
        )
        for i in spans
    }


def _described(
    index: int, nodes: Sequence[str], ranks: Sequence[Sequence[tuple[TensorSpec, tuple, tuple]]]
) -> list[dict[str, Any]]:
    """Engine ``index``'s workers: rank r sits on ``nodes[r]`` and holds the (tensor, global
    offset, local shape) boxes of ``ranks[r]``, one region per tensor."""
    workers = []
    for rank, boxes in enumerate(ranks):
        shards = [
            {
                "tensor": spec.name,
                "global_shape": list(spec.shape),
                "global_offset": list(offset),
                "local_shape": list(local),
                "region": spec.name,
                "region_offset": 0,
            }
            for spec, offset, local in boxes
        ]
        workers.append(
            {
                "worker_id": f"e{index}/tp{rank}",
                "node": nodes[rank],
                "tp_rank": rank,
                "tp_size": len(ranks),
                "regions": {
                    spec.name: {"bytes": math.prod(local) * spec.itemsize}
                    for spec, _, local in boxes
                },
                "shards": shards,
            }
        )
    return workers


def shard_bytes(
    engines: Mapping[str, Sequence[Mapping[str, Any]]], tensors: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, bytes]]:
    """Direct mode: the bytes each worker's shard regions must hold, cut from the full
    tensors (the reference a landed update is compared with)."""
    expected: dict[str, dict[str, bytes]] = {}
    for workers in engines.values():
        for worker in workers:
            for shard in worker["shards"]:
                full = tensors[shard["tensor"]]
                raw = full.view(_SAME_SIZE_INT[full.element_size()])  # any dtype, as bytes
                box = tuple(
                    slice(o, o + n)
                    for o, n in zip(shard["global_offset"], shard["local_shape"], strict=True)
                )
                data = raw[box].contiguous().numpy().tobytes()
                expected.setdefault(worker["worker_id"], {})[shard["region"]] = data
    return expected
