"""An engine its host paused (VeRL's manager, before it frees the KV cache) stays paused
through every end of an update session; one the session paused runs again after it."""

from __future__ import annotations

from typing import Any

import pytest

from engine_ext.receiver import Receiver, ServedRecord
from engine_ext.vllm.backend import VllmBackend
from mooncake_rl.protocol import (
    ApplyRequest,
    CommitRequest,
    DrainRequest,
    PrepareRequest,
    SessionRequest,
)

SESSION = "1" * 32


class Scheduler:
    """The ``AsyncLLM`` calls the vLLM glue makes; every worker step succeeds."""

    def __init__(self, paused: bool) -> None:
        self.paused = paused

    async def is_paused(self) -> bool:
        return self.paused

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        self.paused = False

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True

    async def update_weight_version(self, version: str) -> None:
        self.version = version

    async def collective_rpc(self, method: str, timeout: float, args: tuple) -> list[dict]:
        return [{"ok": True, "rank": 0}]


async def drained(scheduler: Scheduler) -> Receiver:
    """A session opened: it stages beside serving, so it pauses nothing yet."""
    receiver = Receiver(VllmBackend(scheduler, "e", rpc_timeout_s=5), "m", ServedRecord(1, 1))
    paused = scheduler.paused
    await receiver.drain(DrainRequest(session=SESSION, holder="bridge"))
    assert scheduler.paused is paused
    return receiver


async def prepared(scheduler: Scheduler) -> Receiver:
    receiver = await drained(scheduler)
    body: dict[str, Any] = {"model": "m", "manifest_digest": "ab" * 32, "mode": "compat"}
    await receiver.prepare(
        PrepareRequest(session=SESSION, generation=2, stages=1, workers={}, **body)
    )
    return receiver


@pytest.mark.parametrize("host_paused", [True, False])
async def test_commit_resumes_only_a_pause_of_its_own(host_paused: bool) -> None:
    scheduler = Scheduler(paused=host_paused)
    receiver = await prepared(scheduler)
    await receiver.apply(ApplyRequest(session=SESSION, generation=2, stage=0, peers={}))
    status = await receiver.commit(CommitRequest(session=SESSION, generation=2))
    assert (status["state"], status["generation"]) == ("serving", 2)
    assert scheduler.paused is host_paused
    assert scheduler.version == "m:-:2"  # vLLM tags each output token with it


@pytest.mark.parametrize("host_paused", [True, False])
async def test_abort_resumes_only_a_pause_of_its_own(host_paused: bool) -> None:
    scheduler = Scheduler(paused=host_paused)
    receiver = await prepared(scheduler)
    status = await receiver.abort(SessionRequest(session=SESSION))
    assert (status["state"], status["generation"]) == ("serving", 1)
    assert scheduler.paused is host_paused
