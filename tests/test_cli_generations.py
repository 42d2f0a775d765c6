"""``mooncake-rl publish / status / gc`` as a user runs them, against real services."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from tests.conftest import settings_for


def run_cli(
    master: EmbeddedMaster, local_segment: str, *args: str
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "MOONCAKE_RL_MASTER": master.master_address,
        "MOONCAKE_RL_METADATA": master.metadata_url,
        "MOONCAKE_RL_LOCAL_SEGMENT": local_segment,
    }
    return subprocess.run(
        [sys.executable, "-m", "mooncake_rl.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def write_checkpoint(directory: Path, scale: float) -> dict[str, torch.Tensor]:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        "model.embed_tokens.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8) * scale,
        "model.norm.weight": torch.ones(8) * scale,
    }
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


def test_publish_status_gc_round_trip(master: EmbeddedMaster, holders, tmp_path: Path) -> None:
    holder = holders("cli-node")
    for scale in (1.0, 2.0, 3.0):
        tensors = write_checkpoint(tmp_path / f"ckpt{scale}", scale)
        published = run_cli(
            master,
            holder.segment,
            "publish",
            str(tmp_path / f"ckpt{scale}"),
            "--name",
            "cli-model",
            "--dtype",
            "float32",
        )
        assert published.returncode == 0, published.stderr
        assert published.stdout.strip() == str(int(scale))

    status = run_cli(master, holder.segment, "status", "--name", "cli-model", "--json")
    assert status.returncode == 0, status.stderr
    parsed = json.loads(status.stdout)
    assert parsed["active"] == 3
    assert [g["generation"] for g in parsed["generations"]] == [1, 2, 3]
    latest = parsed["generations"][-1]
    assert latest["tensors"] == 2 and latest["bytes"] == 64 * 4 + 8 * 4 and latest["active"]
    # The CLI lends no memory: every byte sits in the node's segment holder, which outlives it.
    assert latest["bytes_per_segment"] == {holder.segment: 288}

    with StoreClient(settings_for(master, "reader")) as store:
        from mooncake_rl.generations import active_generation, load_manifest

        record = active_generation(store, "cli-model")
        manifest = load_manifest(store, "cli-model", record.generation)
        by_name = {f.tensor_id: store.get_bytes(f.object_key) for f in manifest.fragments}
    assert by_name["model.norm.weight"] == (torch.ones(8) * 3.0).numpy().tobytes()
    assert (
        by_name["model.embed_tokens.weight"]
        == tensors["model.embed_tokens.weight"].numpy().tobytes()
    )

    verified = run_cli(master, holder.segment, "verify", "--name", "cli-model")
    assert verified.returncode == 0, verified.stderr
    report = json.loads(verified.stdout)
    assert (report["ok"], report["generation"], report["bytes"], report["problems"]) == (
        True,
        3,
        288,
        [],
    )

    collected = run_cli(master, holder.segment, "gc", "--name", "cli-model", "--keep", "1")
    assert collected.returncode == 0, collected.stderr
    assert json.loads(collected.stdout)["deleted"] == [1, 2]
    after = json.loads(
        run_cli(master, holder.segment, "status", "--name", "cli-model", "--json").stdout
    )
    assert [g["generation"] for g in after["generations"]] == [3]
    gone = run_cli(master, holder.segment, "verify", "--name", "cli-model", "--generation", "1")
    assert gone.returncode == 2 and "OBJECT_NOT_FOUND (-704)" in gone.stderr


def test_cli_bad_input_is_refused_with_a_clear_error(
    master: EmbeddedMaster, holders, tmp_path: Path
) -> None:
    holder = holders("cli-node")
    missing = run_cli(master, holder.segment, "publish", str(tmp_path / "nowhere"), "--name", "x")
    assert missing.returncode == 2 and "no *.safetensors files" in missing.stderr
    write_checkpoint(tmp_path / "ok", 1.0)
    bad_dtype = run_cli(
        master, holder.segment, "publish", str(tmp_path / "ok"), "--name", "x", "--dtype", "int3"
    )
    assert bad_dtype.returncode == 2 and "unknown rollout dtype 'int3'" in bad_dtype.stderr
    bad_name = run_cli(master, holder.segment, "publish", str(tmp_path / "ok"), "--name", "a/b")
    assert bad_name.returncode == 2 and "model name" in bad_name.stderr
    bad_regex = run_cli(
        master,
        holder.segment,
        "update",
        "--name",
        "x",
        "--engine",
        "http://127.0.0.1:9",
        "--mode",
        "direct",
        "--direct-fallback",
        "(",
    )
    assert bad_regex.returncode == 2
    assert "--direct-fallback: not a regular expression" in bad_regex.stderr
    no_keep = run_cli(
        master, holder.segment, "publish", str(tmp_path / "ok"), "--name", "x", "--keep", "0"
    )
    assert no_keep.returncode == 2
    assert "keep must be an integer >= 1, got 0; nothing published" in no_keep.stderr
    unknown = run_cli(master, holder.segment, "status", "--name", "x", "--json")
    assert unknown.returncode == 1
    assert "model 'x' has no active generation" in unknown.stderr
    status = json.loads(unknown.stdout)
    incarnation = status.pop("incarnation")
    assert status.pop("problem").startswith("nothing to serve: model 'x' has no active generation")
    assert status == {"model": "x", "active": None, "fence": None, "generations": []}
    assert incarnation is None or re.fullmatch("[0-9a-f]{16}", incarnation)
