"""``mooncake-rl publish / status / gc`` as a user runs them, against real services."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mooncake_rl.services import EmbeddedMaster, SegmentHolder
from mooncake_rl.store import StoreClient
from tests.conftest import fragment_bytes, settings_for


def run_cli(
    master: EmbeddedMaster, local_segment: str, *args: str, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "MOONCAKE_RL_MASTER": master.master_address,
        "MOONCAKE_RL_METADATA": master.metadata_url,
        "MOONCAKE_RL_LOCAL_SEGMENT": local_segment,
        **extra_env,
    }
    return subprocess.run(
        [sys.executable, "-m", "mooncake_rl.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def cli(master: EmbeddedMaster, local_segment: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``run_cli`` in this process (``mooncake_rl.cli.main``): the same parsing, exit codes
    and output, without a Python start per command. ``run_cli`` keeps the real entry point
    covered."""
    from mooncake_rl.cli import main

    env = {
        "MOONCAKE_RL_MASTER": master.master_address,
        "MOONCAKE_RL_METADATA": master.metadata_url,
        "MOONCAKE_RL_LOCAL_SEGMENT": local_segment,
    }
    saved = {k: os.environ.get(k) for k in env}
    out, err = io.StringIO(), io.StringIO()
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exited:  # argparse refusals
                code = exited.code if isinstance(exited.code, int) else 2
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def write_checkpoint(directory: Path, scale: float) -> dict[str, torch.Tensor]:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        "model.embed_tokens.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8) * scale,
        "model.norm.weight": torch.ones(8) * scale,
    }
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


