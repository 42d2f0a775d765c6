"""The shared /mooncake/* protocol: state machine, fences and error shapes over real HTTP.

The backend here is a recording stand-in for *our own* engine-glue protocol (the piece the
vLLM and SGLang adapters implement); the engines themselves are exercised end to end in the
vLLM tests. ``tests/sglang/test_receiver_routes.py`` reruns every scenario through the
SGLang glue by overriding the ``make_engine`` fixture.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, make_asgi_app
from prometheus_client.parser import text_string_to_metric_families

from engine_ext.metrics import STATES, expose
from engine_ext.receiver import Receiver, ReceiverError, ServedRecord
from engine_ext.routes import ReceiverProvider, build_router
from mooncake_rl.protocol import ApplyRequest, DrainRequest, PrepareRequest
from mooncake_rl.settings import Settings
from mooncake_rl.transport.buckets import SHM_DIR

DIGEST = "ab" * 32
READ, PUSHED, STAGED = 1000, 300, 2048
"""What each stand-in apply stage reads and pushes, and what each prepare stages."""


class RecordingBackend:
    engine_id = "engine-under-test"
    engine_version = "recording 1.0"
    pause_modes = ("abort", "wait", "keep")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail_on: set[str] = set()
        self.refuse_on: set[str] = set()
        self.time_out_on: set[str] = set()
        self.in_place_bytes = 0  # what prepare says it received into live parameters
        self.weight_versions: list[str] = []  # what each commit tagged tokens with

    async def _step(self, name: str) -> dict[str, Any]:
        self.calls.append(name)
        if name in self.fail_on:
            raise RuntimeError(f"{name} exploded")
        if name in self.refuse_on:  # as WorkerBackend reports every rank's refusal
            raise ReceiverError(409, "stages_incomplete", f"{name} refused by every rank")
        if name in self.time_out_on:  # as engine_ext.rpc.within reports a hung rank
            raise TimeoutError(f"worker call {name!r} got no reply within 1s")
        return {}

    async def drain(self, request: DrainRequest) -> None:
        await self._step(f"drain:{request.mode}")

    async def resume(self) -> None:
        await self._step("resume")

    async def placement(self, boxes: bool = True) -> dict[str, Any]:
        await self._step(f"placement:{boxes}")
        return {"workers": [{"worker_id": "w0"}]}

    async def prepare(self, request: PrepareRequest) -> dict[str, Any]:
        await self._step(f"prepare:{request.generation}")
        return {"in_place_bytes": self.in_place_bytes, "staged_bytes": STAGED}

    async def apply(self, request: ApplyRequest) -> dict[str, Any]:
        await self._step(f"apply:{request.generation}:{request.stage}")
        return {"workers": [{"store_read_bytes": READ, "pushed_bytes": PUSHED}]}

    async def expect(self, generation: int) -> dict[str, Any]:
        await self._step(f"expect:{generation}")
        return {"seconds": 0.0}

    async def commit(self, generation: int, weight_version: str) -> dict[str, Any]:
        self.weight_versions.append(weight_version)
        return await self._step(f"commit:{generation}")

    async def abort(self) -> None:
        await self._step("abort")

    async def rebuild(self, model: str) -> ServedRecord:
        await self._step(f"rebuild:{model}")
        return ServedRecord(7, 7, "ab" * 8)


# (receiver provider for the router, recorder with ``calls``/``fail_on``, the receiver)
Engine = tuple[ReceiverProvider, Any, Receiver]


@pytest.fixture
def make_engine() -> Callable[..., Awaitable[Engine]]:
    async def make(auto_rebuild: bool = True) -> Engine:
        backend = RecordingBackend()
        receiver = Receiver(backend, "m", ServedRecord(1), auto_rebuild=auto_rebuild)

        async def get_receiver(request: Any) -> Receiver:
            return receiver

        return get_receiver, backend, receiver

    return make


@pytest.fixture
def make_client(make_engine: Callable[..., Awaitable[Engine]]) -> Callable[..., Awaitable[Any]]:
    async def make(
        token: str | None = None, auto_rebuild: bool = True
    ) -> tuple[httpx.AsyncClient, Any, Receiver]:
        get_receiver, recorder, receiver = await make_engine(auto_rebuild)
        app = FastAPI()
        app.include_router(
            build_router(get_receiver, token, max_body_bytes=Settings().max_body_bytes)
        )
        registry = CollectorRegistry()  # the engine's own /metrics, as vLLM's single server
        app.mount("/metrics", make_asgi_app(registry=registry))
        assert expose(app, lambda: receiver, registry)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")
        return client, recorder, receiver

    return make


S1, S2 = "1" * 32, "2" * 32


def drain_body(session: str = S1, **extra: Any) -> dict[str, Any]:
    return {"session": session, "holder": "coordinator-a", "ttl_s": 30, **extra}


def target(generation: int = 2, **extra: Any) -> dict[str, Any]:
    """The record a drain names (the engine under test serves generation 1 of "m")."""
    return {"model": "m", "generation": generation, **extra}


def prepare_body(generation: int = 2, stages: int = 2, session: str = S1) -> dict[str, Any]:
    return {
        "session": session,
        "model": "m",
        "generation": generation,
        "manifest_digest": DIGEST,
        "mode": "compat",
        "stages": stages,
        "workers": {},
    }


def apply_body(stage: int, generation: int = 2, session: str = S1) -> dict[str, Any]:
    return {"session": session, "generation": generation, "stage": stage, "peers": {}}


def commit_body(generation: int = 2, session: str = S1) -> dict[str, Any]:
    return {"session": session, "generation": generation}


async def run_steps(client: httpx.AsyncClient, steps: list[tuple[str, dict[str, Any]]]) -> None:
    for path, body in steps:
        response = await client.post(f"/mooncake/{path}", json=body)
        assert response.status_code == 200, (path, response.json())


async def serving_again(receiver: Receiver, within_s: float = 5) -> None:
    """Wait for the receiver to serve by itself (a lease expiry, a rebuild)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while receiver.state.value != "serving":
        assert asyncio.get_running_loop().time() < deadline, receiver.status()
        await asyncio.sleep(0.05)


