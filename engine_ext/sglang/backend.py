"""SGLang glue for the shared receiver, on the API process's ``TokenizerManager``.

Drain uses SGLang's own admission gate: ``abort`` is ``pause_generation(mode="abort")``;
``wait`` closes the same gate (``is_pause``) and then takes the weight-update writer lock,
which SGLang's generate path holds as a reader, so in-flight requests finish on the served
generation. Resume is ``continue_generation``; the cache reset is ``flush_cache``. Worker
calls travel as one control message type to every scheduler (TP rank).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

from engine_ext.backend import WorkerBackend
from engine_ext.receiver import ReceiverError
from engine_ext.rpc import within
from engine_ext.sglang.ipc import MooncakeRLReqInput
from mooncake_rl.protocol import DrainRequest
from mooncake_rl.settings import Settings

COMMUNICATOR = "mooncake_rl"  # the TokenizerManager attribute is f"{COMMUNICATOR}_communicator"


class SglangBackend(WorkerBackend):
    def __init__(
        self, tokenizer_manager: Any, engine_id: str, rpc_timeout_s: float | None = None
    ) -> None:
        self.tokenizer_manager = tokenizer_manager
        self.engine_id = engine_id
        self.rpc_timeout_s = rpc_timeout_s or Settings().rpc_timeout_s

    async def call_workers(self, method: str, *args: Any) -> list[dict[str, Any]]:
        """Every scheduler's replies, within ``rpc_timeout_s`` (SGLang's communicator has
        no deadline of its own; a timed-out call releases it for the next one)."""
        manager = self.tokenizer_manager
        manager.auto_create_handle_loop()
        communicator = getattr(manager, f"{COMMUNICATOR}_communicator")
        request = MooncakeRLReqInput(engine_id=self.engine_id, method=method, args=json.dumps(args))
        outputs = await within(communicator(request), method, self.rpc_timeout_s)
        return [reply for output in outputs for reply in json.loads(output.replies)]

    async def paused(self) -> bool:
        return bool(self.tokenizer_manager.is_pause)

    async def pause(self, request: DrainRequest) -> None:
        try:
            await asyncio.wait_for(self._pause(request.mode), request.timeout_s)
        except TimeoutError as error:
            await self.resume()
            raise ReceiverError(
                409, "drain_timeout", f"in-flight requests outlived {request.timeout_s}s"
            ) from error

    async def _pause(self, mode: str) -> None:
        manager = self.tokenizer_manager
        if mode == "abort":
            await manager.pause_generation(PauseGenerationReqInput(mode="abort"))
            return
        async with manager.is_pause_cond:
            manager.is_pause = True
        async with manager.model_update_lock.writer_lock:
            pass  # every request admitted before the gate closed has finished

    async def unpause(self) -> None:
        await self.tokenizer_manager.continue_generation(ContinueGenerationReqInput())

    async def reset_cache(self) -> None:
        result = await self.tokenizer_manager.flush_cache()
        if not result.success:
            raise RuntimeError(f"flush_cache failed: {result.message}")
