"""One small interface over the request routers that sit in front of rollout engines.

The routers' worker APIs differ (pinned and tested: ``vllm-router`` 0.1.17, ``sglang-router``
0.3.2):

- ``vllm-router``: ``GET /list_workers`` -> ``{"urls": [...]}``; ``POST /add_worker?url=``
  returns once the worker is healthy (400 "already exists" for a listed one);
  ``POST /remove_worker?url=`` (idempotent).
- ``sglang-router``: ``GET /workers`` -> ``{"workers": [{"id", "url", "is_healthy"}...]}``;
  ``POST /workers`` with ``{"url"}`` and ``DELETE /workers/{id}`` are queued (202) and take
  effect in the background, so the adapter polls the list until the change shows.

Every method returns only once the router's list shows the change, so a caller that
removed an engine knows no new request will reach it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx

from mooncake_rl.errors import ConfigurationError, MooncakeRLError

RouterKind = Literal["vllm", "sglang"]
KINDS: tuple[RouterKind, ...] = ("vllm", "sglang")
POLL_S = 0.1


class RouterError(MooncakeRLError):
    """The router refused a call, did not answer, or does not speak the expected API."""


def engine_url(url: str) -> str:
    """The form routers list engines in (no trailing slash)."""
    return url.rstrip("/")


@dataclass(frozen=True)
class RouterSpec:
    """Where a router is and which API it speaks."""

    url: str
    kind: RouterKind = "vllm"
    token: str | None = field(default=None, repr=False)  # a secret: never in a message
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigurationError(
                f"router URL {self.url!r} must start with http:// or https:// (--router)"
            )
        if self.kind not in KINDS:
            raise ConfigurationError(
                f"router kind {self.kind!r} is not one of {', '.join(KINDS)} (--router-kind)"
            )
        if not self.timeout_s > 0:
            raise ConfigurationError(f"router timeout must be positive, got {self.timeout_s}")
        object.__setattr__(self, "url", self.url.rstrip("/"))


class Router(Protocol):
    """The four worker operations the bracket needs; each returns once the list shows it."""

    spec: RouterSpec

    def probe(self) -> None:
        """Raise :class:`RouterError` unless the router answers with the expected API."""

    def workers(self) -> list[str]:
        """The engine URLs in rotation."""

    def add(self, engine: str) -> None:
        """Put ``engine`` in rotation (already there is fine)."""

    def remove(self, engine: str) -> None:
        """Take ``engine`` out of rotation (already out is fine)."""

    def close(self) -> None: ...


class _HttpRouter:
    api = ""

    def __init__(self, spec: RouterSpec) -> None:
        self.spec = spec
        headers = {"authorization": f"Bearer {spec.token}"} if spec.token else {}
        self._client = httpx.Client(base_url=spec.url, timeout=spec.timeout_s, headers=headers)

    def close(self) -> None:
        self._client.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._client.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise RouterError(
                f"{self.spec.kind} router at {self.spec.url} did not answer {method} {path}: "
                f"{error!r}; is it running (--router)?"
            ) from error

    def _json(self, path: str) -> Any:
        response = self._send("GET", path)
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code != 200 or not isinstance(body, dict):
            raise RouterError(
                f"{self.spec.url}{path} answered {response.status_code} "
                f"{response.text[:200]!r}: not a {self.api} worker API; is --router-kind "
                f"{self.spec.kind} right (kinds: {', '.join(KINDS)})?"
            )
        return body

    def probe(self) -> None:
        self.workers()

    def workers(self) -> list[str]:
        raise NotImplementedError

    def _until(self, listed: bool, engine: str, what: str) -> None:
        """Poll the list until ``engine`` is (or is not) in it."""
        deadline = time.monotonic() + self.spec.timeout_s
        while (engine in self.workers()) != listed:
            if time.monotonic() >= deadline:
                raise RouterError(
                    f"{self.spec.kind} router at {self.spec.url} accepted {what} {engine} but "
                    f"its list did not show it within {self.spec.timeout_s:g}s"
                )
            time.sleep(POLL_S)

    def _refused(self, what: str, engine: str, response: httpx.Response) -> RouterError:
        return RouterError(
            f"{self.spec.kind} router at {self.spec.url} refused to {what} {engine}: "
            f"{response.status_code} {response.text[:200]!r}"
        )


class VllmRouter(_HttpRouter):
    api = "vllm-router"

    def workers(self) -> list[str]:
        urls = self._json("/list_workers").get("urls")
        if not isinstance(urls, list):
            raise RouterError(f"{self.spec.url}/list_workers has no 'urls' list: not vllm-router")
        return [engine_url(u) for u in urls]

    def add(self, engine: str) -> None:
        engine = engine_url(engine)
        response = self._send("POST", "/add_worker", params={"url": engine})
        if response.status_code != 200 and "already exists" not in response.text:
            raise self._refused("add", engine, response)
        self._until(True, engine, "adding")

    def remove(self, engine: str) -> None:
        engine = engine_url(engine)
        response = self._send("POST", "/remove_worker", params={"url": engine})
        if response.status_code != 200:
            raise self._refused("remove", engine, response)
        self._until(False, engine, "removing")


class SglangRouter(_HttpRouter):
    api = "sglang-router"

    def _listed(self) -> list[dict[str, Any]]:
        rows = self._json("/workers").get("workers")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise RouterError(f"{self.spec.url}/workers has no 'workers' list: not sglang-router")
        return rows

    def workers(self) -> list[str]:
        return [engine_url(str(row.get("url"))) for row in self._listed()]

    def add(self, engine: str) -> None:
        engine = engine_url(engine)
        response = self._send("POST", "/workers", json={"url": engine})
        if response.status_code not in (200, 202):
            raise self._refused("add", engine, response)
        self._until(True, engine, "adding")

    def remove(self, engine: str) -> None:
        engine = engine_url(engine)
        for row in self._listed():
            if engine_url(str(row.get("url"))) == engine:
                response = self._send("DELETE", f"/workers/{row.get('id')}")
                if response.status_code not in (200, 202, 404):
                    raise self._refused("remove", engine, response)
        self._until(False, engine, "removing")


def open_router(spec: RouterSpec) -> Router:
    return VllmRouter(spec) if spec.kind == "vllm" else SglangRouter(spec)
