"""Which engines a router dispatches to, changed one serialized step at a time.

An update takes engines out of rotation and re-admits them when it ends; meanwhile a scale-
down may retire one of them for good. Re-admitting a retired engine would send traffic to a
machine being torn down, so "is it still wanted?" and "add it" must be one step with no gap
in between. Every change here runs under one lock per router, a leased claim in the Store
(:class:`~mooncake_rl.transport.claims.KeyClaims`), so the CLI, the bridge and a scale-down
in other processes are serialized against each other:

- :meth:`Rotation.take_out` records, per engine it removes, an *out* entry naming the update
  (its tag) in the router's record in the Store;
- :meth:`Rotation.readmit` adds back only the engines whose entry still names that update;
- :meth:`Rotation.retire` (scale-down) drops the entry and removes the engine, so a running
  update's re-admission skips it;
- :meth:`Rotation.admit` (scale-up) refuses an engine an update holds out, unless forced
  (the update's coordinator died: its entry is stale).

Engines that were not in the router's list when the update began are not taken out, and so
never added: they were not wanted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

from mooncake_rl.errors import MooncakeRLError, ObjectNotFound
from mooncake_rl.generations.keys import NAMESPACE
from mooncake_rl.router.adapters import Router, RouterError, engine_url
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.claims import Claim, KeyClaims

LOCK_LEASE_S = 30.0
"""The lock is renewed while held; a holder that died frees it after this long."""


class RotationBusy(RouterError):
    """Another process held the router's rotation lock for the whole wait."""


class EngineHeldOut(MooncakeRLError):
    """``admit`` of an engine that a running update holds out of rotation."""


@dataclass(frozen=True)
class OutEntry:
    """One engine out of rotation for an update."""

    update: str
    holder: str
    since: float


def router_key(router_url: str) -> str:
    digest = hashlib.sha256(router_url.encode()).hexdigest()[:16]
    return f"{NAMESPACE}/router/{digest}"


class Rotation:
    """The rotation of one router; ``holder`` names this process in entries and logs."""

    def __init__(
        self,
        router: Router,
        store: StoreClient,
        *,
        holder: str,
        lock_wait_s: float = 60.0,
        lock_lease_s: float = LOCK_LEASE_S,
    ) -> None:
        self.router = router
        self.holder = holder
        self.lock_wait_s = lock_wait_s
        self._store = store
        self._key = router_key(router.spec.url)
        self._claims = KeyClaims(store, owner=holder, lease_s=lock_lease_s)

    # -- the record of engines held out ---------------------------------------------------
    def held_out(self) -> dict[str, OutEntry]:
        """Engines out of rotation for an update, as the Store records them."""
        try:
            raw = json.loads(self._store.get_bytes(f"{self._key}/out"))
        except ObjectNotFound:
            return {}
        except ValueError as error:
            raise RouterError(f"rotation record {self._key}/out is not JSON: {error}") from None
        return {url: OutEntry(**entry) for url, entry in raw.items()}

    def _write(self, entries: dict[str, OutEntry]) -> None:
        body = {url: asdict(entry) for url, entry in sorted(entries.items())}
        self._store.upsert_bytes(f"{self._key}/out", json.dumps(body).encode())

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        deadline = time.monotonic() + self.lock_wait_s
        label = f"rotation lock of router {self.router.spec.url}"
        claim: Claim | None
        while (claim := self._claims.claim(f"{self._key}/lock", label, Claim)) is None:
            if time.monotonic() >= deadline:
                raise RotationBusy(
                    f"the {label} stayed held for {self.lock_wait_s:g}s (another update or "
                    f"scale-down is changing it; a dead holder frees it within "
                    f"{self._claims.lease_s:g}s)"
                )
            time.sleep(0.05)
        claim.hold(lambda: True)
        try:
            yield
        finally:
            claim.release()

    # -- the bracket ------------------------------------------------------------------------
    def take_out(
        self, engines: Sequence[str], update: str, taken: list[str], *, leave_last: bool = False
    ) -> None:
        """Remove the listed ``engines`` from rotation for ``update``; each engine is appended
        to ``taken`` once its entry is recorded, so a failure part-way leaves ``taken``
        naming exactly what :meth:`readmit` must bring back.

        ``leave_last`` (keep mode): if removing them would leave the router no worker, none
        is removed. A paused vLLM or SGLang engine queues the requests it is sent until it
        resumes, so they wait out the landing, as the requests it froze do, where the
        router would answer 503 with no worker at all."""
        with self._locked():
            listed = set(self.router.workers())
            leaving = [e for e in map(engine_url, engines) if e in listed]
            if leave_last and not listed - set(leaving):
                return
            entries = self.held_out()
            for engine in leaving:
                entries[engine] = OutEntry(update, self.holder, time.time())
                self._write(entries)
                taken.append(engine)
                self.router.remove(engine)

    def readmit(self, engines: Sequence[str], update: str) -> dict[str, str]:
        """Add back each engine still held out for ``update``; never raises.

        Returns per engine ``readmitted``, ``retired`` (removed meanwhile: skipped) or
        ``failed: <why>`` (its entry stays, so ``router list`` shows it out).
        """
        outcome: dict[str, str] = {}
        try:
            with self._locked():
                entries = self.held_out()
                for engine in engines:
                    entry = entries.get(engine)
                    if entry is None or entry.update != update:
                        outcome[engine] = "retired"
                        continue
                    try:
                        self.router.add(engine)
                    except MooncakeRLError as error:
                        outcome[engine] = f"failed: {error}"
                        continue
                    del entries[engine]
                    self._write(entries)
                    outcome[engine] = "readmitted"
        except MooncakeRLError as error:
            for engine in engines:
                outcome.setdefault(engine, f"failed: {error}")
        return outcome

    # -- membership (scale-up, scale-down) --------------------------------------------------
    def admit(self, engine: str, *, force: bool = False) -> None:
        engine = engine_url(engine)
        with self._locked():
            entries = self.held_out()
            entry = entries.get(engine)
            if entry is not None and not force:
                raise EngineHeldOut(
                    f"{engine} is out of rotation for update {entry.update} (by {entry.holder} "
                    f"since {time.ctime(entry.since)}); that update re-admits it when it ends. "
                    "If its coordinator died, add it with --force"
                )
            self.router.add(engine)
            if entry is not None:
                del entries[engine]
                self._write(entries)

    def retire(self, engine: str) -> None:
        """Remove ``engine`` for good: an update holding it out will not re-add it."""
        engine = engine_url(engine)
        with self._locked():
            entries = self.held_out()
            if entries.pop(engine, None) is not None:
                self._write(entries)
            self.router.remove(engine)
