"""Describe a vLLM worker's tensor-parallel shards from vLLM's own layer attributes.

No per-model table: fused parameters come from the model's ``packed_modules_mapping`` and
the layer's ``output_sizes``/``output_partition_sizes``; split dimensions from
``input_size`` vs ``input_size_per_partition`` (row-parallel) and ``output_size`` vs
``output_size_per_partition`` (column-parallel); vocabulary shards from ``shard_indices``;
key/value head replication from ``num_kv_head_replicas``. Parameters are described in
vLLM's model (checkpoint-layout) format, which on CPU lives only in the layerwise-reload
metadata because the live linear weights were repacked.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine_ext.shards import ShardSpec


@dataclass(frozen=True)
class RegionSpec:
    """A model-format parameter this worker stages: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def model_format_params(
    model: torch.nn.Module,
) -> Iterator[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    """(full name, layer, param name, model-format tensor or meta tensor) per parameter."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for module_name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        if info is not None:
            params = info.restore_metadata[0]
        else:
            params = {n: p for n, p in module.named_parameters(recurse=False)}
        for param_name, meta in params.items():
            full = f"{module_name}.{param_name}" if module_name else param_name
            yield full, module, param_name, meta


def _shard_index(layer: torch.nn.Module, sub: int) -> int:
    rank = int(layer.tp_rank)
    replicas = int(getattr(layer, "num_kv_head_replicas", 1) or 1)
    return rank if sub == 0 else rank // replicas  # QKV: key/value heads may be replicated


def describe_shards(
    model: torch.nn.Module, packed_modules_mapping: dict[str, list[str]]
) -> tuple[list[RegionSpec], list[ShardSpec]]:
    regions: list[RegionSpec] = []
    shards: list[ShardSpec] = []
    for full, layer, param_name, meta in model_format_params(model):
        shape = tuple(int(d) for d in meta.shape)
        regions.append(RegionSpec(full, shape, meta.dtype))
        prefix = full.rpartition(".")[0]  # e.g. model.layers.0.self_attn.qkv_proj
        module_prefix, _, module_leaf = prefix.rpartition(".")
        row_bytes = math.prod(shape[1:]) * meta.dtype.itemsize if shape else 0
        subs = packed_modules_mapping.get(module_leaf)
        if subs and hasattr(layer, "output_partition_sizes") and len(shape) >= 1:
            # Fused along dim 0: one box per checkpoint tensor, stacked in the region.
            row = 0
            for index, (sub, local_rows) in enumerate(
                zip(subs, layer.output_partition_sizes, strict=True)
            ):
                total_rows = (
                    int(layer.output_sizes[index]) if hasattr(layer, "output_sizes") else local_rows
                )
                start = _shard_index(layer, index) * local_rows
                name = (
                    f"{module_prefix}.{sub}.{param_name}"
                    if module_prefix
                    else f"{sub}.{param_name}"
                )
                shards.append(
                    ShardSpec(
                        name,
                        (total_rows, *shape[1:]),
                        (start,) + (0,) * (len(shape) - 1),
                        (local_rows, *shape[1:]),
                        full,
                        row * row_bytes,
                    )
                )
                row += local_rows
            continue
        shard_indices = getattr(layer, "shard_indices", None)
        if shard_indices is not None and param_name == "weight":
            start, end = (
                int(shard_indices.org_vocab_start_index),
                int(shard_indices.org_vocab_end_index),
            )
            total = int(layer.org_vocab_size)
            if end > start:
                shards.append(
                    ShardSpec(
                        full,
                        (total, *shape[1:]),
                        (start,) + (0,) * (len(shape) - 1),
                        (end - start, *shape[1:]),
                        full,
                        0,
                    )
                )
            continue
        split = _split_dim(layer, meta, shape)
        if split is None:
            shards.append(ShardSpec(full, shape, (0,) * len(shape), shape, full, 0))
            continue
        dim, total = split
        offset = [0] * len(shape)
        offset[dim] = int(layer.tp_rank) * shape[dim]
        global_shape = list(shape)
        global_shape[dim] = total
        shards.append(ShardSpec(full, tuple(global_shape), tuple(offset), shape, full, 0))
    return regions, shards


def _split_dim(
    layer: torch.nn.Module, meta: torch.Tensor, shape: tuple[int, ...]
) -> tuple[int, int] | None:
    """(dim, global extent) if this parameter is split across TP ranks, else None."""
    input_size = getattr(layer, "input_size", None)
    per_input = getattr(layer, "input_size_per_partition", None)
    input_dim = getattr(meta, "input_dim", None)
    if input_dim is not None and input_size and per_input and per_input != input_size:
        return int(input_dim), int(input_size)
    output_size = getattr(layer, "output_size", None)
    per_output = getattr(layer, "output_size_per_partition", None)
    output_dim = getattr(meta, "output_dim", None)
    if output_dim is not None and output_size and per_output and per_output != output_size:
        return int(output_dim), int(output_size)
    return None
