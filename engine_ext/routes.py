"""``/mooncake/*`` HTTP routes, shared by every engine adapter (JSON in, JSON out).

Bodies are validated here rather than by FastAPI so that every failure has the project's
error shape ``{"error": <code>, "detail": <text>}``: 401 for a missing or wrong bearer token
(when one is configured), 409 for a wrong state or a stale generation, 422 for a malformed
body. Nothing is changed by a refused request.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from engine_ext.protocol import (
    ApplyRequest,
    CommitRequest,
    DrainRequest,
    PrepareRequest,
    SessionRequest,
)
from engine_ext.receiver import Receiver, ReceiverError

ReceiverProvider = Callable[[Request], Awaitable[Receiver]]


def error_response(status: int, code: str, detail: str) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status)


def _authorized(request: Request, token: str | None) -> bool:
    if not token:
        return True
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token.encode())


async def _body(request: Request, model: type[BaseModel]) -> BaseModel:
    raw = await request.body()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as error:
        raise ReceiverError(422, "invalid_request", error.json(include_url=False)) from error


def build_router(get_receiver: ReceiverProvider, token: str | None) -> APIRouter:
    """Routes bound to the engine's receiver; ``token`` guards them when set."""
    router = APIRouter(prefix="/mooncake")

    def route(
        method: str,
        path: str,
        model: type[BaseModel] | None,
        action: Callable[[Receiver, Any], Awaitable[dict[str, Any]]],
    ) -> None:
        async def handler(request: Request) -> JSONResponse:
            if not _authorized(request, token):
                return error_response(401, "unauthorized", "missing or invalid bearer token")
            try:
                body = await _body(request, model) if model is not None else None
                receiver = await get_receiver(request)
                return JSONResponse(await action(receiver, body))
            except ReceiverError as error:
                return error_response(error.status, error.code, error.detail)

        router.add_api_route(
            path, handler, methods=[method], name=f"mooncake{path.replace('/', '_')}"
        )

    route("GET", "/status", None, lambda r, _: _status(r))
    route("GET", "/placement", None, lambda r, _: r.placement())
    route("POST", "/drain", DrainRequest, lambda r, b: r.drain(b))
    route("POST", "/renew", SessionRequest, lambda r, b: r.renew(b))
    route("POST", "/prepare", PrepareRequest, lambda r, b: r.prepare(b))
    route("POST", "/apply", ApplyRequest, lambda r, b: r.apply(b))
    route("POST", "/commit", CommitRequest, lambda r, b: r.commit(b))
    route("POST", "/abort", SessionRequest, lambda r, b: r.abort(b))
    route("POST", "/rebuild", None, lambda r, _: r.rebuild())

    async def ready(request: Request) -> JSONResponse:
        """Readiness for routers and orchestrators (no token: it tells only the state)."""
        receiver = await get_receiver(request)
        body = {"ready": receiver.ready, "state": receiver.state.value}
        return JSONResponse(body, status_code=200 if receiver.ready else 503)

    router.add_api_route("/ready", ready, methods=["GET"], name="mooncake_ready")
    return router


async def _status(receiver: Receiver) -> dict[str, Any]:
    return receiver.status()
