"""The ``sglang.srt.plugins`` entry point: everything the adapter adds to SGLang.

SGLang runs :func:`register` in every process (API server, schedulers, detokenizer) before
it starts; ``SGLANG_PLUGINS``, when set, must name ``mooncake``. What it plugs, all without
patching SGLang 0.5.23:

- ``--load-format mooncake``: the CLI choice through ``add_load_format_choices``; an
  AROUND hook on ``LoadConfig._verify_load_format`` turns the value into the loader class,
  which SGLang's ``get_model_loader`` instantiates as it does any loader class.
- the worker channel: one control message type registered with SGLang's IPC codec
  (``hook_custom_types``), answered by every scheduler (an AFTER hook on
  ``Scheduler.init_request_dispatcher``) and awaited through a ``TokenizerManager``
  communicator declared in ``_COMMUNICATOR_SPECS``.
- ``/mooncake/*`` on SGLang's own FastAPI app: a BEFORE hook on ``launch_server`` includes
  the shared router (:func:`engine_ext.routes.build_router`), guarded as
  :func:`sglang_tokens` decides; a refusal raises there, before any scheduler starts.
- ``mooncake_rl_*`` metrics on SGLang's ``/metrics`` (``--enable-metrics``): the same
  lifespan wrapper adds the receiver's figures once SGLang's lifespan mounted that route
  (:meth:`EngineRoutes.with_metrics`).
- serving leases: the same hook exports the engine's id (``MOONCAKE_RL_ENGINE_ID``, else
  ``host:port``) before the schedulers start, so their loader leases under it, and wraps the
  app's lifespan so that, once the server runs, a task continues that lease on whatever
  generation the engine serves (:func:`engine_ext.leases.renew_leases`) and releases it
  when the server stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from engine_ext.leases import export_engine_identity, renew_leases
from engine_ext.loading import LOAD_FORMAT, model_name_from
from engine_ext.receiver import Receiver
from engine_ext.routes import GenerationHeaders, build_router
from engine_ext.security import guard_tokens
from engine_ext.served import weight_version
from engine_ext.sglang.backend import COMMUNICATOR, SglangBackend
from engine_ext.sglang.ipc import MooncakeRLReqInput, MooncakeRLReqOutput
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.settings import Settings

logger = logging.getLogger(__name__)

TARGETS = {
    "load_format": "sglang.srt.configs.load_config.LoadConfig._verify_load_format",
    "dispatch": "sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher",
    "routes": "sglang.srt.entrypoints.http_server.launch_server",
}
DEFAULT_VERSION = "default"
"""SGLang's ``--weight-version`` when none is given."""


def register() -> None:
    """Entry point; SGLang's ``load_plugins`` runs it once per process."""
    from sglang.srt.managers.io_struct import hook_custom_types
    from sglang.srt.managers.tokenizer_control_mixin import _COMMUNICATOR_SPECS
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_load_format_choices

    add_load_format_choices([LOAD_FORMAT])
    hook_custom_types(MooncakeRLReqInput, MooncakeRLReqOutput)
    _COMMUNICATOR_SPECS.append((COMMUNICATOR, MooncakeRLReqOutput))
    HookRegistry.register(TARGETS["load_format"], _verify_load_format, HookType.AROUND)
    HookRegistry.register(TARGETS["dispatch"], _add_dispatch, HookType.AFTER)
    HookRegistry.register(TARGETS["routes"], _attach_routes, HookType.BEFORE)


def _verify_load_format(original: Callable[[Any], None], load_config: Any) -> None:
    if isinstance(load_config.load_format, str) and load_config.load_format == LOAD_FORMAT:
        from engine_ext.sglang.loader import MooncakeModelLoader

        load_config.load_format = MooncakeModelLoader
        return
    original(load_config)


def _add_dispatch(result: None, scheduler: Any) -> None:
    from sglang.utils import TypeBasedDispatcher

    from engine_ext.sglang.worker import handle_request

    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(MooncakeRLReqInput, functools.partial(handle_request, scheduler))]
    )


