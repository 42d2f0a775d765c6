"""The engine-neutral update protocol every engine adapter serves under ``/mooncake/*``.

States::

    SERVING --drain--> OPEN --prepare--> PREPARED --apply(stages)--> APPLIED --commit--> SERVING
       ^                 |                  |                          |          |
       +------ abort, apply failure, session lease expiry -------------+          |
       +------ rebuild <-- BROKEN <-- commit failure -----------------------------+

**Serving while staging.** Drain opens the session but does not pause the engine: prepare
and apply write only staging, so the engine serves its complete old generation (and stays
``ready``) throughout. It pauses, in the session's mode (abort, wait or keep), only at
commit, to land, check, drop caches and tag its new weight version; then it resumes. The
pause is the landing. A prepare that receives into live parameters pauses the engine before
it returns, since peers write those from the first apply stage on.

**Sessions.** Drain opens an update session: an id, its holder (the coordinator) and a
lease TTL. Every later call names the session and renews its lease; a call from another
session gets 409 naming the holder and changes nothing. When the lease runs out (the
coordinator died or was cut off) the engine drops the staged generation and serves its
old one again by itself. Commit and abort are idempotent per session, so a coordinator
whose response was lost retries them safely.

**Staging keeps failures recoverable.** Prepare and apply write only the worker's staging
arena; live weights change at commit alone. So a failed or aborted prepare or apply, or an
expired session, returns the engine to SERVING on the generation it served. BROKEN means
live weights may be partly written (a failed commit): the engine then rebuilds itself from
the Store's active generation, through the same path as ``--load-format mooncake``.

**In-place receive trades that for no copy.** A direct-mode prepare that registers live
parameters as receive regions (its reply's ``in_place_bytes`` > 0) exposes them: peers may
write into them from the first apply stage on, anywhere in the session. From then on, any
end but commit (abort, apply failure, lease expiry) leaves the engine BROKEN, and it
rebuilds itself as after a failed commit; it never serves a mix.

Here: the routes' steps (the transitions), each under one lock. Beside it:
:mod:`engine_ext.sessions` (the session holding the engine, its lease and expiry, the
states) and :mod:`engine_ext.served` (the record an engine serves); their names are
re-exported here. The HTTP routes calling these steps are :mod:`engine_ext.routes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from engine_ext.lora import ResidentAdapters, bound_to
from engine_ext.served import ServedRecord, weight_version
from engine_ext.sessions import HELD, ReceiverError, ReceiverState, Session, SessionKeeper
from mooncake_rl.protocol import (
    AdapterRequest,
    ApplyRequest,
    CommitRequest,
    DrainRequest,
    PrepareRequest,
    SessionRequest,
    UpdateTarget,
    stage_refusal,
)

__all__ = [
    "EngineBackend",
    "Receiver",
    "ReceiverError",
    "ReceiverState",
    "ServedRecord",
    "weight_version",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")
REBUILD_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
"""Waits between automatic rebuild attempts (the Store may be restarting)."""


class EngineBackend(Protocol):
    """Engine-specific glue (vLLM, SGLang). Each call reaches every worker of the engine."""

    engine_id: str

    engine_version: str
    pause_modes: tuple[str, ...]

    async def drain(self, request: DrainRequest) -> None:
        """Pause generation in ``request.mode`` (the session's pause, taken to land)."""
        ...

    async def resume(self) -> None: ...
    # Each worker's description; ``boxes=False`` leaves out ``protocol.BOXES``.
    async def placement(self, boxes: bool = True) -> dict[str, Any]: ...
    async def prepare(self, request: PrepareRequest) -> dict[str, Any]: ...
    async def apply(self, request: ApplyRequest) -> dict[str, Any]: ...
    async def expect(self, generation: int) -> dict[str, Any]:
        """Build the post-landing check's reference (before the pause); ``seconds``."""
        ...

    async def commit(self, generation: int, weight_version: str) -> dict[str, Any]: ...
    async def commit_adapter(self, generation: int) -> dict[str, Any]:
        """Land and check an adapter generation on every rank, then resume."""
        ...

    async def abort(self) -> None: ...
    async def rebuild(self, model: str) -> ServedRecord:
        """Load the Store's active generation into the live model and serve it again."""
        ...


def _counted(
    step: Callable[..., Awaitable[dict[str, Any]]],
) -> Callable[..., Awaitable[dict[str, Any]]]:
    """A route's step whose refusals and failures are counted by code in the figures."""

    @functools.wraps(step)
    async def counted(self: Receiver, *args: Any) -> dict[str, Any]:
        try:
            return await step(self, *args)
        except ReceiverError as error:
            self.figures.failures[error.code] += 1
            raise

    return counted


class Receiver(SessionKeeper):
    """Serializes update calls and enforces sessions, the state machine and fences."""

    # -- checks ---------------------------------------------------------------------------
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

    async def _timed(self, phase: str, step: Awaitable[T]) -> T:
        """``step``'s result; its seconds go to the phase's figures when it succeeds."""
        started = time.perf_counter()
        result = await step
        self.figures.timed(phase, time.perf_counter() - started)
        return result

    def _stage_done(self, session: Session, applied: dict[str, Any], seconds: float) -> None:
        """One apply stage ran: its bytes; after the last, the session's apply seconds and
        every byte its prepare said would land."""
        session.stages_done += 1
        session.apply_s += seconds
        self.figures.applied(applied)
        if session.stages_done == session.stages:
            self.figures.timed("apply", session.apply_s)
            self.figures.received(*session.landing)

    async def _pause(self, session: Session) -> float:
        """Pause generation in the session's mode, once per session; its seconds."""
        if session.paused:
            return 0.0
        started = time.perf_counter()
        try:
            await self._timed("pause", self.backend.drain(session.pause))
        except ReceiverError:
            raise
        except Exception as error:
            raise ReceiverError(
                502, "drain_failed", f"the engine did not pause: {error}"
            ) from error
        session.paused = True
        return time.perf_counter() - started

    def _require_pause_mode(self, mode: str) -> None:
        if mode not in self.backend.pause_modes:
            raise ReceiverError(
                409,
                "pause_mode_unsupported",
                f"engine {self.backend.engine_id} runs {self.backend.engine_version}, which "
                f"pauses only with {', '.join(self.backend.pause_modes)}, not {mode!r}; "
                "update with --drain abort or wait, or upgrade the engine",
            )

    def _require_newer(self, target: UpdateTarget | PrepareRequest) -> None:
        """Refuse a record of another model, or one this engine already serves or passed
        (for its LoRA adapter's name: the newest adapter generation landed)."""
        if self.adapters is not None and target.model == self.adapters.policy:
            if not self.adapters.served.superseded_by(target):
                raise ReceiverError(
                    409,
                    "stale_generation",
                    f"adapter generation {target.generation} (fence {target.fence}) is not "
                    f"newer than resident generation {self.adapters.served.generation}",
                )
            return
        if target.model != self.model:
            raise ReceiverError(
                409, "wrong_model", f"engine serves {self.model!r}, not {target.model!r}"
            )
        if not self.served.superseded_by(target):
            raise ReceiverError(
                409,
                "stale_generation",
                f"generation {target.generation} (fence {target.fence}) is not newer than "
                f"served generation {self.generation} (fence {self.served.fence})",
            )

    # -- routes ---------------------------------------------------------------------------
    @_counted
    async def drain(self, request: DrainRequest) -> dict[str, Any]:
        async with self._lock:
            await self._expire_if_due()
            if self.session is not None:
                if self.session.id != request.session:
                    raise self._held_by_other()
                self.session.renew()
                return self.status()
            if self._ended(request.session) is not None:
                await self._own(request.session)  # raises session_ended
            self._require(ReceiverState.SERVING)
            self._require_pause_mode(request.mode)
            if request.target is not None:
                self._require_newer(request.target)
            self.session = Session(
                request.session,
                request.holder,
                request.ttl_s,
                time.monotonic() + request.ttl_s,
                request,
            )
            self.state = ReceiverState.OPEN
            self._spawn(self._watch())
            return self.status()

    @_counted
    async def renew(self, request: SessionRequest) -> dict[str, Any]:
        """Extend the session's lease; takes no lock, so it works while apply runs."""
        if self.session is not None and self.session.id == request.session:
            self.session.renew()
            return self.status()
        async with self._lock:
            await self._own(request.session)
            return self.status()

    async def placement(self, boxes: bool = True) -> dict[str, Any]:
        return {**self.status(), **await self.backend.placement(boxes)}

    @_counted
    async def prepare(self, request: PrepareRequest) -> dict[str, Any]:
        async with self._lock:
            session = await self._own(request.session)
            self._require(ReceiverState.OPEN, ReceiverState.PREPARED)
            if request.adapter:
                self._require_adapters()
            self._require_newer(request)
            # Re-planned: drop the previous staging. Bytes already received in place are
            # rewritten by the new plan's stages, which cover every parameter again.
            if self.state is ReceiverState.PREPARED:
                await self.backend.abort()
                self.pending = self._pending_record = None
                self.state = ReceiverState.OPEN
            try:
                prepared = await self._timed("prepare", self.backend.prepare(request))
            except ReceiverError:
                await self.backend.abort()
                raise
            except TimeoutError as error:
                self._out_of_step(str(error))
                raise ReceiverError(504, "worker_timeout", self.last_error or "") from error
            except Exception as error:  # prepare touches nothing live: the engine can resume
                await self.backend.abort()
                raise ReceiverError(409, "prepare_failed", str(error)) from error
            self.pending = request.generation
            self._pending_record = ServedRecord(
                request.generation, request.fence, request.incarnation
            )
            if int(prepared.get("in_place_bytes", 0)):
                try:  # peers write live parameters from the first stage on
                    await self._pause(session)
                except ReceiverError:
                    await self.backend.abort()
                    self.pending = self._pending_record = None
                    raise
            self.exposed_bytes = int(prepared.get("in_place_bytes", 0))
            session.adapter_base = bound_to(prepared["workers"]) if request.adapter else None
            session.stages, session.stages_done, session.apply_s = request.stages, 0, 0.0
            session.landing = (self.exposed_bytes, int(prepared.get("staged_bytes", 0)))
            # An adapter has no stage to apply: prepared is all it needs to commit.
            self.state = ReceiverState.APPLIED if request.adapter else ReceiverState.PREPARED
            return {**self.status(), **prepared}

    @_counted
    async def apply(self, request: ApplyRequest) -> dict[str, Any]:
        async with self._lock:
            session = await self._own(request.session)
            self._require(ReceiverState.PREPARED, ReceiverState.APPLIED)
            self._require_pending(request.generation)
            refusal = stage_refusal(request.stage, session.stages, session.stages_done)
            if refusal is not None:
                raise ReceiverError(*refusal)
            before, self.state = self.state, ReceiverState.APPLYING
            started = time.perf_counter()
            try:
                applied = await self.backend.apply(request)
            except ReceiverError as refused:
                if refused.status < 500:  # refused before anything was staged
                    self.state = before
                    raise
                error: Exception = refused
            except TimeoutError as failure:
                self._out_of_step(f"apply stage {request.stage}: {failure}")
                raise ReceiverError(504, "worker_timeout", self.last_error or "") from failure
            except Exception as failure:
                error = failure
            else:
                self._stage_done(session, applied, time.perf_counter() - started)
                self.state = ReceiverState.APPLIED
                return {**self.status(), **applied}
            raise await self._staging_failed("apply_failed", f"apply stage {request.stage}", error)

    async def _staging_failed(self, code: str, step: str, error: Exception) -> ReceiverError:
        """Drop what is staged after ``step`` failed: the engine serves its old generation
        (or rebuilds, if live parameters were receive regions); the error to raise."""
        served = self.generation
        await self._release("failed", f"{step} failed: {error}")
        outcome = (
            f"the engine serves generation {served} again"
            if self.state is ReceiverState.SERVING
            else "live parameters were receive regions: the engine admits no request and "
            "rebuilds itself from the Store's active generation"
        )
        return ReceiverError(502, code, f"{error}; the staged generation was dropped and {outcome}")

    @_counted
    async def commit(self, request: CommitRequest) -> dict[str, Any]:
        async with self._lock:
            if self.session is None:
                ended = self._ended(request.session)
                if (
                    ended is not None
                    and ended.outcome == "committed"
                    and ended.generation == request.generation
                ):
                    return {**self.status(), "already": "committed"}
            session = await self._own(request.session)
            self._require(ReceiverState.APPLIED)
            self._require_pending(request.generation)
            if session.stages_done != session.stages:
                raise ReceiverError(
                    409,
                    "stages_incomplete",
                    f"{session.stages_done} of {session.stages} stages ran; apply the rest first",
                )
            assert self._pending_record is not None
            if session.adapter_base is not None:
                return await self._commit_adapter(session, self._pending_record)
            try:  # while the engine still serves (unless it received in place)
                reference = await self._timed(
                    "check_reference", self.backend.expect(request.generation)
                )
            except ReceiverError as refused:
                if refused.status < 500:  # every rank refused: nothing changed
                    raise
                raise await self._staging_failed(
                    "check_failed", "building the landing check", refused
                ) from refused
            except TimeoutError as failure:
                self._out_of_step(f"the landing check of {request.generation}: {failure}")
                raise ReceiverError(504, "worker_timeout", self.last_error or "") from failure
            except Exception as failure:
                raise await self._staging_failed(
                    "check_failed", "building the landing check", failure
                ) from failure
            try:
                pause_s = await self._pause(session)
            except ReceiverError as refused:
                served = self.generation
                await self._release("failed", f"pausing to land failed: {refused.detail}")
                raise ReceiverError(
                    refused.status,
                    refused.code,
                    f"{refused.detail}; the staged generation was dropped and the engine serves "
                    f"generation {served} again",
                ) from refused
            # Adapters bound to the base this commit replaces go before the engine resumes.
            dropped = await self._rebase_adapters(self._pending_record)
            self.state = ReceiverState.COMMITTING
            version = weight_version(self.model, self._pending_record)
            try:
                committed = await self._timed(
                    "commit", self.backend.commit(request.generation, version)
                )
            except ReceiverError as refused:
                if refused.status >= 500:
                    raise
                self.state = ReceiverState.APPLIED  # every rank refused before landing
                raise
            except TimeoutError as error:
                self._out_of_step(f"commit of generation {request.generation}: {error}")
                raise ReceiverError(504, "worker_timeout", self.last_error or "") from error
            except Exception as error:
                self._end_session("broken")
                self._break(f"commit of generation {request.generation} failed: {error}")
                raise ReceiverError(
                    500,
                    "commit_failed",
                    f"{error}; live weights may be partly written: the engine admits no "
                    "request and rebuilds itself from the Store's active generation",
                ) from error
            self.served = self._pending_record
            self._end_session("committed")
            self.state = ReceiverState.SERVING
            self.last_error = None
            landing = {
                "check_reference_s": reference["seconds"],
                "pause_s": pause_s,
                **committed.get("landing", {}),
            }
            return {**self.status(), **committed, "landing": landing, "adapters_dropped": dropped}

    @_counted
    async def abort(self, request: SessionRequest) -> dict[str, Any]:
        async with self._lock:
            await self._expire_if_due()
            if self.session is None:
                ended = self._ended(request.session)
                if ended is not None and ended.outcome == "committed":
                    raise ReceiverError(
                        409,
                        "session_committed",
                        f"session {request.session} committed generation {ended.generation}; "
                        "an abort cannot undo it",
                    )
                return self.status()  # nothing held: the abort has nothing left to do
            await self._own(request.session)
            self._require(*HELD)
            await self._release("aborted", None)
            return self.status()

    # -- rebuild --------------------------------------------------------------------------
    def _break(self, reason: str, *, rebuild: bool = True) -> None:
        self.state = ReceiverState.BROKEN
        self.last_error = reason
        logger.error("mooncake: engine broken (%s)", reason)
        if rebuild and self.auto_rebuild:
            self._spawn(self._rebuild_until_serving())

    def _out_of_step(self, reason: str) -> None:
        """A worker call timed out: its late reply may be taken for the next call's, so no
        further worker call (not even a rebuild) can be trusted. Readiness stays 503 until
        the engine is restarted (it then loads the active generation from the Store)."""
        self._end_session("broken")
        self._break(
            f"{reason}; the engine's worker calls may be out of step: restart it",
            rebuild=False,
        )

    async def _rebuild_until_serving(self) -> None:
        attempt = 0
        while self.state is ReceiverState.BROKEN:
            if attempt:
                await asyncio.sleep(REBUILD_BACKOFF_S[min(attempt, len(REBUILD_BACKOFF_S)) - 1])
            attempt += 1
            with contextlib.suppress(ReceiverError):
                await self.rebuild()

    async def load_adapter(self, request: AdapterRequest) -> dict[str, Any]:
        """A generation of the engine's LoRA adapter made resident (``engine_ext.lora``):
        the base and the serving state are untouched, so it runs beside any session."""
        adapters = self._require_adapters()
        return {**self.status(), **await adapters.load(request.generation)}

    def _require_adapters(self) -> ResidentAdapters:
        if self.adapters is None:
            raise ReceiverError(
                409,
                "lora_disabled",
                'this engine keeps no LoRA adapter: start it with --enable-lora and "lora": '
                "<adapter name> in --model-loader-extra-config (docs/lora.md)",
            )
        return self.adapters

    async def _rebase_adapters(self, record: ServedRecord) -> list[int]:
        """The engine is about to serve ``record`` of its model: resident adapters bound to
        any other base are evicted, and their names dropped (``ResidentAdapters.rebased``)."""
        if self.adapters is None or not self.adapters.generations:
            return []
        try:
            dropped = await self.adapters.rebased((self.model, record.generation))
        except Exception as error:  # names go first: a failed eviction leaves none to select
            logger.warning("mooncake: evicting adapters of another base failed: %s", error)
            return []
        if dropped:
            logger.warning(
                "mooncake: adapter generations %s of %s were bound to another base than "
                "generation %d: evicted; publish adapters bound to it",
                dropped,
                self.adapters.policy,
                record.generation,
            )
        return dropped

    async def _commit_adapter(self, session: Session, record: ServedRecord) -> dict[str, Any]:
        """Commit of an adapter generation (called under the lock): pause (short: nothing
        is copied but the adapter), every rank makes it resident and compares it with a
        fresh build, the names move, resume. A failure costs the adapter alone: the base
        was never touched, so the engine resumes serving with the adapters it had."""
        adapters = self._require_adapters()
        pause_s = await self._pause(session)
        self.state = ReceiverState.COMMITTING
        try:
            committed = await self._timed("commit", self.backend.commit_adapter(record.generation))
        except TimeoutError as error:
            self._out_of_step(f"commit of adapter generation {record.generation}: {error}")
            raise ReceiverError(504, "worker_timeout", self.last_error or "") from error
        except Exception as error:
            with contextlib.suppress(Exception):
                await adapters.discard(record.generation)
            await self._release("failed", f"adapter commit failed: {error}")
            code = error.code if isinstance(error, ReceiverError) else "commit_failed"
            raise ReceiverError(
                502,
                code,
                f"{error}; the adapter was dropped and the engine serves the adapters it had",
            ) from error
        assert session.adapter_base is not None
        landed = await adapters.landed(record, session.adapter_base)
        self._end_session("committed")
        self.state = ReceiverState.SERVING
        self.last_error = None
        landing = {**committed.get("landing", {}), "pause_s": pause_s}
        return {**self.status(), **committed, **landed, "landing": landing}

    @_counted
    async def rebuild(self) -> dict[str, Any]:
        """Reload the Store's active generation into a broken engine and serve it."""
        async with self._lock:
            self._require(ReceiverState.BROKEN)
            self.state = ReceiverState.REBUILDING
            try:
                self.served = await self._timed("rebuild", self.backend.rebuild(self.model))
            except Exception as error:
                self.state = ReceiverState.BROKEN
                self.last_error = f"rebuild failed: {error}"
                logger.warning("mooncake: %s", self.last_error)
                raise ReceiverError(502, "rebuild_failed", self.last_error) from error
            await self._rebase_adapters(self.served)
            self.figures.rebuilds += 1
            self.state = ReceiverState.SERVING
            self.last_error = None
            logger.info("mooncake: rebuilt; serving generation %d", self.generation)
            return self.status()
