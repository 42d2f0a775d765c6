"""Serving leases: an engine keeps renewing a record of the generation it serves.

GC never deletes a generation under an unexpired lease, so a generation stays in the Store
while any engine serves it. The protocol GC's grace period relies on
(:func:`mooncake_rl.generations.gc.removable`):

1. **Lease before read.** A starting engine reads the active record, writes its lease on
   that generation, and only then reads the generation's objects
   (:func:`lease_active`). If more than ``retire_grace_s`` passed between reading the
   active record and writing the lease, GC may already have judged the generation
   removable without seeing the lease: the engine re-reads the active record and retries.
2. **The update's own lease.** From prepare to commit or abort, each engine also leases the
   generation it is being updated to (:func:`update_lease_id`), so GC spares it while
   engines read it even once it is no longer active: a worker writes it at prepare before it
   checks the generation's objects are whole, the renewal task renews it while the session
   holds a prepared generation, and the worker releases it at abort, or at commit once it
   moved the serving lease onto the generation. A coordinator that dies leaves it to the
   session's expiry (an abort); an engine that dies, to its TTL.
3. **One lease id per engine.** The loader and the serving renewal task write the same
   lease record (:func:`engine_identity`), so the renewal task simply continues the lease
   the loader took, and after a commit moves it to the new generation.

Engine identity: ``MOONCAKE_RL_ENGINE_ID`` when set (set it when one host runs engines
launched with a config file, or any way that does not put ``--port`` on the command line);
else ``host:port`` of the engine's HTTP server, as its endpoint plugin computes it. The
loader runs in worker processes, which see neither the server's arguments nor its plugin
objects: SGLang's ``launch_server`` hook exports the id in ``MOONCAKE_RL_ENGINE_ID`` before
the schedulers start; under vLLM the loader reads ``--host``/``--port`` from the command
line, which worker processes inherit (``multiprocessing`` passes ``sys.argv`` to spawned
children). A loader that finds neither uses a per-process id; that lease is not continued
by the serving task and simply expires.

Renewal runs on the engine's event loop; a failed renewal is logged and retried at the next
tick (the lease simply expires if the engine goes away). Lease expiry uses wall-clock time,
so engine and GC hosts need synchronized clocks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence

from engine_ext.receiver import Receiver
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.leases import Lease, LeaseBook, lease_book
from mooncake_rl.generations.registry import ActiveRecord, require_active
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

logger = logging.getLogger(__name__)

ENGINE_ID_ENV = "MOONCAKE_RL_ENGINE_ID"
LEASE_ATTEMPTS = 5
"""Tries at taking a lease within the grace period before the loader gives up."""
STARTUP_HOLD_TTLS = 5
"""A finished load holds its lease this many ``lease_ttl_s``: the engine's startup (memory
profiling, graph capture) runs between the loader's last renewal and the serving task's
first, and the lease must not lapse there."""
CHECK_S = 1.0
"""How often the renewal task looks for a committed generation (a local read, no I/O)."""


class LeaseNotTaken(InvariantViolation):
    """No lease could be written within the grace period after reading the active record."""


def lease_id(engine_id: str) -> str:
    return engine_id.replace("/", "_")


def update_lease_id(engine_id: str) -> str:
    """The lease an engine holds on the generation an update brings, beside its serving one."""
    return f"{lease_id(engine_id)}.update"


def engine_identity(host: str | None, port: int | str) -> str:
    """The engine's id: ``MOONCAKE_RL_ENGINE_ID``, else its server's ``host:port``."""
    return os.environ.get(ENGINE_ID_ENV) or f"{host or '127.0.0.1'}:{port}"


def export_engine_identity(host: str | None, port: int | str) -> str:
    """Put the engine's id in the environment, for worker processes started after this."""
    return os.environ.setdefault(ENGINE_ID_ENV, engine_identity(host, port))