UPDATE = [("drain", drain_body()), ("prepare", prepare_body())]
APPLIED = [*UPDATE, ("apply", apply_body(0)), ("apply", apply_body(1))]


async def test_full_update_cycle(make_client) -> None:
    client, backend, _ = await make_client()
    async with client:
        status = (await client.get("/mooncake/status")).json()
        assert (status["state"], status["ready"], status["session"]) == ("serving", True, None)
        drain = drain_body(mode="wait", target=target(2))  # newer than the served 1: drains
        drained = (await client.post("/mooncake/drain", json=drain)).json()
        # The session is open, the engine still serves: nothing paused yet.
        assert (drained["state"], drained["ready"], drained["paused"]) == ("open", True, False)
        assert (drained["session"]["id"], drained["session"]["holder"]) == (S1, "coordinator-a")
        prepared = (await client.post("/mooncake/prepare", json=prepare_body())).json()
        assert prepared["pending_generation"] == 2 and prepared["session"]["stages"] == 2
        for stage in (0, 1):
            response = (await client.post("/mooncake/apply", json=apply_body(stage))).json()
            assert (response["state"], response["ready"], response["paused"]) == (
                "applied",
                True,
                False,
            )
        assert backend.calls == ["prepare:2", "apply:2:0", "apply:2:1"]  # never paused
        status = (await client.post("/mooncake/commit", json=commit_body())).json()
    assert (status["state"], status["generation"], status["pending_generation"]) == (
        "serving",
        2,
        None,
    )
    assert status["session"] is None
    assert status["last_session"] == {
        "id": S1,
        "holder": "coordinator-a",
        "outcome": "committed",
        "generation": 2,
    }
    # It paused (in the session's mode) only to land, and tagged tokens with the new record.
    # The check's reference is built while it still serves.
    assert backend.calls == [
        "prepare:2",
        "apply:2:0",
        "apply:2:1",
        "expect:2",
        "drain:wait",
        "commit:2",
    ]
    assert backend.weight_versions == ["m:-:2"]
    assert status["landing"]["pause_s"] >= 0


