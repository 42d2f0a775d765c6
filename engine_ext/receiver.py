"""The engine-neutral update protocol every engine adapter serves under ``/mooncake/*``.

States::

    SERVING --drain--> DRAINED --prepare--> PREPARED --apply(stages)--> APPLIED --commit--> SERVING
       ^                  |  ^                  |                            |
       +-----resume-------+  +------abort-------+            abort / apply failure --> BROKEN

Prepare validates and registers but touches no live weight, so a failed or aborted prepare
leaves the engine able to resume the generation it served. Once apply has started the
engine never serves again until commit succeeds; any failure from then on marks it BROKEN,
to be rebuilt from the Store (``--load-format mooncake``), never retried in place.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field


class ReceiverState(StrEnum):
    SERVING = "serving"
    DRAINED = "drained"
    PREPARED = "prepared"
    APPLYING = "applying"
    APPLIED = "applied"
    BROKEN = "broken"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DrainRequest(_Request):
    mode: Literal["abort", "wait"] = "abort"
    timeout_s: float = Field(60.0, gt=0)


class PrepareRequest(_Request):
    model: str = Field(min_length=1)
    generation: int = Field(gt=0)
    manifest_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    mode: Literal["compat", "direct"]
    workers: dict[str, dict[str, Any]] = Field(description="routing slice per worker id")
    fence: int = Field(0, ge=0, lt=10**12, description="the active record's fence (0: none)")
    incarnation: str | None = Field(
        None, pattern=r"^[0-9a-f]{16}$", description="the Store incarnation of that record"
    )


class ApplyRequest(_Request):
    generation: int = Field(gt=0)
    stage: int = Field(ge=0)
    peers: dict[str, dict[str, Any]] = Field(description="TE endpoint and regions per worker id")


class GenerationRequest(_Request):
    generation: int = Field(gt=0)


@dataclass(frozen=True)
class ReceiverError(Exception):
    """An update step refused or failed; becomes ``{"error": code, "detail": ...}``."""

    status: int
    code: str
    detail: str

    def __str__(self) -> str:
        return f"{self.code} ({self.status}): {self.detail}"


class EngineBackend(Protocol):
    """Engine-specific glue (vLLM, SGLang). Each call reaches every worker of the engine."""

    engine_id: str

    async def drain(self, request: DrainRequest) -> None: ...
    async def resume(self) -> None: ...
    async def placement(self) -> dict[str, Any]: ...
    async def prepare(self, request: PrepareRequest) -> dict[str, Any]: ...
    async def apply(self, request: ApplyRequest) -> dict[str, Any]: ...
    async def commit(self, generation: int) -> dict[str, Any]: ...
    async def abort(self) -> None: ...


@dataclass(frozen=True)
class ServedRecord:
    """Which active record an engine serves: generation, fence and Store incarnation.

    Within one incarnation the fence orders records (``activate`` may name an older
    generation under a newer fence); across incarnations nothing compares, since a master
    that lost its state restarts its numbering.
    """

    generation: int = 0
    fence: int = 0
    incarnation: str | None = None

    def superseded_by(self, request: PrepareRequest) -> bool:
        if request.incarnation is not None and self.incarnation not in (None, request.incarnation):
            return True
        if request.fence and self.fence:
            return request.fence > self.fence
        return request.generation > self.generation


class Receiver:
    """Serializes update calls and enforces the state machine and generation fences."""

    def __init__(self, backend: EngineBackend, model: str, served: ServedRecord) -> None:
        self.backend = backend
        self.model = model
        self.served = served
        self.state = ReceiverState.SERVING
        self.pending: int | None = None
        self._pending_record: ServedRecord | None = None
        self.last_error: str | None = None
        self._lock = asyncio.Lock()

    @property
    def generation(self) -> int:
        return self.served.generation

    def status(self) -> dict[str, Any]:
        return {
            "engine_id": self.backend.engine_id,
            "model": self.model,
            "generation": self.generation,
            "fence": self.served.fence,
            "incarnation": self.served.incarnation,
            "state": self.state.value,
            "pending_generation": self.pending,
            "last_error": self.last_error,
        }

    def _require(self, *states: ReceiverState) -> None:
        if self.state not in states:
            allowed = ", ".join(s.value for s in states)
            raise ReceiverError(
                409, "wrong_state", f"engine is {self.state.value}; needs {allowed}"
            )

    def _require_pending(self, generation: int) -> None:
        if generation != self.pending:
            raise ReceiverError(
                409,
                "generation_mismatch",
                f"request is for generation {generation}, prepared generation is {self.pending}",
            )

    async def drain(self, request: DrainRequest) -> dict[str, Any]:
        async with self._lock:
            if self.state is ReceiverState.DRAINED:
                return self.status()
            self._require(ReceiverState.SERVING)
            await self.backend.drain(request)
            self.state = ReceiverState.DRAINED
            return self.status()

    async def resume(self) -> dict[str, Any]:
        async with self._lock:
            if self.state is ReceiverState.SERVING:
                return self.status()
            self._require(ReceiverState.DRAINED)
            await self.backend.resume()
            self.state = ReceiverState.SERVING
            return self.status()

    async def placement(self) -> dict[str, Any]:
        return {**self.status(), **await self.backend.placement()}

    async def prepare(self, request: PrepareRequest) -> dict[str, Any]:
        async with self._lock:
            self._require(ReceiverState.DRAINED)
            if request.model != self.model:
                raise ReceiverError(
                    409, "wrong_model", f"engine serves {self.model!r}, not {request.model!r}"
                )
            if not self.served.superseded_by(request):
                raise ReceiverError(
                    409,
                    "stale_generation",
                    f"generation {request.generation} (fence {request.fence}) is not newer than "
                    f"served generation {self.generation} (fence {self.served.fence})",
                )
            try:
                prepared = await self.backend.prepare(request)
            except ReceiverError:
                await self.backend.abort()
                raise
            except Exception as error:  # prepare touches nothing live: the engine can resume
                await self.backend.abort()
                raise ReceiverError(409, "prepare_failed", str(error)) from error
            self.pending = request.generation
            self._pending_record = ServedRecord(
                request.generation, request.fence, request.incarnation
            )
            self.state = ReceiverState.PREPARED
            return {**self.status(), **prepared}

    async def apply(self, request: ApplyRequest) -> dict[str, Any]:
        async with self._lock:
            self._require(ReceiverState.PREPARED, ReceiverState.APPLIED)
            self._require_pending(request.generation)
            self.state = ReceiverState.APPLYING
            try:
                applied = await self.backend.apply(request)
            except Exception as error:
                self.state = ReceiverState.BROKEN
                self.last_error = f"apply failed: {error}"
                raise ReceiverError(500, "apply_failed", str(error)) from error
            self.state = ReceiverState.APPLIED
            return {**self.status(), **applied}

    async def commit(self, request: GenerationRequest) -> dict[str, Any]:
        async with self._lock:
            self._require(ReceiverState.APPLIED)
            self._require_pending(request.generation)
            try:
                committed = await self.backend.commit(request.generation)
            except Exception as error:
                self.state = ReceiverState.BROKEN
                self.last_error = f"commit failed: {error}"
                raise ReceiverError(500, "commit_failed", str(error)) from error
            assert self._pending_record is not None
            self.served, self.pending = self._pending_record, None
            self.state = ReceiverState.SERVING
            self.last_error = None
            return {**self.status(), **committed}

    async def abort(self) -> dict[str, Any]:
        async with self._lock:
            if self.state in (ReceiverState.APPLYING, ReceiverState.APPLIED):
                # Bytes may already have landed: never serve this state, rebuild instead.
                await self.backend.abort()
                self.state = ReceiverState.BROKEN
                self.last_error = "aborted after apply started: rebuild from the Store"
                return self.status()
            self._require(ReceiverState.PREPARED, ReceiverState.DRAINED)
            await self.backend.abort()
            self.pending = self._pending_record = None
            self.state = ReceiverState.DRAINED
            return self.status()
