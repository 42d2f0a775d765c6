"""vLLM plugin entry points.

- ``vllm.general_plugins`` -> :func:`register_load_format` (``--load-format mooncake``, and
  the ``mooncake_store`` backend of vLLM's native weight-transfer API:
  :func:`register_weight_transfer`).
- ``vllm.endpoint_plugins`` -> :class:`MooncakeEndpointPlugin` (``/mooncake/*`` routes on
  vLLM's own API server). Endpoint plugins load only when ``VLLM_PLUGINS`` names them, and
  that variable then filters general plugins too: set ``VLLM_PLUGINS=mooncake``, which
  names both.

The endpoint plugin refuses to start a server it cannot serve safely (see
:meth:`MooncakeEndpointPlugin.attach_router`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
from argparse import Namespace
from typing import Any

from fastapi import FastAPI, Request

from engine_ext.leases import engine_identity, renew_leases
from engine_ext.receiver import Receiver
from engine_ext.routes import GenerationHeaders, build_router
from engine_ext.security import guard_tokens
from engine_ext.served import weight_version
from engine_ext.sessions import ReceiverError
from engine_ext.vllm.backend import VllmBackend
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.settings import Settings

EXTENSION_FLAG = "--worker-extension-cls mooncake_rl.Ext"
# Under vLLM's own logger: its handler prints this, while a record that reaches the root
# logger in vLLM's API server was seen to print nothing.
logger = logging.getLogger("vllm.mooncake_rl")


def register_load_format() -> None:
    from engine_ext.vllm.loader import register

    register()
    register_weight_transfer()


def register_weight_transfer() -> None:
    """``--weight-transfer-config '{"backend": "mooncake_store"}'`` and its trainer engine
    (:mod:`engine_ext.vllm.weight_transfer`), imported only when selected. Idempotent; a
    trainer that does not run vLLM's plugin loader calls it before the trainer factory."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    module = "engine_ext.vllm.weight_transfer"
    for factory, name in (
        (WeightTransferEngineFactory, "MooncakeStoreWeightTransferEngine"),
        (WeightTransferTrainerFactory, "MooncakeStoreTrainerEngine"),
    ):
        if "mooncake_store" not in factory._registry:  # register_engine refuses a second one
            factory.register_engine("mooncake_store", module, name)


class MooncakeEndpointPlugin:
    name = "mooncake"
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self._receiver: Receiver | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    def attach_router(self, app: FastAPI) -> None:
        """Check the launch, then add the routes; a refusal stops the server's startup.

        vLLM calls this once the engine is up and before ``init_state`` reaches a worker,
        with the parsed flags in ``app.state.args``.
        """
        args = app.state.args
        require_worker_extension(args.worker_extension_cls)
        log_through_vllm()
        settings = Settings()
        # --uds serves a Unix socket instead of --host: reachable from this host only.
        tokens = guard_tokens(
            "localhost" if args.uds else args.host,
            settings,
            vllm_api_keys(args),
            tls=bool(args.ssl_certfile),
            log=logger,
        )
        app.include_router(
            build_router(self._get_receiver, tokens, max_body_bytes=settings.max_body_bytes)
        )
        app.add_middleware(GenerationHeaders, current=lambda: self._receiver)
        from engine_ext.metrics import expose  # the server runs (see engine_ext.metrics)

        expose(app, lambda: self._receiver)

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
        if served.generation > 0:  # loaded from the Store: tag its tokens from the first
            await backend.set_weight_version(weight_version(str(model), served))
        if extra.get("lora"):
            await self._keep_adapters(backend, state, args, extra, str(model))
        self._ready.set()
        if served.generation > 0:  # served from the Store: keep the lease the loader took
            self._lease_task = asyncio.create_task(renew_leases(self._receiver, Settings()))

    async def _keep_adapters(
        self, backend: VllmBackend, state: Any, args: Namespace, extra: dict[str, Any], base: str
    ) -> None:
        """``"lora": POLICY`` (and ``"lora_versions": K``, default 1) in the loader's extra
        config: keep the newest K generations of adapter POLICY resident, starting from the
        Store's active one. The LoRA cache must hold K + 1 (the next loads before the
        oldest goes), all pinned."""
        from engine_ext.lora import ResidentAdapters
        from engine_ext.vllm.lora import VllmAdapterNames

        assert self._receiver is not None
        policy, versions = str(extra["lora"]), int(extra.get("lora_versions", 1))
        capacity = getattr(args, "max_cpu_loras", None) or getattr(args, "max_loras", 1)
        if not getattr(args, "enable_lora", False) or capacity < versions + 1:
            raise ConfigurationError(
                f'"lora": {policy!r} with "lora_versions": {versions} needs --enable-lora and '
                f"--max-cpu-loras of at least {versions + 1} (the next adapter loads before "
                f"the oldest is evicted, all pinned); got {capacity}"
            )
        names = VllmAdapterNames(state.openai_serving_models, policy, base)
        adapters = self._receiver.adapters = ResidentAdapters(backend, policy, versions, names)
        try:
            loaded = await adapters.load()
        except ReceiverError as error:  # none published yet: the first update loads one
            logger.warning("mooncake: no adapter of %s loaded at start: %s", policy, error.detail)
        else:
            logger.info("mooncake: adapter %s generation %s resident", policy, loaded["generation"])


def log_through_vllm() -> None:
    """Print the adapter's own records (session expiry, rebuilds) with vLLM's handlers: in
    vLLM's API server a record that reaches the root logger prints nothing."""
    ours = logging.getLogger("engine_ext")
    if not ours.handlers:
        for handler in logging.getLogger("vllm").handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


def require_worker_extension(qualname: str | None) -> None:
    """Refuse a server whose workers lack the Mooncake extension.

    Without it the engine would serve but could never be updated: every ``/mooncake/*``
    call fails, and an RL engine that cannot be updated silently serves a stale policy.
    """
    if not qualname:
        raise ConfigurationError(
            f"VLLM_PLUGINS=mooncake needs the worker extension: add {EXTENSION_FLAG} "
            "(without it the engine serves but can never be updated: a stale policy)"
        )
    from engine_ext.vllm.worker import MooncakeWorkerExtension

    module, _, name = qualname.rpartition(".")
    extension = getattr(importlib.import_module(module), name, None) if module else None
    if not (isinstance(extension, type) and issubclass(extension, MooncakeWorkerExtension)):
        raise ConfigurationError(
            f"--worker-extension-cls {qualname} is not the Mooncake worker extension; "
            f"use {EXTENSION_FLAG} (or a subclass of it)"
        )


def vllm_api_keys(args: Namespace) -> list[str]:
    """The keys vLLM itself takes on ``/v1``: ``--api-key`` (a list), else ``VLLM_API_KEY``."""
    import vllm.envs as envs

    return [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]
