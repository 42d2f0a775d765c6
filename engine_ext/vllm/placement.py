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
    """(full name, layer, param name, model-format tensor or meta tensor) per parameter.

    A parameter shared by several layers (a tied ``lm_head``) is described once, under the
    first layer that holds it; landing re-derives the others (``rederive_tied_layers``).
    Parameters vLLM never moves to meta for reloading (a linear ``bias``, DeepSeek's
    ``e_score_correction_bias``) are described from the live tensor, in the layer's
    parameter dtype. KV-cache scales are not described (:func:`holds_kv_cache_scales`).
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS as live_only

    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if holds_kv_cache_scales(module):
            continue
        info = LAYERWISE_INFO.get(module)
        restored = info.restore_metadata[0] if info is not None else {}
        live = {n: p for n, p in module._parameters.items() if p is not None}
        for param_name in dict.fromkeys([*restored, *live]):
            param = live.get(param_name)
            if param is not None and id(param) in seen:
                continue
            if param is not None:
                seen.add(id(param))
            meta = restored.get(param_name)
            if meta is None and (info is None or param_name in live_only):
                meta = _as_model_format(module, param)
            if meta is not None:
                full = f"{module_name}.{param_name}" if module_name else param_name
                yield full, module, param_name, meta


def holds_kv_cache_scales(module: torch.nn.Module) -> bool:
    """A quantized attention layer, whose parameters are its KV-cache scales (``k_scale``,
    ``v_scale``...): vLLM's loader lets a checkpoint omit them, as trainers' checkpoints do,
    and they keep their defaults. So no generation is expected to fill them."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    return isinstance(getattr(module, "quant_method", None), BaseKVCacheMethod)


def _as_model_format(layer: torch.nn.Module, param: torch.Tensor) -> torch.Tensor:
    """A meta tensor with the parameter's attributes, in the dtype the layer was built with."""
    dtype = getattr(layer, "params_dtype", None) or param.dtype
    meta = param.data.to("meta", dtype=dtype)
    meta.__dict__.update(param.__dict__)
    return meta


def _rank_of(layer: torch.nn.Module, sub: int) -> int:
    rank = int(layer.tp_rank)
    replicas = int(getattr(layer, "num_kv_head_replicas", 1) or 1)
    return rank if sub == 0 else rank // replicas  # QKV: key/value heads may be replicated


EXPERT_PARAMS = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")


def expert_shards(
    full: str, layer: torch.nn.Module, param_name: str, meta: torch.Tensor
) -> list[ShardSpec] | None:
    """The checkpoint boxes of a fused-experts parameter, from the layer's expert mapping.

    vLLM's ``RoutedExperts`` stacks local experts on dim 0 of ``w13_weight`` (gate rows,
    then up rows, each this rank's slice of the intermediate dim) and ``w2_weight`` (this
    rank's columns of ``down_proj``); ``get_expert_mapping()`` names the checkpoint tensor
    and shard of every (expert, w1/w2/w3). Block-fp8 experts' ``w13_weight_scale_inv`` and
    ``w2_weight_scale_inv`` stack their blocks the same way (TP slices are whole blocks).
    ``None`` when the layout is not that one.
    """
    mapping = getattr(layer, "get_expert_mapping", None)
    if mapping is None or param_name not in EXPERT_PARAMS or meta.dim() != 3:
        return None
    if getattr(meta, "is_transposed", False) or not layer.moe_config.is_act_and_mul:
        return None
    tp_rank = int(layer.moe_config.tp_rank)
    tp_size = int(layer.moe_config.moe_parallel_config.tp_size)
    local_experts, rows, cols = (int(d) for d in meta.shape)
    expert_bytes = rows * cols * meta.dtype.itemsize
    shards = []
    for param_prefix, weight_prefix, expert_id, shard_id in mapping():
        # ("experts.w13_", "experts.3.gate_proj.", 3, "w1"): both relative to the MoE block
        leaf = param_prefix.rpartition(".")[2]
        if not param_name.startswith(leaf):
            continue
        block = full.rpartition(f".{weight_prefix.partition('.')[0]}.")[0]
        local = int(layer._map_global_expert_id_to_local_expert_id(expert_id))
        if local < 0:
            continue  # another EP rank's expert
        if not 0 <= local < local_experts:
            return None
        tensor = f"{block}.{weight_prefix}{param_name[len(leaf) :]}"
        base = local * expert_bytes
        if shard_id == "w2":  # down_proj [hidden, intermediate]: this rank's columns
            box = ((rows, cols * tp_size), (0, tp_rank * cols), (rows, cols), base)
        else:  # gate (w1) then up (w3) rows, this rank's slice of each
            half = rows // 2
            offset = base + (half * cols * meta.dtype.itemsize if shard_id == "w3" else 0)
            box = ((half * tp_size, cols), (tp_rank * half, 0), (half, cols), offset)
        shards.append(ShardSpec(tensor, *box[:3], full, box[3]))
    return shards or None


def describe_vllm_shards(model: torch.nn.Module) -> tuple[list[RegionSpec], list[ShardSpec]]:
    packed = dict(getattr(model, "packed_modules_mapping", {}))
    regions: list[RegionSpec] = []
    shards: list[ShardSpec] = []
    generic: list[ParamRow] = []
    for row in model_format_params(model):
        experts = expert_shards(*row)
        if experts is None:
            generic.append(row)
            continue
        full, _, _, meta = row
        regions.append(RegionSpec(full, tuple(int(d) for d in meta.shape), meta.dtype))
        shards.extend(experts)
    more_regions, more_shards = describe_shards(generic, packed, _rank_of)
    return regions + more_regions, shards + more_shards
