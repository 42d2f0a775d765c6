"""Delta generations' per-tensor encoding (``mooncake_rl.generations.delta``): exact round
trips on raw bits, the smallest encoding for the change rate, and refusals of entries that
point outside their tensor or out of order."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.delta import (
    HEADER,
    TensorDelta,
    apply_delta,
    decode,
    diff,
    encode,
    positions_bytes,
)

DTYPES = (np.uint8, np.float16, np.float32, np.float64)
NAME = "model.layers.0.mlp.up_proj.weight"


@st.composite
def policies(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """A tensor's bytes in N-1 and N: random bits, some elements changed (clustered or
    spread, from none to all), any dtype the engines serve by width."""
    dtype = draw(st.sampled_from(DTYPES))
    numel = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    rate = draw(st.sampled_from([0.0, 0.001, 0.01, 0.05, 0.1, 0.5, 1.0]))
    rng = np.random.default_rng(seed)
    width = np.dtype(dtype).itemsize
    base = rng.integers(0, 256, numel * width, dtype=np.uint8).view(dtype)
    new = base.copy()
    changed = rng.random(numel) < rate
    if draw(st.booleans()) and numel:  # one long run, as a trained block changes
        start = int(rng.integers(0, numel))
        changed[start : start + int(rate * numel)] = True
    flips = rng.integers(1, 256, (int(changed.sum()), width), dtype=np.uint8)
    new.view(np.uint8).reshape(numel, width)[changed] ^= flips
    return base, new


@settings(max_examples=150, deadline=None)
@given(policies())
def test_a_delta_applied_to_its_base_gives_the_new_bytes_exactly(pair) -> None:
    base, new = pair
    delta = decode(encode(diff(base, new)))
    landed = base.copy()
    apply_delta(landed, delta)
    assert landed.tobytes() == new.tobytes()
    assert (
        delta.changed
        == int(
            (base.view(np.uint8) != new.view(np.uint8))
            .reshape(base.size, base.itemsize)
            .any(axis=1)
            .sum()
        )
        if base.size
        else delta.changed == 0
    )


@settings(max_examples=150, deadline=None)
@given(policies())
def test_the_chosen_encoding_is_the_smallest_that_fits(pair) -> None:
    base, new = pair
    delta = diff(base, new)
    k, n, width = delta.changed, delta.numel, delta.itemsize
    where = np.flatnonzero(base.view(f"u{width}") != new.view(f"u{width}"))
    gaps_fit = k == 0 or int(np.diff(where, prepend=0).max()) < 1 << 16
    candidates = {"gaps32": 4 * k + k * width, "bitmask": -(-n // 8) + k * width}
    candidates["whole"] = n * width
    if gaps_fit:
        candidates["gaps16"] = 2 * k + k * width
    assert len(delta.positions) + len(delta.values) == min(candidates.values())
    assert delta.nbytes <= HEADER.size + n * width  # never larger than the tensor


def test_one_percent_changed_bf16_weighs_about_two_percent() -> None:
    """The premise of delta generations: 1 % of 2-byte elements changed costs 2 bytes of
    position and 2 of value per change: 4 bytes per 100 elements of 2, 1/50 of the tensor."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 1 << 16, 1 << 20, dtype=np.uint16)
    new = base.copy()
    new[rng.choice(base.size, base.size // 100, replace=False)] ^= 1
    delta = diff(base, new)
    assert delta.encoding == "gaps16"
    assert delta.nbytes / base.nbytes == pytest.approx(0.02, rel=0.01)


def entry(encoding: str, numel: int, changed: int, positions: np.ndarray) -> bytes:
    codes = ("gaps16", "gaps32", "bitmask", "whole")
    header = HEADER.pack(b"MRLDELT\0", codes.index(encoding), 2, numel, changed)
    return header + positions.tobytes() + b"\0\0" * changed


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (entry("gaps16", 10, 2, np.array([4, 6], np.uint16)), "changes element 10 of 10"),
        (entry("gaps16", 10, 2, np.array([4, 0], np.uint16)), "repeats a position"),
        (entry("gaps32", 10, 1, np.array([1 << 20], np.uint32)), "changes element"),
        (entry("bitmask", 10, 1, np.array([0, 0b100], np.uint8)), "past its 10"),
        (entry("bitmask", 10, 1, np.array([0b11, 0], np.uint8)), "marks 2 elements but says 1"),
        (entry("gaps16", 10, 2, np.array([1, 1], np.uint16))[:-1], "take 4 bytes, not 3"),
        (b"MRLDELT\0", "truncated"),
        (b"not a delta entry at all, but long enough", "not a tensor delta"),
    ],
)
def test_a_malformed_entry_is_refused_naming_its_tensor(raw: bytes, says: str) -> None:
    with pytest.raises(InvariantViolation, match=re.escape(NAME)) as refused:
        decode(raw, NAME)
    assert says in str(refused.value)


def test_a_delta_for_another_shape_or_width_changes_nothing() -> None:
    base = np.arange(8, dtype=np.uint16)
    delta = diff(base, base + 1)
    for other in (np.zeros(9, np.uint16), np.zeros(8, np.uint32), np.zeros(16, np.uint16)[::2]):
        before = other.copy()
        with pytest.raises(InvariantViolation, match="w"):
            apply_delta(other, delta, "w")
        assert other.tobytes() == before.tobytes()
    with pytest.raises(InvariantViolation, match="one size"):
        diff(base, np.arange(9, dtype=np.uint16))


def test_the_dataclass_refuses_inconsistent_parts() -> None:
    with pytest.raises(InvariantViolation, match="take 4 bytes, not 2"):
        TensorDelta("gaps16", 2, 10, 2, b"\0\0", b"\0" * 4)
    with pytest.raises(InvariantViolation, match="3 changed elements in a tensor of 2"):
        TensorDelta("bitmask", 2, 2, 3, b"\0", b"\0" * 6)
    assert positions_bytes("bitmask", 9, 0) == 2