def _flag(argv: Sequence[str], name: str) -> str | None:
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def loader_engine_id(argv: Sequence[str] | None = None) -> str:
    """The id a loader writes its lease under (see the module docstring)."""
    if os.environ.get(ENGINE_ID_ENV):
        return os.environ[ENGINE_ID_ENV]
    args = sys.argv if argv is None else argv
    port = _flag(args, "--port")
    if port is not None:
        return engine_identity(_flag(args, "--host"), port)
    return f"loader-{socket.gethostname()}-{os.getpid()}"


def lease_active(
    store: StoreClient,
    model: str,
    engine_id: str,
    settings: Settings,
    *,
    what: str = "cannot load weights from the Store",
    clock: Callable[[], float] = time.time,
) -> tuple[ActiveRecord, Lease]:
    """Read the active record, then lease its generation within ``retire_grace_s``.

    Raises :class:`LeaseNotTaken` after :data:`LEASE_ATTEMPTS` slow tries (a Store so slow
    that a lease write takes longer than the grace cannot protect what is read).
    """
    book = lease_book(store, model)
    grace = settings.retire_grace_s
    elapsed = 0.0
    for _ in range(LEASE_ATTEMPTS):
        started = clock()
        record = require_active(store, model, what)
        lease = book.renew(lease_id(engine_id), record.generation, settings.lease_ttl_s)
        elapsed = clock() - started
        if elapsed < grace:
            return record, lease
        logger.warning(
            "mooncake: leasing generation %d of %s took %.2fs (grace %.2fs): re-reading",
            record.generation,
            model,
            elapsed,
            grace,
        )
    raise LeaseNotTaken(
        f"{what}: could not lease the active generation of {model} within "
        f"retire_grace_s={grace}s ({LEASE_ATTEMPTS} tries, last {elapsed:.2f}s)"
    )


async def renew_leases(
    receiver: Receiver, settings: Settings, engine_id: str | None = None
) -> None:
    """Renew every ``lease_ttl_s / 3`` seconds, and at once when the served generation
    changes, for as long as the engine runs; release the lease when cancelled. The update
    lease is renewed alike while a session holds a prepared generation."""
    store = await asyncio.to_thread(StoreClient, settings.with_overrides(segment_bytes=0))
    book = lease_book(store, receiver.model)
    holder = lease_id(engine_id or receiver.backend.engine_id)
    serving = _Renewal(book, holder, settings.lease_ttl_s)
    update = _Renewal(book, update_lease_id(engine_id or receiver.backend.engine_id), serving.ttl_s)
    try:
        while True:
            await serving.follow(lambda: receiver.generation or None)
            if receiver.pending is not None:
                await update.follow(lambda: receiver.pending)
            await asyncio.sleep(min(CHECK_S, settings.lease_ttl_s / 3))
    finally:
        try:
            await asyncio.to_thread(book.release, holder)
        except Exception:  # best effort: an unreleased lease expires by itself
            logger.warning("mooncake: lease release failed", exc_info=True)
        await asyncio.to_thread(store.close)


class _Renewal:
    """One lease renewed every third of its TTL, and at once when its generation changes."""

    def __init__(self, book: LeaseBook, holder: str, ttl_s: float) -> None:
        self.book, self.holder, self.ttl_s = book, holder, ttl_s
        self.generation: int | None = None
        self.at = 0.0

    async def follow(self, current: Callable[[], int | None]) -> None:
        """Renew on ``current()``'s generation when due; if that changed to none while the
        write ran (the worker released the lease meanwhile), release it again."""
        generation = current()
        due = time.monotonic() - self.at >= self.ttl_s / 3
        if generation is None or not (due or generation != self.generation):
            return
        try:
            await asyncio.to_thread(self.book.renew, self.holder, generation, self.ttl_s)
            self.generation, self.at = generation, time.monotonic()
            if current() is None:
                await asyncio.to_thread(self.book.release, self.holder)
        except Exception:  # the Store may be briefly unreachable; retry next tick
            logger.warning("mooncake: renewing lease %s failed", self.holder, exc_info=True)
