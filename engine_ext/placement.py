"""Describe a worker's tensor-parallel shards from the engine's own layer attributes.

vLLM and SGLang share the parallel-layer vocabulary, so one describer serves both; the
engine supplies its parameters and how a layer names its rank. No per-model table: fused
parameters come from the model's packed-module mapping and the layer's
``output_sizes``/``output_partition_sizes``; split dimensions from ``input_size`` vs
``input_size_per_partition`` (row-parallel) and ``output_size`` vs
``output_size_per_partition`` (column-parallel) with the parameter's ``input_dim`` /
``output_dim``; vocabulary shards from ``shard_indices``. A block-fp8 layer's
``weight_scale_inv`` has one entry per weight block, so its sizes and offsets are the
weight's, in blocks (rounded up, as the engines' scale loaders do).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from engine_ext.shards import ShardSpec

# (full parameter name, owning layer, parameter name in the layer, tensor or meta tensor)
ParamRow = tuple[str, torch.nn.Module, str, torch.Tensor]
# (layer, index of the packed sub-tensor, 0 if unpacked) -> this rank's box index
RankOf = Callable[[torch.nn.Module, int], int]


@dataclass(frozen=True)
class RegionSpec:
    """A model-format parameter this worker stages: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def describe_shards(
    params: Iterable[ParamRow],
    packed_modules_mapping: Mapping[str, Sequence[str]],
    rank_of: RankOf,
) -> tuple[list[RegionSpec], list[ShardSpec]]:
    regions: list[RegionSpec] = []
    shards: list[ShardSpec] = []
    for full, layer, param_name, meta in params:
        shape = tuple(int(d) for d in meta.shape)
        regions.append(RegionSpec(full, shape, meta.dtype))
        block = _scale_block(layer, param_name)
        prefix = full.rpartition(".")[0]  # e.g. model.layers.0.self_attn.qkv_proj
        module_prefix, _, module_leaf = prefix.rpartition(".")
        row_bytes = math.prod(shape[1:]) * meta.dtype.itemsize if shape else 0
        subs = packed_modules_mapping.get(module_leaf)
        if subs and hasattr(layer, "output_partition_sizes") and len(shape) >= 1:
            parts = [int(rows) for rows in layer.output_partition_sizes]
            totals = [int(n) for n in getattr(layer, "output_sizes", parts)]
            # QKV with fewer key/value heads than ranks: output_sizes count each replica.
            replicas = int(getattr(layer, "num_kv_head_replicas", 1) or 1)
            totals = [n if index == 0 else n // replicas for index, n in enumerate(totals)]
            if block is not None and any(n % block[0] for n in parts[:-1]):
                # A part starts inside a block: the engines' scale loaders round its offset
                # up, onto the previous part's last block row (vLLM's
                # adjust_block_scale_shard), which no box can say. Left undescribed, so
                # direct mode lands it through the fallback, as the engine's loader would.
                continue
            parts, totals = (
                [_blocks(n, block, 0) for n in parts],
                [_blocks(n, block, 0) for n in totals],
            )
            if len(subs) not in (1, len(parts)) or len(totals) != len(parts):
                continue  # undescribed: direct mode lands it through the fallback
            # One checkpoint tensor per part, or (Phi-3) one tensor holding every part.
            stacked = len(subs) < len(parts)
            row = 0
            for index, local_rows in enumerate(parts):
                sub = subs[0] if stacked else subs[index]
                base = sum(totals[:index]) if stacked else 0
                global_rows = sum(totals) if stacked else totals[index]
                name = (
                    f"{module_prefix}.{sub}.{param_name}"
                    if module_prefix
                    else f"{sub}.{param_name}"
                )
                shards.append(
                    ShardSpec(
                        name,
                        (global_rows, *shape[1:]),
                        (base + rank_of(layer, index) * local_rows,) + (0,) * (len(shape) - 1),
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
        split = _split_dim(layer, meta)
        if split is None:
            shards.append(ShardSpec(full, shape, (0,) * len(shape), shape, full, 0))
            continue
        dim, total = split[0], _blocks(split[1], block, split[0])
        offset = [0] * len(shape)
        offset[dim] = rank_of(layer, 0) * shape[dim]
        global_shape = list(shape)
        global_shape[dim] = total
        shards.append(ShardSpec(full, tuple(global_shape), tuple(offset), shape, full, 0))
    return regions, shards


def _scale_block(layer: torch.nn.Module, param_name: str) -> tuple[int, int] | None:
    """The (rows, columns) of a weight block if ``param_name`` is a block-fp8 scale."""
    if param_name != "weight_scale_inv":
        return None
    config = getattr(getattr(layer, "quant_method", None), "quant_config", None)
    block = getattr(layer, "weight_block_size", None) or getattr(config, "weight_block_size", None)
    return (int(block[0]), int(block[1])) if block else None


def _blocks(extent: int, block: tuple[int, int] | None, dim: int) -> int:
    """``extent`` weight rows (dim 0) or columns (dim 1) in scale entries."""
    return extent if block is None else -(-extent // block[dim])


def _split_dim(layer: torch.nn.Module, meta: torch.Tensor) -> tuple[int, int] | None:
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


def assemble_regions(
    regions: Sequence[RegionSpec],
    shards: Sequence[ShardSpec],
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Each region as the generation's full ``tensors`` fill it, and the regions they cannot.

    The inverse of the placement: a region is the concatenation of its boxes at their
    offsets, each cast to the region's dtype the way a loader's ``copy_`` casts. Regions
    whose boxes name absent tensors or leave bytes uncovered are returned by name.
    """
    boxes: dict[str, list[ShardSpec]] = {}
    for shard in shards:
        boxes.setdefault(shard.region, []).append(shard)
    filled: dict[str, torch.Tensor] = {}
    uncovered: list[str] = []
    for region in regions:
        own = boxes.get(region.name, [])
        covered = sum(math.prod(s.local_shape) for s in own) * region.dtype.itemsize
        if covered != region.nbytes or any(s.tensor not in tensors for s in own):
            uncovered.append(region.name)
            continue
        flat = torch.empty(region.nbytes, dtype=torch.uint8)
        for shard in own:
            index = tuple(
                slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape, strict=True)
            )
            box = tensors[shard.tensor][index].to(region.dtype).contiguous().view(-1)
            flat[shard.region_offset : shard.region_offset + box.nbytes] = box.view(torch.uint8)
        filled[region.name] = flat.view(region.dtype).view(region.shape)
    return filled, uncovered
