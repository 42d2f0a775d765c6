"""``make gpu-check`` on the CPU (the same code at a small size), and its install step."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gpu_check import GpuCheckConfig, run
from bench.gpu_env import MOONCAKE, mooncake_wheel, pip_command


def test_the_check_lands_every_parameter_bit_exact_in_place() -> None:
    """In place only (the staged landing's bytes are checked in tests/test_apply_planned.py):
    two worker clusters instead of four keep the smoke short."""
    config = GpuCheckConfig(
        device="cpu",
        moe_bytes=4 << 20,
        moe_tensors=400,
        dense_bytes=2 << 20,
        dense_tensors=8,
        workers=2,
        batch_bytes=1 << 20,
        modes=("in_place",),
    )
    result = run(config)
    assert result["goals"]["bit_exact"] is True
    assert result["vllm_engine"] == {
        "skipped": "a CPU run: vLLM-CPU engines are covered by the test suite"
    }
    for name, tensors in (("moe", 400), ("dense", 8)):
        row = result["updates"][f"{name}_in_place"]
        assert row["bit_exact"] and row["mismatched"] == []
        assert row["tensors"] == tensors and row["parameters_landed"] == 2 * tensors
        assert row["store_read_bytes"] == row["bytes"]  # each byte read once (TP row shards)
        assert (row["in_place_bytes"], row["staged_bytes"]) == (row["bytes"], 0)
    assert set(result["updates"]) == {"moe_in_place", "dense_in_place"}
    assert result["scale"]["device_copy_gbps"] > 0 and result["scale"]["store_get_into_gbps"] > 0


@pytest.mark.parametrize(("cuda", "wheel"), [("12.8", "12"), ("13.0", "13"), ("13.1", "13")])
def test_the_mooncake_wheel_follows_torchs_cuda_major(cuda: str, wheel: str) -> None:
    assert mooncake_wheel(cuda) == MOONCAKE[wheel]


@pytest.mark.parametrize(
    ("cuda", "problem"), [(None, "has no CUDA build"), ("11.8", "no Mooncake wheel for CUDA 11.8")]
)
def test_a_torch_without_a_matching_cuda_build_is_refused(cuda: str | None, problem: str) -> None:
    with pytest.raises(SystemExit, match=problem):
        mooncake_wheel(cuda)


def test_carried_wheels_install_offline(tmp_path: Path) -> None:
    command = pip_command("13.0", tmp_path / "site", tmp_path)
    assert command[command.index("--find-links") + 1] == str(tmp_path)
    assert "--no-index" in command and "--no-deps" in command
    assert MOONCAKE["13"] in command
    assert "mooncake-transfer-engine-non-cuda" not in " ".join(command)