def _attach_routes(*args: Any, **kwargs: Any) -> None:
    from sglang.srt.entrypoints.http_server import app, get_global_state

    server_args = kwargs["server_args"] if "server_args" in kwargs else args[0]
    settings = Settings()
    tokens = sglang_tokens(server_args, settings)
    routes = EngineRoutes(
        export_engine_identity(server_args.host, server_args.port),
        configured_model(server_args),
        lambda: get_global_state().tokenizer_manager,
    )
    app.include_router(
        build_router(routes.receiver, tokens, max_body_bytes=settings.max_body_bytes)
    )
    app.add_middleware(GenerationHeaders, current=routes.current)
    app.router.lifespan_context = routes.with_leases(
        routes.with_metrics(app.router.lifespan_context)
    )


def sglang_tokens(server_args: Any, settings: Settings) -> tuple[str, ...]:
    """The route tokens (:func:`engine_ext.security.route_tokens`) for SGLang's flags.

    SGLang's ``--api-key`` middleware guards every route, ``/mooncake/*`` included, so a
    different ``MOONCAKE_RL_AUTH_TOKEN`` would leave no header that passes both: refused.
    """
    api_key = server_args.api_key
    secret = settings.auth_token.get_secret_value() if settings.auth_token else None
    if api_key and secret and api_key != secret:
        raise ConfigurationError(
            "SGLang's --api-key guards /mooncake/* as well, so no request could carry both it "
            "and a different MOONCAKE_RL_AUTH_TOKEN: unset MOONCAKE_RL_AUTH_TOKEN (the api key "
            "then guards the routes) or give both the same value"
        )
    return guard_tokens(
        server_args.host,
        settings,
        [api_key] if api_key else [],
        tls=bool(server_args.ssl_certfile),
        log=logger,
    )


def configured_model(server_args: Any) -> str:
    """The Store model name (mooncake load format), else the served name or path."""
    if server_args.load_format == LOAD_FORMAT:
        extra = server_args.model_loader_extra_config
        return model_name_from(json.loads(extra) if isinstance(extra, str) else extra)
    return str(server_args.served_model_name or server_args.model_path)


class EngineRoutes:
    """Builds the engine's receiver on first use, once SGLang's schedulers are up.

    An engine that loaded a Store generation and kept SGLang's default ``--weight-version``
    is tagged with that generation's version then, so the first update's spans name it."""

    def __init__(self, engine_id: str, model: str, tokenizer_manager: Callable[[], Any]) -> None:
        self.engine_id = engine_id
        self.model = model
        self._tokenizer_manager = tokenizer_manager
        self._receiver: Receiver | None = None
        self._lock = asyncio.Lock()

    def current(self) -> Receiver | None:
        """The receiver once built (the response headers' source; they never wait for it)."""
        return self._receiver

    async def receiver(self, request: Request | None = None) -> Receiver:
        async with self._lock:
            if self._receiver is None:
                manager = self._tokenizer_manager()
                backend = SglangBackend(manager, self.engine_id)
                served, loaded_name = await backend.served()
                model = loaded_name or self.model
                if served.generation and manager.config_value("weight_version") == DEFAULT_VERSION:
                    await backend.set_weight_version(weight_version(model, served))
                self._receiver = Receiver(
                    backend, model, served, auto_rebuild=Settings().auto_rebuild
                )
        return self._receiver

    def with_metrics(self, lifespan: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``lifespan`` that adds the receiver's figures to the ``/metrics`` SGLang's own
        lifespan mounts (``--enable-metrics``), once it has."""

        @contextlib.asynccontextmanager
        async def exposed(app: Any) -> AsyncIterator[Any]:
            async with lifespan(app) as state:
                # Only now: SGLang has chosen prometheus_client's mode (engine_ext.metrics).
                from engine_ext.metrics import expose

                expose(app, self.current)
                yield state

        return exposed

    def with_leases(self, lifespan: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``lifespan`` with the serving-lease task running while the server does."""

        @contextlib.asynccontextmanager
        async def leased(app: Any) -> AsyncIterator[Any]:
            async with lifespan(app) as state:
                task = asyncio.create_task(self.hold_lease(Settings()))
                try:
                    yield state
                finally:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

        return leased

    async def hold_lease(self, settings: Settings) -> None:
        """Continue the loader's lease for as long as the engine serves a Store generation."""
        try:
            receiver = await self.receiver()
        except Exception:  # the schedulers never answered: no lease to hold
            logger.warning("mooncake: no served generation, no serving lease", exc_info=True)
            return
        if receiver.generation > 0:  # loaded from the Store (or updated since)
            await renew_leases(receiver, settings, self.engine_id)
