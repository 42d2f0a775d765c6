"""SGLang glue for the shared receiver, on the API process's ``TokenizerManager``.

Pausing to land uses SGLang's own admission gate (``is_pause``) in every mode:

- ``abort`` is ``pause_generation(mode="abort")``: in-flight requests end with finish
  reason ``abort``.
- ``wait`` closes the gate and then takes the weight-update writer lock, which SGLang's
  generate path holds as a reader, so in-flight requests finish on the served generation.
- ``keep`` is ``pause_generation(mode="retract")``: the schedulers move every running
  request back to their waiting queue with its output so far and free its KV. That is the
  one SGLang mode in which the flush at commit succeeds with requests in flight
  (``Scheduler.flush_cache`` ignores the waiting queue while paused, never the running
  batch), and after ``continue_generation`` each request recomputes its prompt and output
  so far on the new weights before its next token. ``in_place`` keeps the running batch
  and its old-weight KV: the flush would fail, and the requests would decode on over KV
  the old weights computed.

Resume is ``continue_generation``; the cache reset is ``flush_cache``; the weight version
is SGLang's own (``update_weight_version``): each scheduler records, for every live
request, how many output tokens the old version produced, and a finished request's
``meta_info["weight_versions"]`` lists ``{"version", "start", "end"}`` spans over its
output tokens. Worker calls travel as one control message type to every scheduler.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import typing
from typing import Any

from sglang.srt.managers.io_struct import (
    ContinueGenerationReqInput,
    PauseGenerationReqInput,
    UpdateWeightVersionReqInput,
)

from engine_ext.backend import WorkerBackend
from engine_ext.rpc import within
from engine_ext.sessions import ReceiverError
from engine_ext.sglang.ipc import MooncakeRLReqInput
from mooncake_rl.protocol import PAUSE_MODES, DrainRequest
from mooncake_rl.settings import Settings

COMMUNICATOR = "mooncake_rl"  # the TokenizerManager attribute is f"{COMMUNICATOR}_communicator"

SGLANG_MODE = {"abort": "abort", "keep": "retract"}
"""Our pause modes SGLang's ``pause_generation`` carries out (``wait`` is ours alone)."""


def pause_modes(sglang_modes: tuple[str, ...]) -> tuple[str, ...]:
    """Our modes, given the modes SGLang's ``PauseGenerationReqInput`` takes."""
    return tuple(m for m in PAUSE_MODES if m not in SGLANG_MODE or SGLANG_MODE[m] in sglang_modes)


def sglang_pause_modes() -> tuple[str, ...]:
    """The modes the installed SGLang's ``PauseGenerationReqInput.mode`` admits."""
    return typing.get_args(typing.get_type_hints(PauseGenerationReqInput).get("mode"))


class SglangBackend(WorkerBackend):
    def __init__(
        self, tokenizer_manager: Any, engine_id: str, rpc_timeout_s: float | None = None
    ) -> None:
        self.tokenizer_manager = tokenizer_manager
        self.engine_id = engine_id
        self.rpc_timeout_s = rpc_timeout_s or Settings().rpc_timeout_s
        self.engine_version = f"sglang {importlib.metadata.version('sglang')}"
        self.pause_modes = pause_modes(sglang_pause_modes())

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
        if mode in SGLANG_MODE:
            await manager.pause_generation(PauseGenerationReqInput(mode=SGLANG_MODE[mode]))
            return
        async with manager.is_pause_cond:
            manager.is_pause = True
        async with manager.model_update_lock.writer_lock:
            pass  # every request admitted before the gate closed has finished

    async def unpause(self) -> None:
        await self.tokenizer_manager.continue_generation(ContinueGenerationReqInput())

    async def reset_cache(self) -> None:
        """``flush_cache``: after a keep pause, the retracted requests wait holding no KV,
        so the flush succeeds and they recompute their prefix on the new weights."""
        result = await self.tokenizer_manager.flush_cache()
        if not result.success:
            raise RuntimeError(f"flush_cache failed: {result.message}")

    async def set_weight_version(self, version: str) -> None:
        """SGLang's ``update_weight_version``: the schedulers close the old version's span
        of every live request (retracted ones included) and tag later tokens ``version``;
        the API process reports it as ``meta_info["weight_version"]``."""
        self.tokenizer_manager.auto_create_handle_loop()
        await self.tokenizer_manager.update_weight_version(
            UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)
        )
