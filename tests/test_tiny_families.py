"""The tiny-model catalog: every family builds, stores what its engines expect, perturbs fully.

No engine here: transformers and safetensors only, so this runs in a few seconds per family.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mooncake_rl.tiny_model import (
    FAMILIES,
    VOCAB,
    checkpoint_names,
    make_tiny,
    make_tiny_llama,
    perturbed_copy,
)

VARIANTS = [
    pytest.param(key, tied, id=f"{key}-{'tied' if tied else 'untied'}")
    for key, family in FAMILIES.items()
    for tied in (False, True)
    if (family.can_tie or not tied) and (family.can_untie or tied)
]


@pytest.mark.parametrize(("key", "tied"), VARIANTS)
def test_family_builds_and_perturbs(key: str, tied: bool, tmp_path: Path) -> None:
    family = FAMILIES[key]
    directory = make_tiny(key, tmp_path / "g1", tied=tied)

    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == [family.architecture]
    assert config["tie_word_embeddings"] is tied
    assert config["vocab_size"] == VOCAB
    assert config["num_hidden_layers"] == 2
    assert (directory / "tokenizer.json").exists()
    assert sorted(p.name for p in directory.glob("*.safetensors")) == ["model.safetensors"]

    names = checkpoint_names(directory)
    assert "model.embed_tokens.weight" in names
    # A tied checkpoint stores only the embedding; the engine ties lm_head to it.
    assert ("lm_head.weight" in names) is not tied
    if family.moe:  # transformers 5 still saves experts one by one, not fused
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names
    if key == "phi3":  # Phi-3 checkpoints store the fused projections
        assert "model.layers.0.self_attn.qkv_proj.weight" in names
        assert "model.layers.0.mlp.gate_up_proj.weight" in names

    before = load_file(str(directory / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in before.values())
    after = load_file(str(perturbed_copy(directory, tmp_path / "g2", seed=1) / "model.safetensors"))
    assert checkpoint_names(tmp_path / "g2") == names
    for name, tensor in before.items():
        assert after[name].shape == tensor.shape, name
        assert after[name].dtype == tensor.dtype, name
        assert not torch.equal(after[name], tensor), name
    assert json.loads((tmp_path / "g2" / "config.json").read_text()) == config


def test_family_default_tying_follows_public_checkpoints(tmp_path: Path) -> None:
    assert FAMILIES["gemma2"].tied_by_default and FAMILIES["gemma3"].tied_by_default
    gemma = make_tiny("gemma3", tmp_path / "gemma")
    assert "lm_head.weight" not in checkpoint_names(gemma)
    assert "lm_head.weight" in checkpoint_names(make_tiny("qwen2", tmp_path / "qwen"))


def test_make_tiny_llama_is_the_llama_family(tmp_path: Path) -> None:
    old = make_tiny_llama(tmp_path / "old", seed=3)
    new = make_tiny("llama", tmp_path / "new", tied=False, seed=3)
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (old / name).read_bytes() == (new / name).read_bytes(), name
    config = json.loads((old / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 32
    assert config["tie_word_embeddings"] is False


def test_unknown_family_or_tying_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        make_tiny("gpt2", tmp_path)
    with pytest.raises(ValueError, match="must tie"):
        make_tiny("gemma2", tmp_path, tied=False)
    with pytest.raises(ValueError, match="does not support tied"):
        make_tiny("deepseek_v3", tmp_path, tied=True)
