"""A tiny Llama-shaped model built from SGLang's own tensor-parallel layers.

SGLang's ``LlamaForCausalLM`` cannot be built on this CPU (its rotary embedding needs a GPU
kernel package), so the tests use SGLang's real parallel layers — ``VocabParallelEmbedding``,
``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``ParallelLMHead`` — with their ``weight_loader`` / ``output_dim`` / ``input_dim``
attributes, and a ``load_weights`` that follows SGLang's Llama (``stacked_params_mapping``).
The checkpoints are :func:`mooncake_rl.tiny_model.make_tiny`'s tied Qwen2 (a q/k/v bias,
``lm_head`` tied to the embeddings as SGLang's Qwen2 ties it, one key/value head replicated
across TP ranks) or tiny Llama.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from sglang.srt.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_loader.weight_utils import default_weight_loader
from torch import nn

ARCHITECTURE = "MooncakeTinyForCausalLM"


class _Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class _Attention(nn.Module):
    def __init__(self, config: Any, quant_config: Any) -> None:
        super().__init__()
        heads, kv_heads, head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        qkv_bias = config.model_type == "qwen2"  # Qwen2 has a q/k/v bias, Llama none
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, heads, kv_heads, bias=qkv_bias, quant_config=quant_config
        )
        self.o_proj = RowParallelLinear(
            heads * head_dim, config.hidden_size, bias=False, quant_config=quant_config
        )


class _Mlp(nn.Module):
    def __init__(self, config: Any, quant_config: Any) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=False, quant_config=quant_config
        )


class _Layer(nn.Module):
    def __init__(self, config: Any, quant_config: Any) -> None:
        super().__init__()
        self.self_attn = _Attention(config, quant_config)
        self.mlp = _Mlp(config, quant_config)
        self.input_layernorm = _Norm(config.hidden_size)
        self.post_attention_layernorm = _Norm(config.hidden_size)


class _Body(nn.Module):
    def __init__(self, config: Any, quant_config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            _Layer(config, quant_config) for _ in range(config.num_hidden_layers)
        )
        self.norm = _Norm(config.hidden_size)


class MooncakeTinyForCausalLM(nn.Module):
    def __init__(self, config: Any, quant_config: Any = None, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = _Body(config, quant_config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:  # as SGLang's Qwen2 does: one Parameter, two layers
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.stacked_params_mapping = [  # as in SGLang's LlamaForCausalLM
            (".qkv_proj", ".q_proj", "q"),
            (".qkv_proj", ".k_proj", "k"),
            (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0),
            (".gate_up_proj", ".up_proj", 1),
        ]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, loaded in weights:
            for fused, shard, shard_id in self.stacked_params_mapping:
                if shard in name:
                    param = params[name.replace(shard, fused)]
                    param.weight_loader(param, loaded, shard_id)
                    break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, loaded)


EntryClass = MooncakeTinyForCausalLM
