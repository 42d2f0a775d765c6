"""How much of a policy changes between RL steps, and what a delta of it weighs
(``python -m bench.delta``, JSON).

    fp32 master weights (a small Llama's shapes) --Adam steps at a learning rate-->
    consecutive policies, cast to the served dtypes (bf16; block fp8 with its scales)
    --mooncake_rl.generations.delta.diff--> per tensor: changed elements, delta bytes
    --codecs (zlib; zstandard and lz4 where installed)--> compressed bytes and speed

Why: delta generations rest on the premise that few served elements change per step (about
1-3 % of bf16, DESIGN.md). This measures it on real Adam steps instead of assuming it, and
picks the codec, if any, by measured ratio and speed. The gradient is random, so every
element moves by about the learning rate each step; real gradients are sparser, so these
change fractions are upper bounds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch

from bench.ops import host
from mooncake_rl.generations import fp8
from mooncake_rl.generations.delta import apply_delta, diff, encode

Codec = Callable[[bytes], bytes]


def llama_shapes(hidden: int, layers: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """A Llama's weight shapes (intermediate 8/3 x hidden, rounded to 128)."""
    intermediate = -(-hidden * 8 // 3 // 128) * 128
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        layer = f"layers.{i}."
        for name, shape in {
            "self_attn.q_proj.weight": (hidden, hidden),
            "self_attn.k_proj.weight": (hidden // 4, hidden),
            "self_attn.v_proj.weight": (hidden // 4, hidden),
            "self_attn.o_proj.weight": (hidden, hidden),
            "mlp.gate_proj.weight": (intermediate, hidden),
            "mlp.up_proj.weight": (intermediate, hidden),
            "mlp.down_proj.weight": (hidden, intermediate),
            "input_layernorm.weight": (hidden,),
        }.items():
            shapes[layer + name] = shape
    return shapes


def served(weights: dict[str, torch.Tensor], dtype: str) -> dict[str, np.ndarray]:
    """The bytes engines would be sent: bf16 tensors, or fp8 weights plus their scales."""
    out: dict[str, np.ndarray] = {}
    for name, tensor in weights.items():
        if dtype == "fp8" and tensor.dim() == 2:
            weight, scale = fp8.block_quantize(name, tensor)
            out[name] = weight.view(torch.uint8).numpy()
            out[name + "_scale_inv"] = scale.numpy()
        else:
            out[name] = tensor.to(torch.bfloat16).view(torch.int16).numpy()
    return out


def codecs() -> dict[str, Codec]:
    """The codecs to try: zlib always, zstandard and lz4 where installed."""
    found: dict[str, Codec] = {
        "zlib-1": lambda data: zlib.compress(data, 1),
        "zlib-6": lambda data: zlib.compress(data, 6),
    }
    try:
        zstd = importlib.import_module("zstandard")
        for level in (1, 3):
            found[f"zstd-{level}"] = zstd.ZstdCompressor(level=level).compress
    except ImportError:
        pass
    try:
        lz4 = importlib.import_module("lz4.frame")
        found["lz4"] = lz4.compress
    except ImportError:
        pass
    return found


def step_rows(
    before: dict[str, np.ndarray], after: dict[str, np.ndarray], compressors: dict[str, Codec]
) -> dict[str, Any]:
    """One step's figures: changed fraction, delta against full bytes, encodings, seconds."""
    full = sum(a.nbytes for a in after.values())
    elements = sum(a.size for a in after.values())
    started = time.perf_counter()
    deltas = {name: diff(before[name], after[name]) for name in after}
    diff_s = time.perf_counter() - started
    entries = [encode(d) for d in deltas.values()]
    started = time.perf_counter()
    for name, delta in deltas.items():
        landed = before[name].copy()
        apply_delta(landed, delta, name)
    apply_s = time.perf_counter() - started
    delta_bytes = sum(len(e) for e in entries)
    blob = b"".join(entries)
    compressed = {}
    for label, compress in compressors.items():
        started = time.perf_counter()
        size = len(compress(blob))
        seconds = time.perf_counter() - started
        compressed[label] = {
            "bytes_over_delta": round(size / max(1, delta_bytes), 4),
            "mb_per_s": round(delta_bytes / seconds / 1e6, 1) if seconds else None,
        }
    encodings: dict[str, int] = {}
    for delta in deltas.values():
        encodings[delta.encoding] = encodings.get(delta.encoding, 0) + 1
    return {
        "changed_fraction": round(sum(d.changed for d in deltas.values()) / elements, 5),
        "full_bytes": full,
        "delta_bytes": delta_bytes,
        "delta_over_full": round(delta_bytes / full, 4),
        "encodings": encodings,
        "diff_gbps": round(full / diff_s / 1e9, 3),
        "apply_gbps": round(full / apply_s / 1e9, 3),
        "codecs": compressed,
    }


def adam_steps(
    master: dict[str, torch.Tensor], lr: float, warmup: int, generator: torch.Generator
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """fp32 ``master`` weights (stepped in place) after ``warmup`` Adam steps at ``lr``
    (random gradients), and after one more: two consecutive policies as a trainer holds
    them."""
    params = [torch.nn.Parameter(t) for t in master.values()]
    optimizer = torch.optim.Adam(params, lr=lr)
    snapshots = []
    for step in range(warmup + 2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        if step >= warmup:
            snapshots.append({n: p.detach().clone() for n, p in zip(master, params, strict=True)})
    return snapshots[0], snapshots[1]


def measure(
    hidden: int, layers: int, vocab: int, lrs: Sequence[float], warmup: int, seed: int
) -> list[dict[str, Any]]:
    """Per learning rate and served dtype, the step after ``warmup`` Adam steps."""
    compressors = codecs()
    rows = []
    for lr in lrs:
        generator = torch.Generator().manual_seed(seed)
        shapes = llama_shapes(hidden, layers, vocab)
        master = {
            n: (torch.randn(s, generator=generator) * 0.02 + (1.0 if len(s) == 1 else 0.0))
            for n, s in shapes.items()
        }
        snapshots = adam_steps(master, lr, warmup, generator)
        for dtype in ("bf16", "fp8"):
            before, after = (served(s, dtype) for s in snapshots)
            rows.append({"lr": lr, "dtype": dtype, **step_rows(before, after, compressors)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.delta", description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4])
    p.add_argument("--warmup", type=int, default=3, help="Adam steps before the one measured")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    started = time.perf_counter()
    rows = measure(args.hidden, args.layers, args.vocab, args.lr, args.warmup, args.seed)
    print(
        json.dumps(
            {
                "bench": "delta",
                "command": " ".join(["python -m bench.delta", *(argv or sys.argv[1:])]),
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "host": host(),
                "model": f"llama shapes, hidden {args.hidden}, {args.layers} layers, "
                f"vocab {args.vocab}; fp32 master weights, Adam, random gradients",
                "steps": rows,
                "wall_seconds": round(time.perf_counter() - started, 1),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
