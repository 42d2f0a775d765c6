"""vLLM glue for the shared receiver: pause/resume, cache reset, and the one RPC path.

vLLM's endpoint-plugin docs discourage reaching workers through ``collective_rpc``; the
``/mooncake/*`` routes must reach the worker extension anyway, so every worker call goes
through :meth:`VllmBackend._rpc`, which checks each rank's reply (workers never raise).
"""

from __future__ import annotations

from typing import Any

from engine_ext.receiver import ApplyRequest, DrainRequest, PrepareRequest, ReceiverError


class VllmBackend:
    def __init__(self, engine_client: Any, engine_id: str) -> None:
        self.engine_client = engine_client
        self.engine_id = engine_id

    async def _rpc(self, method: str, *args: Any) -> list[dict[str, Any]]:
        replies = await self.engine_client.collective_rpc(method, args=(self.engine_id, *args))
        failed = [r for r in replies if not r.get("ok")]
        if failed:
            raise RuntimeError("; ".join(f"rank {r['rank']}: {r['error']}" for r in failed))
        return replies

    async def served(self) -> tuple[int, str | None]:
        replies = await self.engine_client.collective_rpc("mooncake_status")
        generations = {r.get("generation") for r in replies}
        if len(generations) != 1:
            raise RuntimeError(f"workers disagree on the served generation: {sorted(generations)}")
        return int(generations.pop() or 0), replies[0].get("model_name")

    async def drain(self, request: DrainRequest) -> None:
        await self.engine_client.pause_generation(mode=request.mode, clear_cache=False)

    async def resume(self) -> None:
        await self.engine_client.resume_generation()

    async def placement(self) -> dict[str, Any]:
        return {"workers": await self._rpc("mooncake_describe")}

    async def prepare(self, request: PrepareRequest) -> dict[str, Any]:
        try:
            described = await self._rpc(
                "mooncake_prepare", request.mode, request.generation, request.workers
            )
            await self._rpc("mooncake_promote")
        except RuntimeError as error:
            raise ReceiverError(409, "prepare_failed", str(error)) from error
        return {"workers": described}

    async def apply(self, request: ApplyRequest) -> dict[str, Any]:
        peers = list(request.peers.values())
        return {"workers": await self._rpc("mooncake_apply", request.stage, peers)}

    async def commit(self, generation: int) -> dict[str, Any]:
        committed = await self._rpc("mooncake_commit", generation)
        await self.engine_client.reset_prefix_cache()
        await self.engine_client.resume_generation()
        return {"workers": committed}

    async def abort(self) -> None:
        await self._rpc("mooncake_abort")
