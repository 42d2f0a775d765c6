"""Status codes for the ``mooncake_store`` backend's refusals on vLLM's native routes.

vLLM answers every error of ``/init_weight_transfer_engine`` ... ``/finish_weight_update``
with 500: its engine core re-raises a worker's exception in the API server as a bare
``Exception`` that keeps only the message (``vllm/v1/engine/core_client.py``), and its
``Exception`` handler answers that with 500. So each refusal's message carries a marker,
``[mooncake_store <status> <code>]``, the one thing that crosses that boundary: a caller
reads the code from vLLM's error body without the middleware below.

:class:`RefusalStatus`, added with vLLM's own flag ``--middleware
engine_ext.vllm.native_errors.RefusalStatus``, answers a marked error on those routes as
the ``/mooncake/*`` routes do: the marker's status with ``{"error": <code>, "detail": ...}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

BACKEND = "mooncake_store"
NATIVE_ROUTES = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/shutdown_weight_transfer_engine",
)
_MARKER = re.compile(rf"\[{BACKEND} ([45]\d\d) ([a-z_]+)\] ")


@dataclass(frozen=True)
class Refusal:
    """A refusal of the backend (nothing changed): its HTTP status and machine code."""

    status: int
    code: str

    def __post_init__(self) -> None:
        if not 400 <= self.status < 500 or not re.fullmatch(r"[a-z_]+", self.code):
            raise ValueError(f"a refusal is a 4xx with a snake_case code, not {self}")

    def marked(self, detail: str) -> str:
        """``detail`` with this refusal's marker in front."""
        return f"[{BACKEND} {self.status} {self.code}] {detail}"


def refusal_in(message: str) -> Refusal | None:
    """The refusal a message is marked with, wherever vLLM's wrapping put it."""
    found = _MARKER.search(message)
    return Refusal(int(found[1]), found[2]) if found else None


class Refused(ValueError):
    """Raised by the backend for a refusal; its message is marked (see the module)."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        self.refusal = Refusal(status, code)
        self.detail = detail
        super().__init__(self.refusal.marked(detail))


class RefusalStatus:
    """ASGI middleware: a marked error raised on a native route becomes its status and the
    project's error body; anything else passes through to vLLM's own handlers.

    Pure ASGI (no ``BaseHTTPMiddleware``): streaming responses elsewhere pass untouched.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith(NATIVE_ROUTES):
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except Exception as error:
            refusal = refusal_in(str(error))
            if refusal is None:
                raise
            body = {"error": refusal.code, "detail": str(error)}
            await JSONResponse(body, status_code=refusal.status)(scope, receive, send)
