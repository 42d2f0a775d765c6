"""The coordinator's HTTP client: one call, or the same call on many engines at once.

A body (a JSON-able object, or a :class:`Body` with members encoded ahead) is encoded on the
caller's thread, sent from one event loop on a daemon thread, and each engine's JSON reply
comes back, or an :class:`EngineRequestFailed` naming the engine, the route, its status (0:
no reply) and the engine's error code. Idempotent calls (commit, abort, renew) are retried
while no reply comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import aiohttp
import aiohttp.helpers
import httpx
from yarl import URL

from mooncake_rl.errors import InvariantViolation, MooncakeRLError

T = TypeVar("T")
RETRIES = 4
"""Attempts at an idempotent call (commit, abort, renew) whose response never came."""
RETRY_WAIT_S = 0.5


class EngineRequestFailed(MooncakeRLError):
    def __init__(self, url: str, path: str, status: int, body: Any) -> None:
        self.url, self.path, self.status, self.body = url, path, status, body
        code = body.get("error") if isinstance(body, dict) else None
        self.code = code
        detail = body.get("detail") if isinstance(body, dict) else body
        super().__init__(f"{url}{path}: {status} {code}: {detail}")


class EngineClient:
    """Calls on engines' ``/mooncake/*`` routes.

    Its methods are synchronous; every HTTP call runs on one event loop of its own (a
    daemon thread) through aiohttp, so a phase has all its calls in flight at once without
    a thread per call. At 1,000 engines the calls' client CPU is the control plane's cost:
    aiohttp spends less per call than httpx's clients, sync (a thread per call, all queued
    on its pool's lock) or async (its pool rescans every connection on each request).
    """

    def __init__(self, *, token: str | None, timeout_s: float, max_connections: int | None) -> None:
        """``max_connections``: at most this many calls of a phase in flight at once
        (:class:`~mooncake_rl.coordinator.Coordinator`)."""
        if max_connections is not None and max_connections < 1:
            raise MooncakeRLError(f"max_connections must be >= 1, got {max_connections}")
        self._calls = _Bound(max_connections)
        self._renewals = _Bound(max_connections)
        self._loop = _Loop(f"coordinator-{os.getpid()}")
        self._session = self._loop.run(
            _open_session({"authorization": f"Bearer {token}"} if token else {}, timeout_s)
        )
        self._proxies: dict[str, dict[str, Any]] = {}

    def close(self) -> None:
        if not self._loop.closed:
            self._loop.run(self._session.close())
            self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _proxy(self, url: str) -> dict[str, Any]:
        """The environment's proxy for ``url`` (``HTTP(S)_PROXY``, ``NO_PROXY``), looked up
        once per engine: aiohttp's own lookup (``trust_env``) costs two thread hops a call."""
        if url not in self._proxies:
            try:
                proxy, auth = aiohttp.helpers.get_env_proxy_for_url(URL(url))
                self._proxies[url] = {"proxy": proxy, "proxy_auth": auth}
            except LookupError:
                self._proxies[url] = {}
        return self._proxies[url]

    def call(self, url: str, path: str, body: Any) -> dict[str, Any]:
        return self._loop.run(self._request(url, "POST", path, encode_body(body), self._calls))

    def upload(self, url: str, params: Mapping[str, Any], data: bytes) -> dict[str, Any]:
        """A CPU-serialized bucket as the body of ``POST /mooncake/bucket``."""

        async def post() -> dict[str, Any]:
            async with (
                self._calls.slot(),
                self._session.post(
                    f"{url}/mooncake/bucket",
                    params=dict(params),
                    data=data,
                    headers={"content-type": "application/octet-stream"},
                    **self._proxy(url),
                ) as response,
            ):
                return _checked(url, "bucket", response.status, await response.read())

        return self._loop.run(post())

    async def _request(
        self, url: str, method: str, path: str, content: bytes | None, bound: _Bound
    ) -> dict[str, Any]:
        async with (
            bound.slot(),
            self._session.request(
                method,
                f"{url}/mooncake/{path}",
                data=content,
                headers=None if content is None else JSON,
                **self._proxy(url),
            ) as response,
        ):
            return _checked(url, path, response.status, await response.read())

    async def _retrying(
        self, url: str, path: str, content: bytes | None, bound: _Bound
    ) -> dict[str, Any]:
        """An idempotent call, repeated while no response arrives (lost, reset, timed out)."""
        for attempt in range(RETRIES):
            try:
                return await self._request(url, "POST", path, content, bound)
            except TRANSPORT_ERRORS:
                if attempt == RETRIES - 1:
                    raise
                await asyncio.sleep(RETRY_WAIT_S * 2**attempt)
        raise AssertionError("unreachable")

    async def _fan_out(
        self,
        urls: Sequence[str],
        method: str,
        path: str,
        contents: Mapping[str, bytes | None],
        *,
        retry: bool = False,
        bound: _Bound | None = None,
    ) -> dict[str, dict[str, Any] | EngineRequestFailed]:
        """Every engine's call at once on this loop; each engine's reply or failure."""
        kind = bound or self._calls

        async def one(url: str) -> dict[str, Any] | EngineRequestFailed:
            try:
                if retry:
                    return await self._retrying(url, path, contents[url], kind)
                return await self._request(url, method, path, contents[url], kind)
            except EngineRequestFailed as error:
                return error
            except REQUEST_ERRORS as error:
                why = str(error) or type(error).__name__
                return EngineRequestFailed(url, f"/mooncake/{path}", 0, why)

        replies = await asyncio.gather(*(one(url) for url in urls))
        return dict(zip(urls, replies, strict=True))

    def _all(
        self,
        urls: Sequence[str],
        method: str,
        path: str,
        bodies: Mapping[str, Any] | None = None,
        *,
        retry: bool = False,
    ) -> tuple[dict[str, dict[str, Any]], dict[str, EngineRequestFailed]]:
        """The same call on every engine, concurrently; successes and failures by URL.
        Bodies are encoded here, on the caller's thread, so the loop only moves bytes."""
        if not urls:
            return {}, {}
        results = self._loop.run(
            self._fan_out(urls, method, path, _contents(urls, bodies), retry=retry)
        )
        ok = {u: r for u, r in results.items() if not isinstance(r, EngineRequestFailed)}
        failed = {u: r for u, r in results.items() if isinstance(r, EngineRequestFailed)}
        return ok, failed