def test_publish_status_gc_round_trip(
    master: EmbeddedMaster, holders, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = holders("cli-node")
    for scale in (1.0, 2.0, 3.0):
        tensors = write_checkpoint(tmp_path / f"ckpt{scale}", scale)
        # The real entry point once (python -m mooncake_rl.cli), then in this process.
        published = (run_cli if scale == 1.0 else cli)(
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

    status = cli(master, holder.segment, "status", "--name", "cli-model", "--json")
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
        by_name = {f.tensor_id: fragment_bytes(store, f) for f in manifest.fragments}
    assert by_name["model.norm.weight"] == (torch.ones(8) * 3.0).numpy().tobytes()
    assert (
        by_name["model.embed_tokens.weight"]
        == tensors["model.embed_tokens.weight"].numpy().tobytes()
    )

    verified = cli(master, holder.segment, "verify", "--name", "cli-model")
    assert verified.returncode == 0, verified.stderr
    report = json.loads(verified.stdout)
    assert (report["ok"], report["generation"], report["bytes"], report["problems"]) == (
        True,
        3,
        288,
        [],
    )

    # Retention alone: the retire grace (tests/test_generations.py) would spare 1 and 2 for
    # 10 s after they stopped being active, and this test runs faster than that.
    monkeypatch.setenv("MOONCAKE_RL_RETIRE_GRACE_S", "0")
    collected = cli(master, holder.segment, "gc", "--name", "cli-model", "--keep", "1")
    assert collected.returncode == 0, collected.stderr
    assert json.loads(collected.stdout)["deleted"] == [1, 2]
    after = json.loads(
        cli(master, holder.segment, "status", "--name", "cli-model", "--json").stdout
    )
    assert [g["generation"] for g in after["generations"]] == [3]
    gone = cli(master, holder.segment, "verify", "--name", "cli-model", "--generation", "1")
    assert gone.returncode == 2 and "OBJECT_NOT_FOUND (-704)" in gone.stderr


NATIVE_LINE = re.compile(r"^[EWIF]\d{4} ", re.MULTILINE)


def test_a_healthy_command_keeps_mooncakes_native_log_off_the_terminal(tmp_path: Path) -> None:
    """Setting up a Store client logs normal first lookups at E level ("metadata not
    found"); a healthy run shows none of it unless --verbose asks, and keeps it in a file.

    A master of its own: on the session's, a process killed by an earlier test leaves its
    segment's metadata behind, and a client that happens to reuse its port finds it, so its
    first lookup logs nothing (seen once in a full run)."""
    with (
        EmbeddedMaster() as master,
        SegmentHolder(master.master_address, master.metadata_url, 32 << 20) as holder,
    ):
        _healthy_command_logs(master, holder, tmp_path)


def _healthy_command_logs(master: EmbeddedMaster, holder: SegmentHolder, tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", 1.0)
    publish = ("publish", str(tmp_path / "ckpt"), "--name", "quiet-model", "--dtype", "float32")
    logs = {"MOONCAKE_RL_LOG_DIR": str(tmp_path)}
    quiet = run_cli(master, holder.segment, *publish, **logs)
    assert quiet.returncode == 0, quiet.stderr
    assert NATIVE_LINE.findall(quiet.stderr) == [] and "InitGoogleLogging" not in quiet.stderr
    # Not a terminal: plain progress lines on stderr, stdout only the generation.
    assert quiet.stdout.strip() == "1" and "publish: 100% of" in quiet.stderr
    kept = (tmp_path / "mooncake-native.log").read_text()
    assert re.search(r"^E\d{4} .*metadata not found", kept, re.MULTILINE)

    refused = run_cli(master, holder.segment, *publish, MOONCAKE_RL_LOG_LEVEL="loud", **logs)
    assert refused.returncode == 2 and "invalid MOONCAKE_RL_* setting" in refused.stderr
    assert "log_level" in refused.stderr and refused.stdout == ""  # nothing published

    loud = run_cli(master, holder.segment, "--verbose", *publish, **logs)
    assert loud.returncode == 0, loud.stderr
    assert re.search(r"^E\d{4} .*metadata not found", loud.stderr, re.MULTILINE)
    assert re.search(r"^I\d{4} ", loud.stderr, re.MULTILINE)


def test_cli_bad_input_is_refused_with_a_clear_error(
    master: EmbeddedMaster, holders, tmp_path: Path
) -> None:
    holder = holders("cli-node")
    missing = cli(master, holder.segment, "publish", str(tmp_path / "nowhere"), "--name", "x")
    assert missing.returncode == 2 and "no *.safetensors files" in missing.stderr
    write_checkpoint(tmp_path / "ok", 1.0)
    bad_dtype = cli(
        master, holder.segment, "publish", str(tmp_path / "ok"), "--name", "x", "--dtype", "int3"
    )
    assert bad_dtype.returncode == 2 and "unknown rollout dtype 'int3'" in bad_dtype.stderr
    bad_name = cli(master, holder.segment, "publish", str(tmp_path / "ok"), "--name", "a/b")
    assert bad_name.returncode == 2 and "model name" in bad_name.stderr
    bad_regex = cli(
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
    bad_pull = cli(
        master, holder.segment, "update", "--name", "x", "--engine", "http://127.0.0.1:9",
        "--pull", "gpu",
    )  # fmt: skip
    assert bad_pull.returncode == 2
    assert "argument --pull: invalid choice: 'gpu'" in bad_pull.stderr
    no_keep = cli(
        master, holder.segment, "publish", str(tmp_path / "ok"), "--name", "x", "--keep", "0"
    )
    assert no_keep.returncode == 2
    assert "keep must be an integer >= 1, got 0; nothing published" in no_keep.stderr
    unknown = cli(master, holder.segment, "status", "--name", "x", "--json")
    assert unknown.returncode == 1
    assert "model 'x' has no active generation" in unknown.stderr
    status = json.loads(unknown.stdout)
    incarnation = status.pop("incarnation")
    assert status.pop("problem").startswith("nothing to serve: model 'x' has no active generation")
    assert status == {"model": "x", "active": None, "fence": None, "generations": []}
    assert incarnation is None or re.fullmatch("[0-9a-f]{16}", incarnation)
