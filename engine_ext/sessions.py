"""Update sessions: which one holds the engine, until when, and how each one ended.

Drain opens a :class:`Session`; every later call names it and renews its lease
(:meth:`SessionKeeper._own`), and a call from another session is refused. Commit, abort or
the lease's expiry ends it: the end is kept (:class:`SessionEnd`) so that a retried commit
or abort answers the same, and any end but commit releases the engine
(:meth:`SessionKeeper._release`): it serves its old generation again, or, if live
parameters were receive regions of the session, it breaks and rebuilds from the Store. A
lease that runs out with no further call is caught by a watcher task
(:meth:`SessionKeeper._watch`).

:class:`SessionKeeper` is the half of :class:`~engine_ext.receiver.Receiver` that keeps
this between calls, with the engine's state and the status it reports; the receiver's
routes, the state machine's transitions, are the other half.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal

from engine_ext.served import ServedRecord
from mooncake_rl.figures import UpdateFigures
from mooncake_rl.protocol import PROTOCOL_VERSION, DrainRequest

if TYPE_CHECKING:
    from engine_ext.lora import ResidentAdapters
    from engine_ext.receiver import EngineBackend

logger = logging.getLogger(__name__)
PLUGIN_VERSION = importlib.metadata.version("mooncake-rl")


class ReceiverState(StrEnum):
    SERVING = "serving"
    OPEN = "open"
    PREPARED = "prepared"
    APPLYING = "applying"
    APPLIED = "applied"
    COMMITTING = "committing"
    BROKEN = "broken"
    REBUILDING = "rebuilding"


HELD = (ReceiverState.OPEN, ReceiverState.PREPARED, ReceiverState.APPLIED)
"""States a session holds the engine in between calls: its lease expiry resolves them."""

Outcome = Literal["committed", "aborted", "failed", "expired", "broken"]


@dataclass(frozen=True)
class ReceiverError(Exception):
    """An update step refused or failed; becomes ``{"error": code, "detail": ...}``."""

    status: int
    code: str
    detail: str

    def __str__(self) -> str:
        return f"{self.code} ({self.status}): {self.detail}"


@dataclass
class Session:
    """The update session holding the engine: who, until when, and how far it got."""

    id: str
    holder: str
    ttl_s: float
    expires_at: float
    pause: DrainRequest
    """How the engine pauses when it must (to land; before an in-place apply)."""
    paused: bool = False
    adapter_base: tuple[str, int] | None = None
    """It brings a LoRA adapter generation (``engine_ext.adapting``), not weights: the base
    its ranks bound it to."""
    stages: int = 0
    stages_done: int = 0
    # For the figures: seconds its apply stages took, and the bytes its prepare said land
    # (in place, staged), counted as received once every stage ran.
    apply_s: float = 0.0
    landing: tuple[int, int] = (0, 0)

    def renew(self) -> None:
        self.expires_at = time.monotonic() + self.ttl_s

    def remaining_s(self) -> float:
        return self.expires_at - time.monotonic()

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "holder": self.holder,
            "ttl_s": self.ttl_s,
            "expires_in_s": round(self.remaining_s(), 3),
            "stages": self.stages,
            "stages_done": self.stages_done,
            "pause_mode": self.pause.mode,
            "paused": self.paused,
        }


@dataclass(frozen=True)
class SessionEnd:
    """How a session ended; kept so that retried commits and aborts answer the same."""

    id: str
    holder: str
    outcome: Outcome
    generation: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class SessionKeeper(ABC):
    """The receiver's state between calls: what the engine serves and is doing, the session
    holding it, and how sessions ended."""

    ENDED_KEPT = 64

    def __init__(
        self,
        backend: EngineBackend,
        model: str,
        served: ServedRecord,
        *,
        auto_rebuild: bool = True,
    ) -> None:
        self.backend = backend
        self.model = model
        self.served = served
        self.state = ReceiverState.SERVING
        self.auto_rebuild = auto_rebuild
        self.session: Session | None = None
        self.ended: deque[SessionEnd] = deque(maxlen=self.ENDED_KEPT)
        self.pending: int | None = None
        self._pending_record: ServedRecord | None = None
        # Live parameters are receive regions of the open session (see engine_ext.receiver).
        self.exposed_bytes = 0
        # The LoRA adapter generations kept beside the base (engine_ext.lora), if any.
        self.adapters: ResidentAdapters | None = None
        self.last_error: str | None = None
        # What updates did here (phase seconds, bytes, failures, ends, rebuilds): the
        # engine's mooncake_rl_* metrics, read at scrape time with status().
        self.figures = UpdateFigures()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def generation(self) -> int:
        return self.served.generation

    @property
    def paused(self) -> bool:
        """An update session paused generation (to land, or to receive in place)."""
        return self.session is not None and self.session.paused

    @property
    def ready(self) -> bool:
        """Serving a complete generation: what readiness probes and routers should see.
        An open session that has not paused stages beside the old generation, which serves."""
        if self.state is ReceiverState.SERVING:
            return True
        return self.state in (*HELD, ReceiverState.APPLYING) and not self.paused

    def status(self) -> dict[str, Any]:
        return {
            "engine_id": self.backend.engine_id,
            "protocol": PROTOCOL_VERSION,
            "plugin_version": PLUGIN_VERSION,
            "model": self.model,
            "generation": self.generation,
            "fence": self.served.fence,
            "incarnation": self.served.incarnation,
            "state": self.state.value,
            "ready": self.ready,
            "paused": self.paused,
            "engine_version": self.backend.engine_version,
            "pause_modes": list(self.backend.pause_modes),
            "pending_generation": self.pending,
            "session": self.session.to_json() if self.session else None,
            "last_session": self.ended[-1].to_json() if self.ended else None,
            "last_error": self.last_error,
            "rebuilds": self.figures.rebuilds,
            "exposed_bytes": self.exposed_bytes,
            "adapter": None if self.adapters is None else self.adapters.status(),
        }

    # -- the session holding the engine ---------------------------------------------------
    def _ended(self, session_id: str) -> SessionEnd | None:
        return next((e for e in reversed(self.ended) if e.id == session_id), None)

    def _held_by_other(self) -> ReceiverError:
        assert self.session is not None
        return ReceiverError(
            409,
            "session_held",
            f"engine is {self.state.value} for session {self.session.id} of "
            f"{self.session.holder!r} (lease ends in {max(0.0, self.session.remaining_s()):.1f}s); "
            "wait for that update to finish or for its lease to expire",
        )

    async def _own(self, session_id: str) -> Session:
        """The open session ``session_id`` (renewed), after resolving an expired lease."""
        await self._expire_if_due()
        if self.session is not None and self.session.id == session_id:
            self.session.renew()
            return self.session
        if self.session is not None:
            raise self._held_by_other()
        ended = self._ended(session_id)
        if ended is not None:
            raise ReceiverError(
                409,
                "session_ended",
                f"session {session_id} of {ended.holder!r} ended ({ended.outcome}); "
                "drain again with a new session id",
            )
        raise ReceiverError(
            409,
            "no_session",
            f"engine is {self.state.value} and holds no session {session_id}; "
            "drain opens an update session",
        )

    # -- session lifecycle ----------------------------------------------------------------
    def _end_session(self, outcome: Outcome) -> None:
        if self.session is not None:
            generation = self.pending if outcome == "committed" else self.generation
            self.ended.append(
                SessionEnd(self.session.id, self.session.holder, outcome, generation or 0)
            )
            self.figures.outcomes[outcome] += 1
        self.session = None
        self.pending = self._pending_record = None
        self.exposed_bytes = 0

    async def _release(self, outcome: Outcome, error: str | None = None) -> None:
        """Drop what is staged and serve the old generation again, or, if live parameters
        were exposed to the session's writes, rebuild from the Store."""
        exposed, paused = self.exposed_bytes, self.paused
        self._end_session(outcome)
        self.last_error = error
        try:
            await self.backend.abort()
            if exposed:
                self._break(
                    f"{error or f'session {outcome}'}; {exposed} bytes of live parameters were "
                    "receive regions of that update and may be partly written: rebuilding "
                    "from the Store's active generation"
                )
                return
            if paused:
                await self.backend.resume()
        except Exception as failure:  # the engine cannot say what it serves: rebuild it
            self._break(f"{error or outcome}; then resuming failed: {failure}")
            return
        self.state = ReceiverState.SERVING

    async def _expire_if_due(self) -> None:
        """Called under the lock: an expired session's engine goes back to serving."""
        session = self.session
        if session is None or session.remaining_s() > 0 or self.state not in HELD:
            return
        logger.warning(
            "mooncake: session %s of %r expired in state %s; serving generation %d again",
            session.id,
            session.holder,
            self.state.value,
            self.generation,
        )
        await self._release(
            "expired",
            f"session {session.id} of {session.holder!r} expired while {self.state.value}: "
            f"its coordinator stopped renewing; the engine serves generation "
            f"{self.generation} again",
        )

    async def _watch(self) -> None:
        """Enforce the session lease even when no further call ever arrives."""
        while (session := self.session) is not None:
            await asyncio.sleep(min(1.0, max(0.05, session.remaining_s())))
            if self.session is session and session.remaining_s() <= 0:
                async with self._lock:
                    await self._expire_if_due()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @abstractmethod
    def _break(self, reason: str, *, rebuild: bool = True) -> None:
        """The engine may serve a mix: BROKEN, and rebuilt from the Store (with ``rebuild``
        and auto-rebuild on)."""
