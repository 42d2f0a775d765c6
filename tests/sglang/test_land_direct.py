"""SGLang's staged landing: each staged parameter gets exactly its bytes, in one landing.

On this CPU every SGLang parameter is received in place (no AMX repacking), so the engine
tests never stage one; a toy model stands in for the live one here.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

pytest.importorskip("sglang")

from engine_ext.sglang.worker import SglangUpdateWorker
from engine_ext.worker import DirectLanding


class Toy(torch.nn.Module):
    """Parameters of several dtypes, and a ``load_weights`` that records the fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(24, 40, dtype=torch.bfloat16)
        self.norm = torch.nn.Parameter(torch.zeros(24))
        self.scale = torch.nn.Parameter(torch.zeros((), dtype=torch.float32))
        self.loaded: list[str] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.loaded += [name for name, _ in weights]


def test_staged_parameters_land_bit_exact_and_the_fallback_goes_to_load_weights() -> None:
    toy = Toy()
    untouched = toy.up.bias.detach().clone()
    generator = torch.Generator().manual_seed(3)
    staged = {  # random bytes: bf16 NaN payloads must survive too
        name: torch.randint(0, 256, (p.nbytes,), dtype=torch.uint8, generator=generator)
        .view(p.dtype)
        .view(p.shape)
        for name, p in toy.named_parameters()
        if name != "up.bias"
    }
    fallback = [("up.bias", torch.ones(40))]
    SglangUpdateWorker(lambda: toy).land_direct(DirectLanding(staged, iter(fallback), frozenset()))

    live = dict(toy.named_parameters())
    for name, tensor in staged.items():
        assert live[name].detach().view(-1).view(torch.uint8).tolist() == (
            tensor.reshape(-1).view(torch.uint8).tolist()
        ), name
    assert torch.equal(toy.up.bias.detach(), untouched)  # the toy's loader stores nothing
    assert toy.loaded == ["up.bias"]
    assert toy.up.weight.requires_grad


def test_a_staged_tensor_that_does_not_fit_its_parameter_changes_nothing() -> None:
    toy = Toy()
    before = {n: p.detach().clone() for n, p in toy.named_parameters()}
    staged = {"norm": torch.ones(24), "up.weight": torch.ones(24, 40, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"\(24, 40\) tensor into a torch.bfloat16 \(40, 24\)"):
        landing = DirectLanding(staged, iter([("up.bias", None)]), frozenset())
        SglangUpdateWorker(lambda: toy).land_direct(landing)
    assert toy.loaded == []  # refused before the fallback reached the live model
    assert all(torch.equal(p.detach(), before[n]) for n, p in toy.named_parameters())