@pytest.mark.parametrize(
    "setup,path,body,expected_status,expected_error",
    [
        ([], "apply", apply_body(0), 409, "no_session"),
        ([], "prepare", prepare_body(), 409, "no_session"),
        ([], "adapter", {}, 409, "lora_disabled"),  # started without "lora"
        ([], "adapter", {"generation": 0}, 422, "invalid_request"),
        ([], "adapter", {"generation": "latest"}, 422, "invalid_request"),
        ([], "adapter", {"generation": 2, "model": "other"}, 422, "invalid_request"),
        (
            UPDATE[:1],
            "prepare",
            {**prepare_body(), "delta": {"base": 1}, "mode": "compat"},
            422,
            "invalid_request",
        ),
        # An adapter generation: no slices, no stages; only on an engine keeping adapters.
        (
            UPDATE[:1],
            "prepare",
            {**prepare_body(), "adapter": True, "stages": 1},
            422,
            "invalid_request",
        ),
        (
            UPDATE[:1],
            "prepare",
            {**prepare_body(), "adapter": True, "stages": 0, "workers": {}},
            409,
            "lora_disabled",
        ),
        ([], "commit", commit_body(), 409, "no_session"),
        ([], "renew", {"session": S1}, 409, "no_session"),
        ([("drain", drain_body())], "prepare", prepare_body(1), 409, "stale_generation"),
        ([("drain", drain_body())], "apply", apply_body(0), 409, "wrong_state"),
        (UPDATE, "apply", apply_body(0, generation=4), 409, "generation_mismatch"),
        (UPDATE, "apply", apply_body(1), 409, "stage_out_of_order"),
        (UPDATE, "apply", apply_body(2), 422, "stage_out_of_range"),
        (UPDATE, "commit", commit_body(), 409, "wrong_state"),
        ([*UPDATE, ("apply", apply_body(0))], "commit", commit_body(), 409, "stages_incomplete"),
        # Another session: refused, naming the holder; nothing it sends changes anything.
        ([("drain", drain_body())], "drain", drain_body(S2), 409, "session_held"),
        # A drain naming a record the engine already serves (a rival got there after this
        # coordinator's survey), or another model's: refused before the engine pauses.
        ([], "drain", drain_body(target=target(1)), 409, "stale_generation"),
        ([], "drain", drain_body(target=target(2, model="other")), 409, "wrong_model"),
        (UPDATE, "prepare", prepare_body(session=S2), 409, "session_held"),
        (UPDATE, "apply", apply_body(0, session=S2), 409, "session_held"),
        (APPLIED, "commit", commit_body(session=S2), 409, "session_held"),
        (APPLIED, "abort", {"session": S2}, 409, "session_held"),
        (APPLIED, "renew", {"session": S2}, 409, "session_held"),
        # Malformed: every field is typed and bounded.
        ([], "drain", drain_body(mode="sideways"), 422, "invalid_request"),
        ([], "drain", {"unknown": 1, **drain_body()}, 422, "invalid_request"),
        ([], "drain", drain_body(session="not-hex"), 422, "invalid_request"),
        ([], "drain", drain_body(ttl_s=10**9), 422, "invalid_request"),
        ([], "drain", {"session": S1}, 422, "invalid_request"),
        ([], "drain", drain_body(target=target(2, fence=-1)), 422, "invalid_request"),
        ([], "drain", drain_body(target=target(2, incarnation="../etc")), 422, "invalid_request"),
        ([], "drain", drain_body(target={"generation": 2}), 422, "invalid_request"),
        (
            [("drain", drain_body())],
            "prepare",
            {**prepare_body(), "generation": -1},
            422,
            "invalid_request",
        ),
        (
            [("drain", drain_body())],
            "prepare",
            {**prepare_body(), "generation": 10**18},
            422,
            "invalid_request",
        ),
        (
            [("drain", drain_body())],
            "prepare",
            {**prepare_body(), "generation": "3"},
            422,
            "invalid_request",
        ),
        (
            [("drain", drain_body())],
            "prepare",
            {**prepare_body(), "incarnation": "../etc"},
            422,
            "invalid_request",
        ),
        (
            [("drain", drain_body())],
            "prepare",
            {**prepare_body(), "fence": 10**18},
            422,
            "invalid_request",
        ),
        (
            [("drain", drain_body())],
            "prepare",
            {**prepare_body(), "workers": {"w0": {}}},
            422,
            "invalid_request",
        ),
        (
            UPDATE,
            "apply",
            {**apply_body(0), "peers": {"w1": {"endpoint": "x"}}},
            422,
            "invalid_request",
        ),
        (UPDATE, "apply", {**apply_body(0), "peers": []}, 422, "invalid_request"),
    ],
)
async def test_bad_requests_are_refused_and_change_nothing(
    make_client, setup: list, path: str, body: Any, expected_status: int, expected_error: str
) -> None:
    client, backend, _receiver = await make_client()
    async with client:
        await run_steps(client, setup)
        before = (await client.get("/mooncake/status")).json()
        calls = list(backend.calls)
        response = await client.post(f"/mooncake/{path}", json=body)
        after = (await client.get("/mooncake/status")).json()
    assert response.status_code == expected_status, response.json()
    assert response.json()["error"] == expected_error and response.json()["detail"]
    if expected_error == "session_held":
        assert "coordinator-a" in response.json()["detail"] and S1 in response.json()["detail"]
    for status in (before, after):  # the lease countdown is the only thing that moves
        if status["session"]:
            status["session"].pop("expires_in_s")
    assert after == before and backend.calls == calls


