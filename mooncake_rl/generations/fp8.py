"""fp8 generations: float8_e4m3fn weights with one float32 scale per 128x128 block.

Why this layout: it is DeepSeek-V3's (and Kimi-K2's) checkpoint format, which vLLM's and
SGLang's ``fp8`` loaders read with ``weight_block_size: [128, 128]``. A quantized linear
weight ``<name>.weight`` of shape (m, n) is stored in fp8 beside ``<name>.weight_scale_inv``,
float32 of shape (ceil(m/128), ceil(n/128)); the engine dequantizes ``w = q * scale_inv``
block by block. Everything else is published in bfloat16, as those checkpoints do.

The quantizer is the one DeepGEMM's ``per_block_cast_to_fp8`` defines (and vLLM ships):
each block's absolute maximum, floored at 1e-4 so an all-zero block keeps a finite scale,
divided by 448 (e4m3's largest finite value) is the scale; values are multiplied by its
reciprocal in float32 and rounded to e4m3. Matching it bit for bit (tests/test_fp8.py)
means a generation quantized here equals one quantized by the tools those checkpoints
come from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mooncake_rl.errors import InvariantViolation

FP8_FORMAT = "fp8_e4m3"
"""The publisher's rollout format that block-quantizes (``--dtype fp8_e4m3``)."""
FP8_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"
UNQUANTIZED_DTYPE = "bfloat16"
"""What an fp8 generation stores the tensors it does not quantize in."""
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
"""The ``quantization_config`` of the engines' ``config.json`` that reads these tensors."""

# Module names (a dotted component) whose weights DeepSeek-V3's checkpoint keeps in bf16
# besides embeddings and norms: the MoE router (``mlp.gate``; ``router`` elsewhere), lm_head.
_KEPT_MODULES = frozenset({"gate", "router", "lm_head"})


def quantizes(name: str, shape: Sequence[int]) -> bool:
    """Whether an fp8 generation block-quantizes this tensor: a 2-D linear ``.weight``.

    DeepSeek-V3's convention: attention and MLP/expert projections are fp8; embeddings,
    ``lm_head``, norms, the MoE router (``gate``) and every bias or 1-D tensor stay bf16.
    """
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    modules = name.split(".")[:-1]
    return not any(m in _KEPT_MODULES or "norm" in m or "embed" in m for m in modules)


def scale_name(name: str) -> str:
    """``<module>.weight`` -> ``<module>.weight_scale_inv``, the name the loaders read."""
    return name + SCALE_SUFFIX


def scale_shape(shape: Sequence[int]) -> tuple[int, int]:
    """One scale per 128x128 block; edge blocks of a non-multiple shape are partial."""
    rows, cols = shape
    return -(-rows // BLOCK), -(-cols // BLOCK)


def block_quantize(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale_inv) of a 2-D tensor, on the tensor's own device.

    Raises naming ``name`` if a block holds inf or NaN: its scale would be too, and the
    engine would serve NaN for the whole block.
    """
    if tensor.dim() != 2:
        raise InvariantViolation(f"fp8 block quantization of {name} needs 2-D, got {tensor.shape}")
    rows, cols = tensor.shape
    grid = scale_shape((rows, cols))
    padded = tensor.new_zeros((grid[0] * BLOCK, grid[1] * BLOCK), dtype=torch.float32)
    padded[:rows, :cols] = tensor.detach()
    blocks = padded.view(grid[0], BLOCK, grid[1], BLOCK)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
    scale = amax / FP8_MAX
    if not bool(torch.isfinite(scale).all()):
        raise InvariantViolation(
            f"tensor {name} holds inf or NaN: its fp8 block scales would not be finite; "
            "fix the trainer's weights or publish this generation in bfloat16"
        )
    quantized = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn)
    weight = quantized.view(padded.shape)[:rows, :cols].contiguous()
    return weight, scale.view(grid)
