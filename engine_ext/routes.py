"""``/mooncake/*`` HTTP routes, shared by every engine adapter (JSON in, JSON out).

Bodies are validated here rather than by FastAPI so that every failure has the project's
error shape ``{"error": <code>, "detail": <text>}``: 401 for a missing or wrong bearer token
(when one is configured), 409 for a wrong state or a stale generation, 413 for a body over
``max_body_bytes`` (refused before it is parsed, so a client cannot make the engine buffer
unbounded bytes), 422 for a malformed body. Nothing is changed by a refused request.
``POST /mooncake/bucket`` is the one route whose body is not JSON: a CPU-serialized bucket
(safetensors), its session, generation and stage in the query.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from engine_ext.receiver import Receiver
from engine_ext.sessions import ReceiverError
from mooncake_rl.protocol import (
    AdapterRequest,
    ApplyRequest,
    BucketUpload,
    BucketWire,
    CommitRequest,
    DrainRequest,
    PlacementQuery,
    PrepareRequest,
    SessionRequest,
)
from mooncake_rl.transport.buckets import shm_name, write_shm

ReceiverProvider = Callable[[Request], Awaitable[Receiver]]
Q = TypeVar("Q", bound=BaseModel)
GENERATION_HEADER = "x-mooncake-generation"
ENGINE_HEADER = "x-mooncake-engine"


class GenerationHeaders:
    """Tag every response with the generation the engine served when its headers went out
    (``x-mooncake-generation``) and the engine's id (``x-mooncake-engine``), so an RL
    client can tag each sample with its policy version, also behind a router during a
    rolling update. A drain aborts in-flight requests before any weight changes, so a
    response that completes was produced by the generation its header names (a stream
    that is queued while the engine is paused may name the previous one: read the
    engine's ``/mooncake/status`` for it).

    Pure ASGI (no ``BaseHTTPMiddleware``): streaming responses pass through untouched.
    """

    def __init__(self, app: Any, current: Callable[[], Receiver | None]) -> None:
        self.app = app
        self.current = current

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: dict[str, Any]) -> None:
            receiver = self.current()
            if message["type"] == "http.response.start" and receiver is not None:
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", ()),
                        (GENERATION_HEADER.encode(), str(receiver.generation).encode()),
                        (ENGINE_HEADER.encode(), receiver.backend.engine_id.encode()),
                    ],
                }
            await send(message)

        await self.app(scope, receive, tagged)


def error_response(status: int, code: str, detail: str) -> JSONResponse:
    return JSONResponse({"error": code, "detail": detail}, status_code=status)


def _authorized(request: Request, tokens: tuple[str, ...]) -> bool:
    if not tokens:
        return True
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    matches = [hmac.compare_digest(given.encode(), token.encode()) for token in tokens]
    return scheme.lower() == "bearer" and any(matches)


def _too_large(limit: int) -> ReceiverError:
    return ReceiverError(
        413,
        "body_too_large",
        f"request body exceeds {limit} bytes; raise MOONCAKE_RL_MAX_BODY_BYTES on the engine "
        "if a legitimate prepare body is this large",
    )


async def _read(request: Request, limit: int) -> bytes:
    """At most ``limit`` bytes: a declared length is checked first, and the stream is
    counted too, since a chunked body declares none and a declared one can lie."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise _too_large(limit)
    return bytes(raw)


async def _body(request: Request, model: type[BaseModel], limit: int) -> BaseModel:
    raw = await _read(request, limit)
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as error:
        raise ReceiverError(
            422, "invalid_request", error.json(include_url=False, include_input=False)
        ) from error


def _query(request: Request, model: type[Q]) -> Q:
    """A route's query, validated like a body (query values are strings: lax parsing)."""
    try:
        return model.model_validate(dict(request.query_params), strict=False)
    except ValidationError as error:
        raise ReceiverError(
            422, "invalid_request", error.json(include_url=False, include_input=False)
        ) from error


def build_router(
    get_receiver: ReceiverProvider,
    token: str | Sequence[str] | None,
    *,
    max_body_bytes: int,
) -> APIRouter:
    """Routes bound to the engine's receiver.

    ``token``: one bearer token, several (any one passes: vLLM's ``--api-key`` takes a list),
    or ``None``/empty for open routes. ``max_body_bytes``: the largest body a route reads.
    """
    tokens = (token,) if isinstance(token, str) else tuple(token or ())
    tokens = tuple(t for t in tokens if t)
    router = APIRouter(prefix="/mooncake")

    def route(
        method: str,
        path: str,
        model: type[BaseModel] | None,
        action: Callable[[Receiver, Any], Awaitable[dict[str, Any]]],
        query: type[BaseModel] | None = None,
    ) -> None:
        """``model``: the body's; ``query``: the query's, for a route that reads no body."""

        async def handler(request: Request) -> JSONResponse:
            if not _authorized(request, tokens):
                return error_response(401, "unauthorized", "missing or invalid bearer token")
            try:
                if query is not None:
                    body = _query(request, query)
                else:
                    body = None if model is None else await _body(request, model, max_body_bytes)
                receiver = await get_receiver(request)
                return JSONResponse(await action(receiver, body))
            except ReceiverError as error:
                return error_response(error.status, error.code, error.detail)

        router.add_api_route(
            path, handler, methods=[method], name=f"mooncake{path.replace('/', '_')}"
        )

    route("GET", "/status", None, lambda r, _: _status(r))
    route("GET", "/placement", None, lambda r, q: r.placement(q.boxes), query=PlacementQuery)
    route("POST", "/drain", DrainRequest, lambda r, b: r.drain(b))
    route("POST", "/renew", SessionRequest, lambda r, b: r.renew(b))
    route("POST", "/prepare", PrepareRequest, lambda r, b: r.prepare(b))
    route("POST", "/apply", ApplyRequest, lambda r, b: r.apply(b))
    route("POST", "/commit", CommitRequest, lambda r, b: r.commit(b))
    route("POST", "/abort", SessionRequest, lambda r, b: r.abort(b))
    # The contract's name for ending a session without commit (../shared/DESIGN.md): the
    # same call as abort, which also resumes serving.
    route("POST", "/resume", SessionRequest, lambda r, b: r.abort(b))
    route("POST", "/rebuild", None, lambda r, _: r.rebuild())
    route("POST", "/adapter", AdapterRequest, lambda r, b: r.load_adapter(b))

    async def bucket(request: Request) -> JSONResponse:
        """A CPU-serialized bucket as the raw body (the coordinator runs on another host):
        written to a shared-memory file of this host for the workers, then one apply."""
        if not _authorized(request, tokens):
            return error_response(401, "unauthorized", "missing or invalid bearer token")
        try:
            query = _query(request, BucketUpload)
            data = await _read(request, max_body_bytes)
            receiver = await get_receiver(request)
            name = shm_name(uuid.uuid4().hex, query.stage)
            path = await asyncio.to_thread(write_shm, name, data)
            try:
                applied = await receiver.apply(
                    ApplyRequest(
                        session=query.session,
                        generation=query.generation,
                        stage=query.stage,
                        peers={},
                        bucket=BucketWire(shm=name, nbytes=max(1, len(data))),
                    )
                )
            finally:
                path.unlink(missing_ok=True)
            return JSONResponse(applied)
        except ReceiverError as error:
            return error_response(error.status, error.code, error.detail)

    router.add_api_route("/bucket", bucket, methods=["POST"], name="mooncake_bucket")

    async def ready(request: Request) -> JSONResponse:
        """Readiness for routers and orchestrators (no token: it tells only the state)."""
        receiver = await get_receiver(request)
        body = {"ready": receiver.ready, "state": receiver.state.value}
        return JSONResponse(body, status_code=200 if receiver.ready else 503)

    router.add_api_route("/ready", ready, methods=["GET"], name="mooncake_ready")
    return router


async def _status(receiver: Receiver) -> dict[str, Any]:
    return receiver.status()