class _Loop:
    """An event loop on a daemon thread; synchronous code runs coroutines on it."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """``coroutine``'s result, waited for; an interrupt of the waiting thread cancels it."""
        future = self.submit(coroutine)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    @property
    def closed(self) -> bool:
        return self._loop.is_closed()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class _Bound:
    """At most ``limit`` calls in flight, the others queued in order (``None``: no bound)."""

    def __init__(self, limit: int | None) -> None:
        self._semaphore = None if limit is None else asyncio.Semaphore(limit)

    def slot(self) -> AbstractAsyncContextManager[Any]:
        return self._semaphore or contextlib.nullcontext()


JSON = {"content-type": "application/json"}
TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)
"""No whole reply came (refused, reset, cut short, timed out): what a retry can mend."""
REQUEST_ERRORS = (aiohttp.ClientError, TimeoutError)
"""A call that failed without a reply: its engine is reported with status 0 (unreachable)."""


async def _open_session(headers: Mapping[str, str], timeout_s: float) -> aiohttp.ClientSession:
    """The coordinator's HTTP session, opened on its loop (aiohttp binds to the running one).

    A fresh connection per call (``force_close``): an engine's server closes idle keep-alive
    connections on its own clock (uvicorn: 5 s), and a request sent as it closes one is
    reset. No connection bound here: ``_Bound`` bounds calls, per kind, so renewals never
    queue behind a phase's calls. ``timeout_s`` bounds connecting and each wait for bytes.
    TLS trusts httpx's CA set (certifi, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``) as the rest
    of this package's HTTP clients do; proxies come from ``EngineClient._proxy``.
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True, ssl=httpx.create_ssl_context()),
        headers=dict(headers),
        timeout=aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s),
    )


@dataclass(frozen=True)
class Body:
    """A JSON object body, some of whose members are already encoded: a prepare body's
    ``workers`` is encoded before the drain, its session only exists after it."""

    members: Mapping[str, Any]
    encoded: Mapping[str, bytes]

    def __post_init__(self) -> None:
        both = set(self.members) & set(self.encoded)
        if both:
            raise InvariantViolation(f"body members given twice: {sorted(both)}")

    def encode(self) -> bytes:
        pairs = [_json(dict(self.members))[1:-1]]
        pairs += [_json(name) + b":" + value for name, value in self.encoded.items()]
        return b"{" + b",".join(pair for pair in pairs if pair) + b"}"


def _json(value: Any) -> bytes:
    """``value`` as httpx's ``json=`` encodes it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def encode_body(body: Any) -> bytes | None:
    """A request's body: ``None`` sends none."""
    if body is None:
        return None
    return body.encode() if isinstance(body, Body) else _json(body)


def _contents(urls: Sequence[str], bodies: Mapping[str, Any] | None) -> dict[str, bytes | None]:
    """Each engine's encoded body; one body object shared by many engines is encoded once."""
    if bodies is None:
        return dict.fromkeys(urls)
    encoded: dict[int, bytes | None] = {}
    contents = {}
    for url in urls:
        body = bodies[url]
        if id(body) not in encoded:
            encoded[id(body)] = encode_body(body)
        contents[url] = encoded[id(body)]
    return contents


def _checked(url: str, path: str, status: int, data: bytes) -> dict[str, Any]:
    """The reply's JSON; anything but 200 raises with the reply (JSON, else its text)."""
    try:
        payload = json.loads(data)
    except ValueError:
        payload = data.decode("utf-8", errors="replace")
    if status != 200:
        raise EngineRequestFailed(url, f"/mooncake/{path}", status, payload)
    return payload
