"""A new user's first publish against a master nobody lends memory to says what to do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from mooncake_rl.services import EmbeddedMaster, MasterConfig
from tests.test_cli_generations import write_checkpoint


def cli(master: EmbeddedMaster, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mooncake_rl.cli", *args],
        env={
            **os.environ,
            "MOONCAKE_RL_MASTER": master.master_address,
            "MOONCAKE_RL_METADATA": master.metadata_url,
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_publish_without_a_segment_names_the_holder_command(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "ckpt", 1.0)
    publish = ("publish", str(tmp_path / "ckpt"), "--name", "no-segment", "--dtype", "float32")
    with EmbeddedMaster(MasterConfig(lease_ttl_ms=500, log_dir=tmp_path)) as master:
        failed = cli(master, *publish)
        assert failed.returncode != 0
        assert "NO_AVAILABLE_HANDLE (-200)" in failed.stderr
        # The operation and the key it wrote (Mooncake's own log stays off the terminal).
        assert re.search(r"in put\w* \[[^\]]+\]", failed.stderr), failed.stderr
        assert "no segment is mounted" in failed.stderr
        assert "mooncake-rl holder --segment-bytes N" in failed.stderr

        # Following the hint works: a holder lends memory, the same publish then succeeds.
        holder = subprocess.Popen(
            [sys.executable, "-m", "mooncake_rl.cli", "holder", "--segment-bytes", str(32 << 20)],
            env={
                **os.environ,
                "MOONCAKE_RL_MASTER": master.master_address,
                "MOONCAKE_RL_METADATA": master.metadata_url,
                "TMPDIR": str(tmp_path),
            },
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None
            segment = json.loads(holder.stdout.readline())["segment"]
            published = cli(master, *publish, MOONCAKE_RL_LOCAL_SEGMENT=segment)
            assert published.returncode == 0, published.stderr
            assert published.stdout.strip() == "1"
        finally:
            holder.terminate()
            holder.wait(timeout=30)
