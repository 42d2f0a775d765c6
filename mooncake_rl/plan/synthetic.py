"""Engine placements for simulated clusters (tests, benchmarks): TP shards without an engine.

Each engine is (node label, TP size). In direct mode every tensor is split along its first
dimension divisible by the TP size (replicated when none is), one region per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mooncake_rl.generations.catalog import TensorSpec


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
