"""The engine-neutral half of an :class:`~engine_ext.receiver.EngineBackend`.

Every engine reaches its workers through one call path (vLLM's ``collective_rpc``, SGLang's
scheduler control channel) that returns one reply per rank; this class checks each reply
and sequences the worker protocol. Subclasses supply the transport and the engine's own
pause, resume and cache reset.

**Staging runs beside serving.** An apply stage starts on every rank and returns at once;
the rank moves its bytes on a thread of its own while the engine keeps stepping, and this
class polls for the stage's end (``collect``), so a worker call never holds the engine's
step loop for longer than a poll.

**A pause that is not ours stays.** A host that paused the engine itself before a session
drained it (VeRL's manager aborts and pauses its replicas, then frees their KV cache, before
its checkpoint engine runs) resumes it itself, once the KV cache is back: every resume here
(commit, abort, expiry, rebuild) leaves such an engine paused.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from typing import Any

from engine_ext.served import ServedRecord, weight_version
from engine_ext.sessions import ReceiverError
from mooncake_rl.protocol import PAUSE_MODES, ApplyRequest, DrainRequest, PrepareRequest

POLL_S = (0.005, 0.01, 0.02, 0.05)
"""Waits between polls of a running apply stage: short first (small stages end fast)."""


class WorkerBackend(ABC):
    engine_id: str
    host_paused = False
    """The engine was already paused when the last session drained it: its host resumes it."""
    engine_version = "unknown"
    """The engine's name and version, as refusals name it."""
    pause_modes: tuple[str, ...] = PAUSE_MODES
    """The pause modes this engine's version offers (``keep`` needs vLLM's or SGLang's own)."""
    rpc_timeout_s: float

    # -- engine glue --------------------------------------------------------------------
    @abstractmethod
    async def call_workers(self, method: str, *args: Any) -> list[dict[str, Any]]:
        """Run :meth:`engine_ext.worker.UpdateWorker.call` on every rank; one reply each."""

    @abstractmethod
    async def paused(self) -> bool:
        """Whether the engine admits no request to its scheduler right now."""

    @abstractmethod
    async def pause(self, request: DrainRequest) -> None: ...

    @abstractmethod
    async def unpause(self) -> None: ...

    @abstractmethod
    async def reset_cache(self) -> None:
        """Drop every cached prefix/KV entry computed with the previous weights, also those
        of requests a ``keep`` pause froze: they recompute their prefix on the new weights."""

    @abstractmethod
    async def set_weight_version(self, version: str) -> None:
        """Tag every output token from now on with ``version`` (the engine's own spans)."""

    # -- shared -------------------------------------------------------------------------
    async def drain(self, request: DrainRequest) -> None:
        self.host_paused = await self.paused()
        await self.pause(request)

    async def resume(self) -> None:
        """Undo the session's pause, never the host's (see the module docstring)."""
        if not self.host_paused:
            await self.unpause()

    async def _rpc(self, method: str, *args: Any) -> list[dict[str, Any]]:
        """Every rank's reply; a rank's refusal (bad input, nothing done) becomes a 4xx."""
        return self._judged(await self.call_workers(method, *args))

    @staticmethod
    def _judged(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The replies if every rank succeeded; a 4xx if every rank refused (nothing
        changed); a failure otherwise."""
        failed = [r for r in replies if not r.get("ok")]
        refused = [r for r in failed if r.get("refused")]
        if refused and len(refused) == len(replies):  # no rank acted: nothing changed
            first = refused[0]["refused"]
            detail = "; ".join(f"rank {r['rank']}: {r['error']}" for r in refused)
            raise ReceiverError(int(first["status"]), str(first["code"]), detail)
        if failed:
            raise RuntimeError("; ".join(f"rank {r['rank']}: {r['error']}" for r in failed))
        return replies

    async def served(self) -> tuple[ServedRecord, str | None]:
        """The active record (and model name) every rank serves; they must agree."""
        return self._agreed(await self._rpc("status"))

    @staticmethod
    def _agreed(replies: list[dict[str, Any]]) -> tuple[ServedRecord, str | None]:
        records = {
            ServedRecord(
                int(r.get("generation") or 0), int(r.get("fence") or 0), r.get("incarnation")
            )
            for r in replies
        }
        if len(records) != 1:
            raise RuntimeError(
                f"workers disagree on the served generation: {sorted(map(str, records))}"
            )
        return records.pop(), replies[0].get("model_name")

    async def placement(self, boxes: bool = True) -> dict[str, Any]:
        return {"workers": await self._rpc("describe", boxes)}

    async def prepare(self, request: PrepareRequest) -> dict[str, Any]:
        try:
            described = await self._rpc("prepare", request.model_dump(mode="json"))
            await self._rpc("promote")
        except RuntimeError as error:
            raise ReceiverError(409, "prepare_failed", str(error)) from error
        return {
            "workers": described,
            "in_place_bytes": sum(w.get("in_place_bytes", 0) for w in described),
            "staged_bytes": sum(w.get("staged_bytes", 0) for w in described),
        }

    async def apply(self, request: ApplyRequest) -> dict[str, Any]:
        """Start the stage on every rank, then poll until every rank finished it."""
        return {
            "workers": await self._polled(
                f"apply stage {request.stage}", "apply", request.model_dump(mode="json")
            )
        }

    async def expect(self, generation: int) -> dict[str, Any]:
        """Every rank builds its post-landing check's reference while the engine serves."""
        replies = await self._polled("the landing check's reference", "expect", generation)
        seconds = max((r.get("seconds", 0.0) for r in replies), default=0.0)
        return {"workers": replies, "seconds": seconds}

    async def _polled(self, what: str, method: str, *args: Any) -> list[dict[str, Any]]:
        """Start ``method`` on every rank's stage thread, then ``collect`` until every rank
        finished it, within ``rpc_timeout_s`` (a rank still running then is out of step: a
        timeout)."""
        await self._rpc(method, *args)
        deadline = time.monotonic() + self.rpc_timeout_s
        attempt = 0
        # Judged only once no rank runs: a rank that refused early must not be taken for a
        # split verdict while the others still run towards the same refusal.
        replies = await self.call_workers("collect")
        while any(r.get("running") for r in replies):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} ran past {self.rpc_timeout_s}s")
            await asyncio.sleep(POLL_S[min(attempt, len(POLL_S) - 1)])
            attempt += 1
            replies = await self.call_workers("collect")
        return self._judged(replies)

    async def commit(self, generation: int, weight_version: str) -> dict[str, Any]:
        """Land and check on every rank, drop caches, tag the version, resume; the parts'
        seconds under ``landing``."""
        parts: dict[str, float] = {}
        started = time.perf_counter()
        committed = await self._rpc("commit", generation)
        parts["land_and_check_s"] = time.perf_counter() - started
        # Of that, the slowest rank's engine reload and post-landing check.
        parts["land_s"] = max((w.get("land_seconds", 0.0) for w in committed), default=0.0)
        parts["check_s"] = max(
            (w.get("verify", {}).get("seconds", 0.0) for w in committed), default=0.0
        )
        await self._timed_part(parts, "reset_cache_s", self.reset_cache())
        await self._timed_part(parts, "weight_version_s", self.set_weight_version(weight_version))
        await self._timed_part(parts, "resume_s", self.resume())
        return {"workers": committed, "landing": parts}

    async def commit_adapter(self, generation: int) -> dict[str, Any]:
        """Land and check an adapter generation on every rank, resume; the base's caches
        and weight version stay (its weights did not change)."""
        started = time.perf_counter()
        committed = await self._rpc("commit", generation)
        parts = {"land_and_check_s": time.perf_counter() - started}
        await self._timed_part(parts, "resume_s", self.resume())
        return {"workers": committed, "landing": parts}

    @staticmethod
    async def _timed_part(parts: dict[str, float], name: str, step: Any) -> None:
        started = time.perf_counter()
        await step
        parts[name] = time.perf_counter() - started

    async def abort(self) -> None:
        await self._rpc("abort")

    async def rebuild(self, model: str) -> ServedRecord:
        """Every rank reloads the active generation; then the engine admits requests again."""
        served, _ = self._agreed(await self._rpc("rebuild", model))
        await self.reset_cache()
        await self.set_weight_version(weight_version(model, served))
        await self.resume()
        return served
