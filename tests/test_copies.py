"""Local copies (``apply.copies``): exactly the bytes asked, merged where adjacent, and a
copy outside its regions (or across devices) refused before any byte moves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mooncake_rl.apply.copies import LocalCopier
from mooncake_rl.apply.registration import Region
from mooncake_rl.errors import InvariantViolation

SIZE = 256


def _regions(*names: str, device: str = "cpu") -> tuple[dict[str, torch.Tensor], LocalCopier]:
    generator = torch.Generator().manual_seed(len(names))
    buffers = {
        n: torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=generator) for n in names
    }
    regions = {n: Region(n, b.data_ptr(), SIZE, device) for n, b in buffers.items()}
    return buffers, LocalCopier(regions)


@st.composite
def disjoint_copies(draw) -> list[tuple[str, int, str, int, int]]:
    """Copies from a source region into two destinations, their destination ranges
    disjoint (so the result does not depend on their order), often back to back."""
    copies, cursor = [], {"a": 0, "b": 0}
    for _ in range(draw(st.integers(1, 30))):
        dst = draw(st.sampled_from("ab"))
        gap = draw(st.sampled_from([0, 0, 0, 3]))
        length = draw(st.integers(1, 16))
        start = cursor[dst] + gap
        if start + length > SIZE:
            break
        copies.append(("src", draw(st.integers(0, SIZE - length)), dst, start, length))
        cursor[dst] = start + length
    return copies


@given(disjoint_copies())
def test_every_copy_moves_exactly_its_bytes(copies) -> None:
    buffers, copier = _regions("src", "a", "b")
    expected = {n: bytearray(b.numpy().tobytes()) for n, b in buffers.items()}
    for src, src_off, dst, dst_off, n in copies:
        expected[dst][dst_off : dst_off + n] = expected[src][src_off : src_off + n]
    assert copier.copy(copies) == sum(c[4] for c in copies)
    assert {n: b.numpy().tobytes() for n, b in buffers.items()} == {
        n: bytes(b) for n, b in expected.items()
    }


@pytest.mark.parametrize(
    "bad",
    [("src", SIZE - 4, "a", 0, 8), ("src", 0, "a", SIZE - 4, 8), ("src", 0, "a", 0, 0)],
    ids=["past-the-source", "past-the-destination", "empty"],
)
def test_a_copy_outside_its_regions_is_refused_before_any_byte_moves(bad) -> None:
    buffers, copier = _regions("src", "a")
    before = buffers["a"].clone()
    with pytest.raises(InvariantViolation, match="lies outside its regions"):
        copier.copy([("src", 0, "a", 0, 8), bad])
    assert torch.equal(buffers["a"], before)


def test_a_copy_across_devices_is_refused_before_any_byte_moves() -> None:
    buffers, copier = _regions("src", "a")
    labelled = torch.zeros(SIZE, dtype=torch.uint8)  # host memory, labelled as a device's
    copier.regions = {**copier.regions, "gpu": Region("gpu", labelled.data_ptr(), SIZE, "cuda:0")}
    before = buffers["a"].clone()
    with pytest.raises(InvariantViolation, match="from src to gpu crosses devices"):
        copier.copy([("src", 0, "a", 0, 8), ("src", 0, "gpu", 0, 8)])
    assert torch.equal(buffers["a"], before)
