"""vLLM plugin entry points.

- ``vllm.general_plugins`` -> :func:`register_load_format` (``--load-format mooncake``).
- ``vllm.endpoint_plugins`` -> :class:`MooncakeEndpointPlugin` (``/mooncake/*`` routes on
  vLLM's own API server). Endpoint plugins load only when ``VLLM_PLUGINS`` names them, and
  that variable then filters general plugins too: set ``VLLM_PLUGINS=mooncake``, which
  names both.
"""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace
from typing import Any

from fastapi import FastAPI, Request

from engine_ext.leases import engine_identity, renew_leases
from engine_ext.receiver import Receiver
from engine_ext.routes import build_router
from engine_ext.vllm.backend import VllmBackend
from mooncake_rl.settings import Settings


def register_load_format() -> None:
    from engine_ext.vllm.loader import register

    register()


class MooncakeEndpointPlugin:
    name = "mooncake"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self._receiver: Receiver | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    def attach_router(self, app: FastAPI) -> None:
        token = Settings().auth_token
        app.include_router(
            build_router(self._get_receiver, token.get_secret_value() if token else None)
        )

    async def _get_receiver(self, request: Request) -> Receiver:
        await self._ready.wait()
        assert self._receiver is not None
        return self._receiver

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        # The id the loader leased under (MOONCAKE_RL_ENGINE_ID, else host:port): the
        # renewal task continues that lease rather than taking a second one.
        engine_id = engine_identity(args.host, args.port)
        backend = VllmBackend(engine_client, engine_id)
        served, loaded_name = await backend.served()
        extra = getattr(args, "model_loader_extra_config", None) or {}
        if isinstance(extra, str):
            extra = json.loads(extra)
        model = loaded_name or extra.get("name") or (args.served_model_name or [args.model])[0]
        self._receiver = Receiver(backend, str(model), served, auto_rebuild=Settings().auto_rebuild)
        self._ready.set()
        if served.generation > 0:  # served from the Store: keep the lease the loader took
            self._lease_task = asyncio.create_task(renew_leases(self._receiver, Settings()))
