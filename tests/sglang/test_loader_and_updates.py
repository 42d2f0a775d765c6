"""``--load-format mooncake`` and both update modes through SGLang's model-loader stack.

A real ``mooncake_master`` and segment holder; generations published with
``publish_local``; models built and loaded by SGLang's ``get_model_loader`` /
``load_model`` from SGLang parallel layers. Two processes simulate TP=2 ranks (node labels
``node-a``/``node-b``) and are driven by the real coordinator over the shared
``/mooncake/*`` routes; only the transport to the ranks (SGLang's scheduler IPC) and the
API-side drain/resume/cache calls are the test's. Every comparison is byte-exact against
SGLang loading the same checkpoint from disk at the same TP rank.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import httpx
import torch
import uvicorn
from fastapi import FastAPI
from safetensors.torch import load_file

from engine_ext.backend import WorkerBackend
from engine_ext.loading import served_by
from engine_ext.receiver import DrainRequest, Receiver
from engine_ext.routes import build_router
from mooncake_rl.coordinator import Coordinator, UpdateFailed
from mooncake_rl.generations.commands import checkpoint_tensors
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.services import EmbeddedMaster, free_port
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import perturbed_copy
from tests.conftest import settings_for
from tests.procs import CTX
from tests.sglang.harness import (
    load_model,
    mismatched_parameters,
    publish_topology,
    serve_tp_rank,
    settings_env,
    sglang_model_dir,
)

MODEL = "tiny-sglang"
ENGINE = "sglang-under-test"


class QueueBackend(WorkerBackend):
    """The shared backend over queues to the simulated TP ranks (stands in for SGLang's
    scheduler IPC; the API-side drain/resume/cache calls are recorded)."""

    def __init__(self, ranks: list[tuple[Any, Any]]) -> None:
        self.engine_id = ENGINE
        self.ranks = ranks
        self.events: list[str] = []

    async def call_workers(self, method: str, *args: Any) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._call_all, method, args)

    def _call_all(self, method: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
        for inbox, _ in self.ranks:
            inbox.put(("call", ENGINE, method, list(args)))
        return [_answer(outbox) for _, outbox in self.ranks]

    async def drain(self, request: DrainRequest) -> None:
        self.events.append(f"drain:{request.mode}")

    async def resume(self) -> None:
        self.events.append("resume")

    async def reset_cache(self) -> None:
        self.events.append("reset_cache")


def _answer(outbox: Any) -> Any:
    status, value = outbox.get(timeout=300)
    if status != "ok":
        raise RuntimeError(value)
    return value


class World:
    """Two TP ranks serving one engine's /mooncake routes on a loopback port."""

    def __init__(self, root: Path, master: EmbeddedMaster, holder_segment: str) -> None:
        self.root = root
        self.master = master
        self.dirs = [sglang_model_dir(root / "g1")]
        for seed in (1, 2, 3):
            self.dirs.append(perturbed_copy(self.dirs[0], root / f"g{seed + 1}", seed))
        self.store = StoreClient(
            settings_for(master, "coordinator", segment_bytes=0, local_segment=holder_segment)
        )
        self.ranks: list[tuple[Any, Any]] = []
        self.processes: list[Any] = []
        self.server: uvicorn.Server | None = None

    def publish(self, index: int, dtype: str = "float32") -> int:
        tensors = checkpoint_tensors(self.dirs[index])
        return publish_local(self.store, MODEL, tensors, dtype=dtype).generation

    def start(self) -> None:
        for rank, node in enumerate(("node-a", "node-b")):
            inbox, outbox = CTX.Queue(), CTX.Queue()
            env = settings_env(settings_for(self.master, node, segment_bytes=0))
            process = CTX.Process(
                target=serve_tp_rank, args=(env, 2, rank, self.dirs[0], MODEL, inbox, outbox)
            )
            process.start()
            self.ranks.append((inbox, outbox))
            self.processes.append(process)
        for _, outbox in self.ranks:
            assert _answer(outbox) == "ready"
        self.backend = QueueBackend(self.ranks)
        served, loaded = asyncio.run(self.backend.served())
        self.receiver = Receiver(self.backend, loaded or MODEL, served)

        async def get_receiver(request: Any) -> Receiver:
            return self.receiver

        app = FastAPI()
        app.include_router(
            build_router(get_receiver, None, max_body_bytes=Settings().max_body_bytes)
        )
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        threading.Thread(target=self.server.run, daemon=True).start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "route server did not start"
            time.sleep(0.05)

    def compare(self, index: int) -> list[list[str]]:
        """Per rank: parameters that differ from SGLang loading checkpoint ``index``."""
        for inbox, _ in self.ranks:
            inbox.put(("compare", self.dirs[index]))
        return [_answer(outbox) for _, outbox in self.ranks]

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/mooncake/status", timeout=30).json()

    def close(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        for (inbox, _), process in zip(self.ranks, self.processes, strict=True):
            if process.is_alive():
                inbox.put(("stop",))
                process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
        self.store.close()


@pytest.fixture(scope="module")
def world(
    master: EmbeddedMaster, holders, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    made = World(tmp_path_factory.mktemp("sglang"), master, holders("sglang-store").segment)
    try:
        assert made.publish(0) == 1
        made.start()
        yield made
    finally:
        made.close()


def test_loader_reads_the_active_generation_through_sglang(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=1 in this process: SGLang picks our loader, and the module equals SGLang's own
    load of the same checkpoint from disk; fused parameters hold q|k|v and gate|up."""
    for key, value in settings_env(settings_for(world.master, "node-loader")).items():
        monkeypatch.setenv(key, value)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    publish_topology(1, 0)
    model = load_model(world.dirs[0], "mooncake", {"name": MODEL})
    served, name = served_by(model)
    assert (served.generation, served.fence, name) == (1, 1, MODEL)
    assert served.incarnation is not None
    assert mismatched_parameters(model, load_model(world.dirs[0], "auto")) == []
    checkpoint = load_file(str(world.dirs[0] / "model.safetensors"))
    attention = "model.layers.1.self_attn"
    fused = torch.cat([checkpoint[f"{attention}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight, fused)


def test_tp2_ranks_start_from_the_store(world: World) -> None:
    assert world.compare(0) == [[], []]
    status = world.status()
    assert (status["state"], status["generation"], status["model"]) == ("serving", 1, MODEL)


def assert_every_parameter_checked(world: World, result: Any) -> None:
    """The post-landing check compared every parameter of every rank, and all matched."""
    placement = httpx.get(f"{world.url}/mooncake/placement", timeout=30).json()["workers"]
    checks = [result.verified[f"{world.url}/tp{w['tp_rank']}"] for w in placement]
    assert [c["checked"] for c in checks] == [len(w["regions"]) for w in placement]
    assert all(c["unchecked"] == [] and c["mismatched"] == [] for c in checks)


def test_compat_update_reads_each_byte_once(world: World) -> None:
    assert world.publish(1) == 2
    with Coordinator(world.store, [world.url]) as coordinator:
        result = coordinator.update(MODEL, mode="compat", batch_bytes=64 << 10)
    assert world.compare(1) == [[], []]
    model_bytes = (world.dirs[1] / "model.safetensors").stat().st_size
    assert result.store_read_bytes == result.unique_demand_bytes == result.planned_read_bytes
    assert 0.99 * model_bytes < result.store_read_bytes < model_bytes
    # Each tensor is read once by one rank and pushed to the other over TE.
    assert result.pushed_bytes == result.planned_pushed_bytes == result.store_read_bytes
    assert world.backend.events[-3:] == ["drain:abort", "reset_cache", "resume"]
    assert world.status()["generation"] == 2
    assert_every_parameter_checked(world, result)


def test_direct_update_delivers_only_each_ranks_shards(world: World) -> None:
    assert world.publish(2) == 3
    with Coordinator(world.store, [world.url]) as coordinator:
        result = coordinator.update(MODEL, mode="direct", batch_bytes=64 << 10)
    assert world.compare(2) == [[], []]
    placement = httpx.get(f"{world.url}/mooncake/placement", timeout=30).json()["workers"]
    assert [(w["tp_rank"], w["tp_size"]) for w in placement] == [(0, 2), (1, 2)]
    for worker in placement:
        parameter_bytes = sum(r["bytes"] for r in worker["regions"].values())
        assert result.received_bytes[worker["worker_id"]] == parameter_bytes
    assert result.store_read_bytes == result.unique_demand_bytes
    assert world.status()["generation"] == 3
    assert_every_parameter_checked(world, result)


def test_prepare_failure_keeps_the_served_generation(world: World) -> None:
    assert world.publish(3, dtype="bfloat16") == 4
    with (
        Coordinator(world.store, [world.url]) as coordinator,
        pytest.raises(UpdateFailed) as failed,
    ):
        coordinator.update(MODEL, mode="direct", batch_bytes=64 << 10)
    assert "direct mode needs stored dtype bfloat16" in str(failed.value)
    status = world.status()
    assert (status["state"], status["generation"]) == ("serving", 3)
    assert world.compare(2) == [[], []]
