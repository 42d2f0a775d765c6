"""A tiny random Llama with a word-level tokenizer: the demo's and tests' model.

Small enough to serve on a 2-core CPU in well under a minute, large enough to exercise TP
sharding (head_dim 32, two heads) and fused qkv/gate_up parameters. Greedy outputs are
compared with a transformers reference of exactly the same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VOCAB = 128
PROMPT = [5, 6, 7, 8, 9]


def make_tiny_llama(directory: Path, seed: int = 0) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
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
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)  # large enough that greedy output is not degenerate
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def perturbed_copy(source: Path, destination: Path, seed: int, scale: float = 0.1) -> Path:
    """Same config and tokenizer, every weight moved by seeded noise: 'the next policy'."""
    import shutil

    shutil.copytree(source, destination, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    state = load_file(str(source / "model.safetensors"))
    moved = {
        k: (v + scale * torch.randn(v.shape, generator=generator)).contiguous()
        for k, v in state.items()
    }
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