@pytest.mark.parametrize("raw", [b"{not json", b"\x80", b'{"session": "\xff"}'])
async def test_malformed_json_is_422(make_client, raw: bytes) -> None:
    client, _, receiver = await make_client()
    async with client:
        response = await client.post(
            "/mooncake/drain", content=raw, headers={"content-type": "application/json"}
        )
    assert response.status_code == 422 and response.json()["error"] == "invalid_request"
    assert receiver.state.value == "serving"


async def test_placement_query_is_typed(make_client) -> None:
    """``?boxes=false`` reaches the workers; a query that does not validate is answered
    422 and asks no worker anything."""
    client, backend, _ = await make_client()
    async with client:
        full = await client.get("/mooncake/placement")
        bare = await client.get("/mooncake/placement", params={"boxes": "false"})
        for query in ({"boxes": "maybe"}, {"box": "false"}):
            refused = await client.get("/mooncake/placement", params=query)
            assert refused.status_code == 422, query
            assert refused.json()["error"] == "invalid_request"
    assert full.status_code == bare.status_code == 200
    assert [w["worker_id"] for w in full.json()["workers"]] == ["w0"]
    assert backend.calls == ["placement:True", "placement:False"]


async def test_token_guards_every_route_but_readiness(make_client) -> None:
    client, backend, _ = await make_client(token="s3cret")
    async with client:
        for method, path in [
            ("GET", "/mooncake/status"),
            ("GET", "/mooncake/placement"),
            ("POST", "/mooncake/drain"),
            ("POST", "/mooncake/abort"),
            ("POST", "/mooncake/rebuild"),
            ("POST", "/mooncake/bucket"),
        ]:
            response = await client.request(method, path, json=drain_body())
            assert response.status_code == 401 and response.json()["error"] == "unauthorized"
            wrong = await client.request(
                method, path, json=drain_body(), headers={"authorization": "Bearer nope"}
            )
            assert wrong.status_code == 401
        ok = await client.get("/mooncake/status", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        ready = await client.get("/mooncake/ready")
    assert ready.status_code == 200 and ready.json() == {"ready": True, "state": "serving"}
    assert backend.calls == []


async def test_readiness_follows_the_pause(make_client) -> None:
    """Ready while the session stages beside the old generation; not ready once an
    in-place prepare paused the engine (peers write live weights from then on)."""
    client, backend, _ = await make_client()
    backend.in_place_bytes = 4096
    async with client:
        await run_steps(client, [("drain", drain_body(mode="keep"))])
        staging = await client.get("/mooncake/ready")
        await run_steps(client, [("prepare", prepare_body())])
        paused = await client.get("/mooncake/ready")
    assert staging.status_code == 200 and staging.json() == {"ready": True, "state": "open"}
    assert paused.status_code == 503 and paused.json() == {"ready": False, "state": "prepared"}
    assert backend.calls == ["prepare:2", "drain:keep"]


async def test_a_pause_mode_the_engine_lacks_is_refused_before_anything(make_client) -> None:
    client, backend, receiver = await make_client()
    receiver.backend.pause_modes = ("abort", "wait")
    async with client:
        refused = await client.post("/mooncake/drain", json=drain_body(mode="keep"))
    assert refused.status_code == 409 and refused.json()["error"] == "pause_mode_unsupported"
    detail = refused.json()["detail"]
    assert receiver.backend.engine_version in detail and "engine-under-test" in detail
    assert (receiver.state.value, receiver.session, backend.calls) == ("serving", None, [])


async def test_a_pause_that_fails_at_commit_drops_the_staged_generation(make_client) -> None:
    """Pausing to land failed (a wait outlived its timeout): nothing landed, the engine
    never stopped, and it serves its old generation on."""
    client, backend, _ = await make_client()
    backend.fail_on.add("drain:wait")
    async with client:
        await run_steps(client, [("drain", drain_body(mode="wait")), *APPLIED[1:]])
        failed = await client.post("/mooncake/commit", json=commit_body())
        status = (await client.get("/mooncake/status")).json()
    assert failed.status_code == 502 and failed.json()["error"] == "drain_failed"
    assert "serves generation 1 again" in failed.json()["detail"]
    assert (status["state"], status["generation"], status["ready"]) == ("serving", 1, True)
    assert status["last_session"]["outcome"] == "failed"
    assert backend.calls[-2:] == ["drain:wait", "abort"] and "commit:2" not in backend.calls


async def test_prepare_failure_keeps_the_session_and_abort_serves_the_old_generation(
    make_client,
) -> None:
    client, backend, receiver = await make_client()
    backend.fail_on.add("prepare:2")
    async with client:
        await run_steps(client, [("drain", drain_body())])
        response = await client.post("/mooncake/prepare", json=prepare_body())
        assert response.status_code == 409 and response.json()["error"] == "prepare_failed"
        assert "prepare:2 exploded" in response.json()["detail"]
        assert receiver.state.value == "open" and receiver.session is not None
        aborted = (await client.post("/mooncake/abort", json={"session": S1})).json()
    assert (aborted["state"], aborted["generation"]) == ("serving", 1)
    assert aborted["last_session"]["outcome"] == "aborted"
    assert backend.calls == ["prepare:2", "abort", "abort"]  # never paused: nothing to resume


async def test_prepare_again_replaces_the_staged_plan(make_client) -> None:
    """A coordinator that re-planned around a lost engine prepares the survivors again."""
    client, backend, receiver = await make_client()
    async with client:
        await run_steps(client, [*UPDATE, ("prepare", prepare_body(stages=1))])
        await run_steps(client, [("apply", apply_body(0)), ("commit", commit_body())])
    assert receiver.generation == 2
    assert backend.calls == [
        "prepare:2",
        "abort",
        "prepare:2",
        "apply:2:0",
        "expect:2",
        "drain:abort",
        "commit:2",
    ]


async def test_apply_failure_serves_the_old_generation(make_client) -> None:
    """Apply writes only staging: its failure never costs the engine its generation."""
    client, backend, _ = await make_client()
    backend.fail_on.add("apply:2:0")
    async with client:
        await run_steps(client, UPDATE)
        response = await client.post("/mooncake/apply", json=apply_body(0))
        assert response.status_code == 502 and response.json()["error"] == "apply_failed"
        assert "serves generation 1 again" in response.json()["detail"]
        late = await client.post("/mooncake/commit", json=commit_body())
        status = (await client.get("/mooncake/status")).json()
    assert late.status_code == 409 and late.json()["error"] == "session_ended"
    assert (status["state"], status["generation"], status["ready"]) == ("serving", 1, True)
    assert status["last_session"]["outcome"] == "failed"
    assert "apply stage 0 failed" in status["last_error"]
    assert backend.calls[-2:] == ["apply:2:0", "abort"] and "resume" not in backend.calls


async def test_a_failed_check_reference_drops_the_update_before_any_pause(make_client) -> None:
    """The landing check's reference is built from staging while the engine serves: if
    that fails, nothing landed, the engine never paused, and it serves its old generation."""
    client, backend, _ = await make_client()
    backend.fail_on.add("expect:2")
    async with client:
        await run_steps(client, APPLIED)
        response = await client.post("/mooncake/commit", json=commit_body())
        status = (await client.get("/mooncake/status")).json()
    assert response.status_code == 502 and response.json()["error"] == "check_failed"
    assert "serves generation 1 again" in response.json()["detail"]
    assert (status["state"], status["generation"], status["ready"]) == ("serving", 1, True)
    assert status["last_session"]["outcome"] == "failed"
    assert backend.calls[-2:] == ["expect:2", "abort"]
    assert not any(c.startswith(("drain", "commit", "resume")) for c in backend.calls)


async def test_abort_after_apply_serves_the_old_generation(make_client) -> None:
    client, backend, receiver = await make_client()
    async with client:
        await run_steps(client, APPLIED)
        aborted = (await client.post("/mooncake/abort", json={"session": S1})).json()
        again = await client.post("/mooncake/abort", json={"session": S1})
    assert (aborted["state"], aborted["generation"]) == ("serving", 1)
    assert again.status_code == 200 and again.json()["state"] == "serving"
    assert backend.calls[-1] == "abort" and receiver.generation == 1
    assert "resume" not in backend.calls and "drain:abort" not in backend.calls


@pytest.mark.parametrize("ending", ["abort", "apply_failure", "lease_expiry"])
async def test_an_update_that_received_in_place_rebuilds_instead_of_resuming(
    make_client, ending: str
) -> None:
    """Live parameters were receive regions: any end but commit may leave them partly
    written, so the engine never resumes on them; it rebuilds from the Store."""
    client, backend, receiver = await make_client()
    backend.in_place_bytes = 4096
    if ending == "apply_failure":
        backend.fail_on.add("apply:2:1")
    async with client:
        await run_steps(
            client,
            [("drain", drain_body(ttl_s=1)), ("prepare", prepare_body()), ("apply", apply_body(0))],
        )
        assert receiver.status()["exposed_bytes"] == 4096
        if ending == "abort":
            ended = (await client.post("/mooncake/abort", json={"session": S1})).json()
            assert ended["state"] == "broken" and "4096 bytes of live" in ended["last_error"]
        elif ending == "apply_failure":
            failed = await client.post("/mooncake/apply", json=apply_body(1))
            assert failed.status_code == 502 and failed.json()["error"] == "apply_failed"
            assert "rebuilds itself from the Store" in failed.json()["detail"]
        await serving_again(receiver)
        status = (await client.get("/mooncake/status")).json()
    assert (status["generation"], status["rebuilds"], status["exposed_bytes"]) == (7, 1, 0)
    assert "resume" not in backend.calls and backend.calls[-2:] == ["abort", "rebuild:m"]


async def test_commit_is_idempotent_and_cannot_be_aborted(make_client) -> None:
    """A coordinator whose commit response was lost retries it: same answer, no second
    commit; an abort of the committed session is refused."""
    client, backend, _ = await make_client()
    async with client:
        await run_steps(client, [*APPLIED, ("commit", commit_body())])
        again = await client.post("/mooncake/commit", json=commit_body())
        other = await client.post("/mooncake/commit", json=commit_body(3))
        aborted = await client.post("/mooncake/abort", json={"session": S1})
    assert again.status_code == 200 and again.json()["already"] == "committed"
    assert again.json()["generation"] == 2
    assert other.status_code == 409 and other.json()["error"] == "session_ended"
    assert aborted.status_code == 409 and aborted.json()["error"] == "session_committed"
    assert backend.calls.count("commit:2") == 1


async def test_an_expired_session_frees_the_engine_by_itself(make_client) -> None:
    """The coordinator died after apply: no further call arrives, yet the engine serves its
    old generation again once the lease ran out, and the next coordinator gets through."""
    client, backend, receiver = await make_client()
    async with client:
        await run_steps(
            client,
            [
                ("drain", drain_body(ttl_s=1)),
                ("prepare", prepare_body()),
                ("apply", apply_body(0)),
                ("apply", apply_body(1)),
            ],
        )
        assert receiver.state.value == "applied"
        await serving_again(receiver)
        status = (await client.get("/mooncake/status")).json()
        late = await client.post("/mooncake/commit", json=commit_body())
        await run_steps(client, [("drain", drain_body(S2)), ("abort", {"session": S2})])
    assert (status["generation"], status["last_session"]["outcome"]) == (1, "expired")
    assert "expired while applied" in status["last_error"]
    assert late.status_code == 409 and late.json()["error"] == "session_ended"
    assert backend.calls[3] == "abort" and "resume" not in backend.calls


async def test_renewal_keeps_a_slow_session_alive(make_client) -> None:
    client, _, receiver = await make_client()
    async with client:
        await run_steps(client, [("drain", drain_body(ttl_s=1))])
        for _ in range(6):
            await asyncio.sleep(0.3)
            await run_steps(client, [("renew", {"session": S1})])
        assert receiver.state.value == "open"
        reused = await client.post("/mooncake/drain", json=drain_body())
        await run_steps(client, [("abort", {"session": S1})])
        ended = await client.post("/mooncake/drain", json=drain_body())
    assert reused.status_code == 200  # the holder's own drain again just renews
    assert ended.status_code == 409 and ended.json()["error"] == "session_ended"


async def test_commit_failure_breaks_then_rebuilds_from_the_store(make_client) -> None:
    client, backend, receiver = await make_client()
    backend.fail_on.add("commit:2")
    async with client:
        await run_steps(client, APPLIED)
        response = await client.post("/mooncake/commit", json=commit_body())
        assert response.status_code == 500 and response.json()["error"] == "commit_failed"
        await serving_again(receiver)
        status = (await client.get("/mooncake/status")).json()
    assert (status["generation"], status["fence"], status["rebuilds"]) == (7, 7, 1)
    assert status["last_session"]["outcome"] == "broken"
    assert backend.calls[-2:] == ["commit:2", "rebuild:m"]


async def test_rebuild_on_request_when_automatic_rebuild_is_off(make_client) -> None:
    client, backend, receiver = await make_client(auto_rebuild=False)
    backend.fail_on.update({"commit:2", "rebuild:m"})
    async with client:
        refused = await client.post("/mooncake/rebuild")
        await run_steps(client, APPLIED)
        await client.post("/mooncake/commit", json=commit_body())
        ready = await client.get("/mooncake/ready")
        failed = await client.post("/mooncake/rebuild")
        backend.fail_on.discard("rebuild:m")
        rebuilt = await client.post("/mooncake/rebuild")
    assert refused.status_code == 409 and refused.json()["error"] == "wrong_state"
    assert ready.status_code == 503 and ready.json()["state"] == "broken"
    assert failed.status_code == 502 and failed.json()["error"] == "rebuild_failed"
    assert rebuilt.status_code == 200 and rebuilt.json()["state"] == "serving"
    assert receiver.generation == 7


async def test_a_commit_every_rank_refused_keeps_the_engine_applied(make_client) -> None:
    client, backend, receiver = await make_client()
    backend.refuse_on.add("commit:2")
    async with client:
        await run_steps(client, APPLIED)
        refused = await client.post("/mooncake/commit", json=commit_body())
        backend.refuse_on.clear()
        committed = await client.post("/mooncake/commit", json=commit_body())
    assert refused.status_code == 409 and refused.json()["error"] == "stages_incomplete"
    assert committed.status_code == 200 and receiver.generation == 2
    assert "rebuild:m" not in backend.calls


@pytest.mark.parametrize("step", ["prepare:2", "apply:2:0", "commit:2"])
async def test_a_hung_worker_call_breaks_the_engine_without_a_rebuild(
    make_client, step: str
) -> None:
    """After a timeout a late reply could pass for the next call's: nothing more is sent to
    the workers (no abort, no rebuild); readiness stays 503 until the engine restarts."""
    client, backend, receiver = await make_client()
    backend.time_out_on.add(step)
    async with client:
        await run_steps(client, [("drain", drain_body())])
        for path, body in [("prepare", prepare_body()), *APPLIED[2:], ("commit", commit_body())]:
            response = await client.post(f"/mooncake/{path}", json=body)
            if response.status_code != 200:
                break
        await asyncio.sleep(0.2)
        ready = await client.get("/mooncake/ready")
    assert response.status_code == 504 and response.json()["error"] == "worker_timeout"
    assert "restart it" in response.json()["detail"]
    assert ready.status_code == 503 and receiver.state.value == "broken"
    assert backend.calls[-1] == step and receiver.session is None


async def test_resume_ends_the_session_like_abort(make_client) -> None:
    client, backend, receiver = await make_client()
    async with client:
        await run_steps(client, UPDATE)
        other = await client.post("/mooncake/resume", json={"session": S2})
        resumed = await client.post("/mooncake/resume", json={"session": S1})
        malformed = await client.post("/mooncake/resume", json={})
    assert other.status_code == 409 and other.json()["error"] == "session_held"
    assert resumed.status_code == 200 and resumed.json()["state"] == "serving"
    assert malformed.status_code == 422 and malformed.json()["error"] == "invalid_request"
    assert receiver.generation == 1 and backend.calls[-1] == "abort"
    assert "resume" not in backend.calls  # the session never paused the engine


def bucket_files() -> set[str]:
    return {p.name for p in SHM_DIR.glob("mooncake-rl-*")}


async def test_an_uploaded_bucket_is_one_apply_stage_and_leaves_no_file(make_client) -> None:
    """``POST /mooncake/bucket`` (CPU serialization from another host): the raw body becomes
    a shared-memory file for the workers, one apply stage runs on it, the file goes."""
    client, backend, _ = await make_client()
    before = bucket_files()
    async with client:
        await run_steps(client, UPDATE)
        for stage in (0, 1):
            query = {"session": S1, "generation": 2, "stage": stage}
            response = await client.post("/mooncake/bucket", params=query, content=b"x" * 64)
            assert response.status_code == 200 and response.json()["state"] == "applied"
        await run_steps(client, [("commit", commit_body())])
    assert backend.calls[-5:] == ["apply:2:0", "apply:2:1", "expect:2", "drain:abort", "commit:2"]
    assert bucket_files() == before


@pytest.mark.parametrize(
    "query,status,error",
    [
        ({"session": S1, "generation": 2, "stage": -1}, 422, "invalid_request"),
        ({"session": S1, "generation": "two", "stage": 0}, 422, "invalid_request"),
        ({"generation": 2, "stage": 0}, 422, "invalid_request"),
        ({"session": S2, "generation": 2, "stage": 0}, 409, "session_held"),
        ({"session": S1, "generation": 3, "stage": 0}, 409, "generation_mismatch"),
        ({"session": S1, "generation": 2, "stage": 1}, 409, "stage_out_of_order"),
    ],
)
async def test_bad_bucket_uploads_are_refused_and_change_nothing(
    make_client, query: dict[str, Any], status: int, error: str
) -> None:
    client, backend, receiver = await make_client()
    before = bucket_files()
    async with client:
        await run_steps(client, UPDATE)
        calls = list(backend.calls)
        response = await client.post("/mooncake/bucket", params=query, content=b"x" * 64)
    assert (response.status_code, response.json()["error"]) == (status, error)
    assert backend.calls == calls and receiver.state.value == "prepared"
    assert bucket_files() == before


async def test_a_bucket_over_the_body_limit_is_refused_before_it_is_read(make_engine) -> None:
    get_receiver, backend, receiver = await make_engine()
    app = FastAPI()
    app.include_router(build_router(get_receiver, None, max_body_bytes=1024))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")
    async with client:
        await run_steps(client, UPDATE)
        query = {"session": S1, "generation": 2, "stage": 0}
        response = await client.post("/mooncake/bucket", params=query, content=b"x" * 1025)
    assert (response.status_code, response.json()["error"]) == (413, "body_too_large")
    assert receiver.state.value == "prepared" and backend.calls[-1] == "prepare:2"


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples_of(exposition: str) -> Samples:
    """Every sample of a Prometheus exposition, by name and labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics", follow_redirects=True)
    assert response.status_code == 200
    return samples_of(response.text)


def engine_sample(samples: Samples, name: str, **labels: str) -> float:
    return samples[(f"mooncake_rl_{name}", tuple(sorted(labels.items())))]


def by_label(samples: Samples, name: str) -> dict[str, float]:
    """A one-label family's samples by that label's value."""
    return {
        labels[0][1]: value
        for (sample, labels), value in samples.items()
        if sample == f"mooncake_rl_{name}"
    }


async def test_metrics_count_a_known_sequence_of_calls(make_client) -> None:
    """A committed update, a refusal, an aborted session, and a commit failure the engine
    rebuilds from: every mooncake_rl_* figure on /metrics, exactly."""
    client, backend, receiver = await make_client()
    s3 = "3" * 32
    async with client:
        fresh = await scrape(client)
        await run_steps(client, [*APPLIED, ("commit", commit_body())])
        refused = await client.post("/mooncake/apply", json=apply_body(0, session=S2))
        assert refused.json()["error"] == "no_session"
        await run_steps(
            client,
            [
                ("drain", drain_body(S2)),
                ("prepare", prepare_body(3, session=S2)),
                ("abort", {"session": S2}),
            ],
        )
        backend.in_place_bytes = 4096
        backend.fail_on.add("commit:3")
        await run_steps(
            client,
            [
                ("drain", drain_body(s3)),
                ("prepare", prepare_body(3, stages=1, session=s3)),
                ("apply", apply_body(0, 3, s3)),
            ],
        )
        failed = await client.post("/mooncake/commit", json=commit_body(3, s3))
        assert failed.json()["error"] == "commit_failed"
        await serving_again(receiver)
        samples = await scrape(client)

    assert by_label(fresh, "receiver_state") == {s: float(s == "serving") for s in STATES}
    assert by_label(fresh, "served_generation") == {"m": 1}
    assert by_label(fresh, "engine_received_bytes_total") == {"in_place": 0, "staged": 0}
    assert engine_sample(fresh, "engine_store_read_bytes_total") == 0
    for empty in ("engine_failures_total", "engine_sessions_total", "engine_phase_seconds_count"):
        assert by_label(fresh, empty) == {}

    assert by_label(samples, "receiver_state") == {s: float(s == "serving") for s in STATES}
    assert by_label(samples, "served_generation") == {"m": 7}
    assert engine_sample(samples, "engine_rebuilds_total") == 1
    # Paused twice: to land the first update, and before the in-place one's apply. Both
    # commits built their check's reference; the second then failed to land.
    phases = {
        "pause": 2,
        "prepare": 3,
        "apply": 2,
        "check_reference": 2,
        "commit": 1,
        "rebuild": 1,
    }
    assert by_label(samples, "engine_phase_seconds_count") == phases
    for phase, count in phases.items():
        infinite = engine_sample(samples, "engine_phase_seconds_bucket", phase=phase, le="+Inf")
        assert infinite == count
        assert engine_sample(samples, "engine_phase_seconds_sum", phase=phase) >= 0
    assert engine_sample(samples, "engine_store_read_bytes_total") == 3 * READ
    assert engine_sample(samples, "engine_pushed_bytes_total") == 3 * PUSHED
    assert by_label(samples, "engine_received_bytes_total") == {
        "in_place": 4096,
        "staged": 2 * STAGED,
    }
    assert by_label(samples, "engine_failures_total") == {"no_session": 1, "commit_failed": 1}
    assert by_label(samples, "engine_sessions_total") == {
        "committed": 1,
        "aborted": 1,
        "broken": 1,
    }
