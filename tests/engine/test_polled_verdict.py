"""A polled worker call (apply stages, the landing check's reference) is judged once every
rank finished: ranks that refuse at different moments are one refusal (4xx, nothing
changed), never a split verdict (CI once saw 502 ``check_failed`` where every rank of a
TP=2 engine refused ``unwritten_staging``, rank 0 a poll before rank 1)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_ext.backend import WorkerBackend
from engine_ext.receiver import ReceiverError

REFUSED = {"ok": False, "refused": {"status": 409, "code": "unwritten_staging"}, "error": "no"}


class ScriptedRanks(WorkerBackend):
    """The backend's own polling and judging, over ranks that finish after ``polls[rank]``
    collects with ``finals[rank]`` (the worker side is :class:`UpdateWorker`'s reply shape)."""

    engine_id = "scripted"
    rpc_timeout_s = 5.0

    def __init__(self, polls: list[int], finals: list[dict[str, Any]]) -> None:
        self.left = list(polls)
        self.finals = finals

    async def call_workers(self, method: str, *args: Any) -> list[dict[str, Any]]:
        if method != "collect":
            return [{"ok": True, "rank": r} for r in range(len(self.finals))]
        replies = []
        for rank, final in enumerate(self.finals):
            running = self.left[rank] > 0
            self.left[rank] -= 1
            replies.append({"ok": True, "rank": rank, "running": True} if running else final)
        return [{**r, "rank": rank} for rank, r in enumerate(replies)]

    async def paused(self) -> bool:
        return False

    async def pause(self, request: Any) -> None: ...
    async def unpause(self) -> None: ...
    async def reset_cache(self) -> None: ...
    async def set_weight_version(self, version: str) -> None: ...


@settings(max_examples=30, deadline=None)  # each poll waits POLL_S, as the backend does
@given(st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_ranks_that_refuse_at_different_polls_are_one_refusal(polls: list[int]) -> None:
    ranks = ScriptedRanks(polls, [REFUSED] * len(polls))
    with pytest.raises(ReceiverError) as raised:
        asyncio.run(ranks.expect(3))
    assert (raised.value.status, raised.value.code) == (409, "unwritten_staging")
    assert raised.value.detail.count("rank ") == len(polls)


@settings(max_examples=16, deadline=None)
@given(st.integers(0, 3), st.integers(0, 3))
def test_one_rank_refusing_while_another_succeeds_is_a_failure(first: int, second: int) -> None:
    ranks = ScriptedRanks([first, second], [REFUSED, {"ok": True, "seconds": 0.5}])
    with pytest.raises(RuntimeError, match="rank 0: no"):
        asyncio.run(ranks.expect(3))


def test_every_rank_finishing_returns_every_reply() -> None:
    ranks = ScriptedRanks([2, 0], [{"ok": True, "seconds": 0.5}, {"ok": True, "seconds": 0.25}])
    assert asyncio.run(ranks.expect(3))["seconds"] == 0.5
