"""Engine placements for simulated clusters (tests, benchmarks): TP shards without an engine.

Each engine is (node label, TP size). In direct mode every tensor is split along its first
dimension divisible by the TP size (replicated when none is), one region per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mooncake_rl.generations.catalog import TensorSpec

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tp_box(spec: TensorSpec, tp: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    for dim, extent in enumerate(spec.shape):
        if tp > 1 and extent % tp == 0:
            local = list(spec.shape)
            local[dim] = extent // tp
            offset = [0] * len(spec.shape)
            offset[dim] = rank * local[dim]
            return tuple(offset), tuple(local)
    return (0,) * len(spec.shape), spec.shape


def simulated_engines(
    specs: Sequence[TensorSpec], cluster: Sequence[tuple[str, int]], mode: str
) -> dict[str, list[dict[str, Any]]]:
    """Engine URL -> worker descriptions, shaped like ``GET /mooncake/placement`` replies."""
    engines = {}
    for index, (node, tp) in enumerate(cluster):
        workers = []
        for rank in range(tp):
            shards = []
            if mode == "direct":
                for spec in specs:
                    offset, local = tp_box(spec, tp, rank)
                    shards.append(
                        {
                            "tensor": spec.name,
                            "global_shape": list(spec.shape),
                            "global_offset": list(offset),
                            "local_shape": list(local),
                            "region": spec.name,
                            "region_offset": 0,
                            "bytes": math.prod(local) * spec.itemsize,
                        }
                    )
            workers.append(
                {
                    "worker_id": f"e{index}/tp{rank}",
                    "node": node,
                    "tp_rank": rank,
                    "tp_size": tp,
                    "regions": {s["region"]: {"bytes": s.pop("bytes")} for s in shards},
                    "shards": shards,
                }
            )
        engines[f"http://engine{index}"] = workers
    return engines


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
