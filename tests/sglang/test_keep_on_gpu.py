"""Keep mode end to end on a real SGLang server (needs a CUDA GPU; skipped elsewhere).

A real ``mooncake_master`` and Store; an SGLang server started with ``--load-format
mooncake`` from generation 1 and a reference SGLang server loading generation 2's
checkpoint from disk. A greedy request streams while the coordinator lands generation 2
in keep mode: it finishes on its length, not aborted; SGLang's ``weight_versions`` spans
cover its output tokens with version 1 then version 2; the tokens after the switch are
what the reference computes from the same prefix (they were recomputed on the new
weights, not decoded over KV the old ones wrote); and the engine then answers as the
reference does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import httpx
import torch

from engine_ext.receiver import ServedRecord, weight_version
from mooncake_rl.coordinator import Coordinator
from mooncake_rl.generations.commands import checkpoint_tensors
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.services import EmbeddedMaster, free_port
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import make_tiny, perturbed_copy
from tests.conftest import settings_for
from tests.sglang.harness import settings_env

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="an SGLang server needs a CUDA GPU"
)

MODEL = "tiny-sglang-gpu"
CONTEXT = 4096
LONG = 3000
"""The streamed request's tokens: long enough to still run when the update lands."""
PROMPT = [5, 6, 7, 8, 9]
ROOT = Path(__file__).resolve().parents[2]


class Server:
    """``python -m sglang.launch_server`` on a loopback port, greedy and without a radix
    cache (every request prefills its whole prefix, as a retracted one does)."""

    def __init__(self, flags: list[str], env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log.open("wb")
        environment = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang.launch_server",
                *("--host", "127.0.0.1", "--port", str(self.port)),
                *("--dtype", "bfloat16", "--mem-fraction-static", "0.2"),
                *("--disable-radix-cache", "--skip-server-warmup"),
                *flags,
            ],
            env=environment,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait(self, path: str, within_s: float = 600) -> None:
        deadline = time.monotonic() + within_s
        while True:
            assert self.process.poll() is None, f"SGLang exited; see {self.log.name}"
            try:
                if httpx.get(f"{self.url}{path}", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"SGLang not up; see {self.log.name}"
            time.sleep(1)

    def generate(self, input_ids: list[int], tokens: int) -> list[int]:
        body = {"input_ids": input_ids, "sampling_params": greedy(tokens)}
        reply = httpx.post(f"{self.url}/generate", json=body, timeout=300).json()
        assert reply["meta_info"]["finish_reason"]["type"] == "length", reply["meta_info"]
        return reply["output_ids"]

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def greedy(tokens: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("sglang-gpu")
    first = make_tiny("qwen2", root / "g1", tied=True, sizes={"max_position_embeddings": CONTEXT})
    return [first, perturbed_copy(first, root / "g2", 1)]


@pytest.fixture(scope="module")
def store(master: EmbeddedMaster, holders) -> Iterator[StoreClient]:
    segment = holders("sglang-gpu-store").segment
    client = StoreClient(
        settings_for(master, "coordinator", segment_bytes=0, local_segment=segment)
    )
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def servers(
    master: EmbeddedMaster,
    store: StoreClient,
    dirs: list[Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Server, Server]]:
    """(the engine under test on generation 1 from the Store, the reference on 2)."""
    logs = tmp_path_factory.mktemp("sglang-gpu-logs")
    assert publish(store, dirs[0]) == 1
    env = settings_env(settings_for(master, "node-gpu", segment_bytes=0))
    extra = json.dumps({"name": MODEL})
    engine = Server(
        [
            *("--model-path", str(dirs[0])),
            *("--load-format", "mooncake", "--model-loader-extra-config", extra),
        ],
        env,
        logs / "engine.log",
    )
    reference = Server(["--model-path", str(dirs[1])], {}, logs / "reference.log")
    try:
        engine.wait("/mooncake/status")  # builds the receiver: tags generation 1's version
        reference.wait("/health")
        yield engine, reference
    finally:
        engine.close()
        reference.close()


def publish(store: StoreClient, model_dir: Path) -> int:
    tensors = checkpoint_tensors(model_dir)
    return publish_local(store, MODEL, tensors, dtype="bfloat16").generation


def version_of(store: StoreClient, generation: int) -> str:
    record = GenerationRegistry(store, MODEL).active()
    assert record is not None and record.generation == generation
    return weight_version(MODEL, ServedRecord(generation, record.fence, record.incarnation))


def stream(url: str, chunks: list[dict[str, Any]], started: threading.Event) -> None:
    """One streamed greedy request of ``LONG`` tokens; every chunk it sends, in order."""
    body = {"input_ids": PROMPT, "sampling_params": greedy(LONG), "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line.removeprefix("data:")))
            started.set()


def test_a_request_kept_through_an_update_finishes_on_the_new_weights(
    store: StoreClient, servers: tuple[Server, Server], dirs: list[Path]
) -> None:
    engine, reference = servers
    old = version_of(store, 1)
    assert httpx.get(f"{engine.url}/model_info", timeout=30).json()["weight_version"] == old
    chunks: list[dict[str, Any]] = []
    started = threading.Event()
    streaming = threading.Thread(target=stream, args=(engine.url, chunks, started))
    streaming.start()
    assert started.wait(120), "the streamed request produced no token"
    assert publish(store, dirs[1]) == 2
    with Coordinator(store, [engine.url]) as coordinator:
        result = coordinator.update(MODEL, drain_mode="keep")
    streaming.join(timeout=600)
    assert not streaming.is_alive()
    assert (result.drain_mode, result.committed) == ("keep", [engine.url])
    new = version_of(store, 2)

    last = chunks[-1]
    meta, output = last["meta_info"], last["output_ids"]
    assert meta["finish_reason"] == {"type": "length", "length": LONG}
    assert len(output) == meta["completion_tokens"] == LONG
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [old, new]
    switched = spans[0]["end"]
    assert 0 < switched < LONG
    assert spans == [
        {"version": old, "start": 0, "end": switched},
        {"version": new, "start": switched, "end": LONG},
    ]
    assert meta["weight_version"] == new
    # After the switch: what generation 2 computes from the same prefix.
    assert output[switched:] == reference.generate(PROMPT + output[:switched], LONG - switched)
    # And the engine now serves generation 2 as the reference loads it from disk.
    assert engine.generate(PROMPT, 64) == reference.generate(PROMPT, 64)
    status = httpx.get(f"{engine.url}/mooncake/status", timeout=30).json()
    assert (status["state"], status["generation"], status["pause_modes"]) == (
        "serving",
        2,
        ["abort", "wait", "keep"],
    )
