"""Every shared ``/mooncake/*`` scenario again, through the SGLang glue.

The receiver is built by :class:`engine_ext.sglang.plugins.EngineRoutes` over
:class:`engine_ext.sglang.backend.SglangBackend`, as on SGLang's server. SGLang's real
``TokenizerManager`` needs running schedulers (a GPU), so a recording stand-in takes its
place: it uses SGLang's own request/response types and its ``RWLock``, and names each call
by the logical step the shared scenarios expect.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

pytest.importorskip("sglang")

from sglang.srt.managers.io_struct import (
    ContinueGenerationReqInput,
    FlushCacheReqOutput,
    PauseGenerationReqInput,
)
from sglang.srt.utils.aio_rwlock import RWLock

from engine_ext.sglang.ipc import MooncakeRLReqInput, MooncakeRLReqOutput
from engine_ext.sglang.plugins import EngineRoutes
from tests.engine.test_receiver_routes import *  # noqa: F403 (the shared scenarios)
from tests.engine.test_receiver_routes import PUSHED, READ, STAGED, Engine, drain_body


class _RecordingLock(RWLock):
    def __init__(self, manager: RecordingTokenizerManager) -> None:
        super().__init__()
        self._manager = manager

    @property
    def writer_lock(self) -> Any:
        self._manager.step("drain:wait")
        return super().writer_lock


class RecordingTokenizerManager:
    """The slice of SGLang's TokenizerManager the backend uses, recording logical steps."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail_on: set[str] = set()
        self.refuse_on: set[str] = set()
        self.time_out_on: set[str] = set()
        self.in_place_bytes = 0
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.model_update_lock = _RecordingLock(self)
        self.mooncake_rl_communicator = self._communicate
        self._committing = False

    def step(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail_on:
            raise RuntimeError(f"{name} exploded")

    def auto_create_handle_loop(self) -> None:
        """The stand-in answers inline; nothing to start."""

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        self.step(f"drain:{obj.mode}")
        self.is_pause = True

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        self.is_pause = False
        if self._committing:  # the resume that ends a commit is part of the commit step
            self._committing = False
        else:
            self.step("resume")

    async def flush_cache(self) -> FlushCacheReqOutput:
        return FlushCacheReqOutput(success=True)

    async def _communicate(self, request: MooncakeRLReqInput) -> list[MooncakeRLReqOutput]:
        args = json.loads(request.args)
        steps = {
            "prepare": lambda: f"prepare:{args[0]['generation']}",
            "apply": lambda: f"apply:{args[0]['generation']}:{args[0]['stage']}",
            "commit": lambda: f"commit:{args[0]}",
            "abort": lambda: "abort",
            "rebuild": lambda: f"rebuild:{args[0]}",
            "describe": lambda: f"placement:{args[0]}",
        }
        reply: dict[str, Any] = {"ok": True, "rank": 0}
        if request.method == "status":
            reply |= {"generation": 1, "model_name": None}
        if request.method == "rebuild":
            reply |= {"generation": 7, "fence": 7, "incarnation": "ab" * 8}
        if request.method == "describe":
            reply |= {"worker_id": "w0"}
        if request.method == "prepare":
            reply |= {"in_place_bytes": self.in_place_bytes, "staged_bytes": STAGED}
        if request.method == "apply":
            reply |= {"store_read_bytes": READ, "pushed_bytes": PUSHED}
        if request.method in steps:
            name = steps[request.method]()
            if name in self.time_out_on:  # as engine_ext.rpc.within reports a hung rank
                self.calls.append(name)
                raise TimeoutError(f"worker call {name!r} got no reply within 1s")
            try:
                self.step(name)
            except RuntimeError as error:
                reply = {"ok": False, "rank": 0, "error": str(error)}
            if name in self.refuse_on:
                reply = {
                    "ok": False,
                    "rank": 0,
                    "refused": {"status": 409, "code": "stages_incomplete"},
                    "error": f"{name} refused",
                }
        # The resume that ends a commit or a rebuild is part of that step.
        self._committing = request.method in ("commit", "rebuild") and reply["ok"]
        return [MooncakeRLReqOutput(replies=json.dumps([reply]))]


@pytest.fixture
def make_engine() -> Callable[..., Awaitable[Engine]]:
    async def make(auto_rebuild: bool = True) -> Engine:
        manager = RecordingTokenizerManager()
        routes = EngineRoutes("engine-under-test", "m", lambda: manager)
        receiver = await routes.receiver(None)
        receiver.auto_rebuild = auto_rebuild
        return routes.receiver, manager, receiver

    return make


async def test_wait_drain_times_out_and_reopens_admission(make_client) -> None:
    client, manager, receiver = await make_client()
    await manager.model_update_lock.acquire_reader()  # a request still generating
    async with client:
        response = await client.post("/mooncake/drain", json=drain_body(mode="wait", timeout_s=0.2))
    assert response.status_code == 409 and response.json()["error"] == "drain_timeout"
    assert receiver.state.value == "serving" and manager.is_pause is False
    assert manager.calls == ["drain:wait", "resume"]
    await manager.model_update_lock.release_reader()


async def test_routes_mount_on_sglangs_own_app() -> None:
    """The ``launch_server`` BEFORE hook's body against SGLang's real FastAPI app (its
    middleware included); the receiver finds the TokenizerManager in SGLang's global state."""
    from types import SimpleNamespace

    import httpx
    from sglang.srt.entrypoints.http_server import _GlobalState, app, set_global_state

    from engine_ext.sglang.plugins import _attach_routes
    from mooncake_rl.protocol import PROTOCOL_VERSION

    manager = RecordingTokenizerManager()
    set_global_state(
        _GlobalState(tokenizer_manager=manager, template_manager=None, scheduler_info={})
    )
    server_args = SimpleNamespace(
        host="127.0.0.1",
        port=30000,
        load_format="mooncake",
        model_loader_extra_config='{"name": "tiny"}',
        served_model_name=None,
        model_path="/models/tiny",
        api_key=None,
        ssl_certfile=None,
    )
    _attach_routes(server_args=server_args)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        status = (await client.get("/mooncake/status")).json()
        drained = await client.post("/mooncake/drain", json=drain_body(mode="abort"))
        malformed = await client.post("/mooncake/drain", json=drain_body(mode="sideways"))
    assert (status["engine_id"], status["model"], status["generation"]) == (
        "127.0.0.1:30000",
        "tiny",
        1,
    )
    assert status["protocol"] == PROTOCOL_VERSION
    assert drained.json()["state"] == "drained" and manager.calls == ["drain:abort"]
    # Every response of SGLang's app names the generation served and the engine.
    for response in (drained, malformed):
        assert response.headers["x-mooncake-generation"] == "1"
        assert response.headers["x-mooncake-engine"] == "127.0.0.1:30000"
    assert malformed.status_code == 422 and malformed.json()["error"] == "invalid_request"
