"""The shared /mooncake/* protocol: state machine, fences and error shapes over real HTTP.

The backend here is a recording stand-in for *our own* engine-glue protocol (the piece the
vLLM and SGLang adapters implement); the engines themselves are exercised end to end in the
vLLM tests. ``tests/sglang/test_receiver_routes.py`` reruns every scenario through the
SGLang glue by overriding the ``make_engine`` fixture.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from engine_ext.receiver import (
    ApplyRequest,
    DrainRequest,
    PrepareRequest,
    Receiver,
    ServedRecord,
)
from engine_ext.routes import ReceiverProvider, build_router
from mooncake_rl.settings import Settings

DIGEST = "ab" * 32


class RecordingBackend:
    engine_id = "engine-under-test"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail_on: set[str] = set()

    async def _step(self, name: str) -> dict[str, Any]:
        self.calls.append(name)
        if name in self.fail_on:
            raise RuntimeError(f"{name} exploded")
        return {}

    async def drain(self, request: DrainRequest) -> None:
        await self._step(f"drain:{request.mode}")

    async def resume(self) -> None:
        await self._step("resume")

    async def placement(self) -> dict[str, Any]:
        return {"workers": [{"worker_id": "w0"}]}

    async def prepare(self, request: PrepareRequest) -> dict[str, Any]:
        return await self._step(f"prepare:{request.generation}")

    async def apply(self, request: ApplyRequest) -> dict[str, Any]:
        return await self._step(f"apply:{request.generation}:{request.stage}")

    async def commit(self, generation: int) -> dict[str, Any]:
        return await self._step(f"commit:{generation}")

    async def abort(self) -> None:
        await self._step("abort")


# (receiver provider for the router, recorder with ``calls``/``fail_on``, the receiver)
Engine = tuple[ReceiverProvider, Any, Receiver]


@pytest.fixture
def make_engine() -> Callable[[], Awaitable[Engine]]:
    async def make() -> Engine:
        backend = RecordingBackend()
        receiver = Receiver(backend, "m", ServedRecord(1))

        async def get_receiver(request: Any) -> Receiver:
            return receiver

        return get_receiver, backend, receiver

    return make


@pytest.fixture
def make_client(make_engine: Callable[[], Awaitable[Engine]]) -> Callable[..., Awaitable[Any]]:
    async def make(token: str | None = None) -> tuple[httpx.AsyncClient, Any, Receiver]:
        get_receiver, recorder, receiver = await make_engine()
        app = FastAPI()
        app.include_router(
            build_router(get_receiver, token, max_body_bytes=Settings().max_body_bytes)
        )
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")
        return client, recorder, receiver

    return make


def prepare_body(generation: int = 2) -> dict[str, Any]:
    return {
        "model": "m",
        "generation": generation,
        "manifest_digest": DIGEST,
        "mode": "compat",
        "workers": {},
    }


async def test_full_update_cycle(make_client) -> None:
    client, backend, _ = await make_client()
    async with client:
        assert (await client.get("/mooncake/status")).json()["state"] == "serving"
        assert (await client.post("/mooncake/drain", json={"mode": "wait"})).json()[
            "state"
        ] == "drained"
        assert (await client.post("/mooncake/prepare", json=prepare_body())).json()[
            "pending_generation"
        ] == 2
        for stage in (0, 1):
            response = await client.post(
                "/mooncake/apply", json={"generation": 2, "stage": stage, "peers": {}}
            )
            assert response.json()["state"] == "applied"
        status = (await client.post("/mooncake/commit", json={"generation": 2})).json()
        assert (status["state"], status["generation"], status["pending_generation"]) == (
            "serving",
            2,
            None,
        )
    assert backend.calls == ["drain:wait", "prepare:2", "apply:2:0", "apply:2:1", "commit:2"]


@pytest.mark.parametrize(
    "steps,expected_status,expected_error",
    [
        (
            [("post", "/mooncake/apply", {"generation": 2, "stage": 0, "peers": {}})],
            409,
            "wrong_state",
        ),
        ([("post", "/mooncake/prepare", prepare_body())], 409, "wrong_state"),
        ([("post", "/mooncake/commit", {"generation": 2})], 409, "wrong_state"),
        (
            [("post", "/mooncake/drain", {}), ("post", "/mooncake/prepare", prepare_body(1))],
            409,
            "stale_generation",
        ),
        (
            [
                ("post", "/mooncake/drain", {}),
                ("post", "/mooncake/prepare", prepare_body(3)),
                ("post", "/mooncake/apply", {"generation": 4, "stage": 0, "peers": {}}),
            ],
            409,
            "generation_mismatch",
        ),
        ([("post", "/mooncake/drain", {"mode": "sideways"})], 422, "invalid_request"),
        ([("post", "/mooncake/drain", {"unknown": 1})], 422, "invalid_request"),
        (
            [
                ("post", "/mooncake/drain", {}),
                ("post", "/mooncake/prepare", {**prepare_body(), "generation": -1}),
            ],
            422,
            "invalid_request",
        ),
        (
            [
                ("post", "/mooncake/drain", {}),
                ("post", "/mooncake/prepare", {**prepare_body(), "incarnation": "../etc"}),
            ],
            422,
            "invalid_request",
        ),
        (
            [
                ("post", "/mooncake/drain", {}),
                ("post", "/mooncake/prepare", {**prepare_body(), "fence": 10**18}),
            ],
            422,
            "invalid_request",
        ),
    ],
)
async def test_bad_requests_are_refused_and_change_nothing(
    make_client, steps: list, expected_status: int, expected_error: str
) -> None:
    client, backend, receiver = await make_client()
    async with client:
        *setup, (method, path, body) = steps
        for m, p, b in setup:
            assert (await client.request(m.upper(), p, json=b)).status_code == 200
        before = (receiver.state, receiver.generation, receiver.pending, list(backend.calls))
        response = await client.request(method.upper(), path, json=body)
        assert response.status_code == expected_status
        assert response.json()["error"] == expected_error and response.json()["detail"]
        assert (receiver.state, receiver.generation, receiver.pending, backend.calls) == before


async def test_malformed_json_is_422(make_client) -> None:
    client, _, receiver = await make_client()
    async with client:
        response = await client.post(
            "/mooncake/drain", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert response.status_code == 422 and response.json()["error"] == "invalid_request"
    assert receiver.state.value == "serving"


async def test_token_guards_every_route(make_client) -> None:
    client, backend, _ = await make_client(token="s3cret")
    async with client:
        for method, path in [
            ("GET", "/mooncake/status"),
            ("POST", "/mooncake/drain"),
            ("POST", "/mooncake/resume"),
        ]:
            response = await client.request(method, path, json={})
            assert response.status_code == 401 and response.json()["error"] == "unauthorized"
            wrong = await client.request(
                method, path, json={}, headers={"authorization": "Bearer nope"}
            )
            assert wrong.status_code == 401
        ok = await client.get("/mooncake/status", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    assert backend.calls == []


async def test_prepare_failure_resumes_old_generation(make_client) -> None:
    client, backend, receiver = await make_client()
    backend.fail_on.add("prepare:2")
    async with client:
        await client.post("/mooncake/drain", json={})
        response = await client.post("/mooncake/prepare", json=prepare_body())
        assert response.status_code == 409 and response.json()["error"] == "prepare_failed"
        assert "prepare:2 exploded" in response.json()["detail"]
        assert receiver.state.value == "drained"
        assert (
            await client.post("/mooncake/resume")
        ).json() | {} and receiver.state.value == "serving"
    assert receiver.generation == 1
    assert backend.calls == ["drain:abort", "prepare:2", "abort", "resume"]


async def test_apply_failure_breaks_the_engine_for_rebuild(make_client) -> None:
    client, backend, _ = await make_client()
    backend.fail_on.add("apply:2:0")
    async with client:
        await client.post("/mooncake/drain", json={})
        await client.post("/mooncake/prepare", json=prepare_body())
        response = await client.post(
            "/mooncake/apply", json={"generation": 2, "stage": 0, "peers": {}}
        )
        assert response.status_code == 500 and response.json()["error"] == "apply_failed"
        for path in ("/mooncake/resume", "/mooncake/commit"):
            refused = await client.post(path, json={"generation": 2})
            assert refused.status_code == 409 and refused.json()["error"] == "wrong_state"
        status = (await client.get("/mooncake/status")).json()
    assert status["state"] == "broken" and status["generation"] == 1
    assert "apply failed" in status["last_error"]


async def test_abort_after_apply_never_serves_again(make_client) -> None:
    client, _, receiver = await make_client()
    async with client:
        await client.post("/mooncake/drain", json={})
        await client.post("/mooncake/prepare", json=prepare_body())
        await client.post("/mooncake/apply", json={"generation": 2, "stage": 0, "peers": {}})
        assert (await client.post("/mooncake/abort")).json()["state"] == "broken"
        assert (await client.post("/mooncake/resume")).status_code == 409
    assert receiver.generation == 1
