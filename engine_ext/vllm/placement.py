"""vLLM's parameters and ranks for the shared shard describer (:mod:`engine_ext.placement`).

Parameters are described in vLLM's model (checkpoint-layout) format, which on CPU lives only
in the layerwise-reload metadata because the live linear weights were repacked. vLLM layers
carry ``tp_rank``; key/value heads may be replicated (``num_kv_head_replicas``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine_ext.placement import ParamRow, RegionSpec, describe_shards
from engine_ext.shards import ShardSpec


def model_format_params(model: torch.nn.Module) -> Iterator[ParamRow]:
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


def _rank_of(layer: torch.nn.Module, sub: int) -> int:
    rank = int(layer.tp_rank)
    replicas = int(getattr(layer, "num_kv_head_replicas", 1) or 1)
    return rank if sub == 0 else rank // replicas  # QKV: key/value heads may be replicated


def describe_vllm_shards(model: torch.nn.Module) -> tuple[list[RegionSpec], list[ShardSpec]]:
    packed = dict(getattr(model, "packed_modules_mapping", {}))
    return describe_shards(model_format_params(model), packed, _rank_of)
