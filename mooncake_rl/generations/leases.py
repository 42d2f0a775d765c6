"""Serving leases: which generation each engine serves or is being updated to, so GC keeps it.

    engine (loader, serving task, update worker) --renew(holder, generation, ttl)--> a lease
    GC --live_generations()--> the generations no collection may remove

Two books, one contract (:func:`lease_book` picks by the Store):

- **A plain master** (:class:`StoreLeaseBook`): a Store record per holder, upserted at each
  renewal, with its expiry in wall-clock time (engine and GC hosts need NTP). The Store has
  no key listing, so holders are found through the model's engine slots, each created
  exclusively, so concurrent registrations never lose one another.
- **A durable Store** (:class:`EtcdLeaseBook`): a key per holder in the Store's own etcd,
  attached to an etcd lease of the TTL. A renewal of the same generation is an etcd
  keep-alive, which adds nothing to etcd's history; a Store record's upsert adds an entry
  to the masters' operation log, which is never pruned (about 340 bytes per renewal: 100
  engines renewing every 20 s filled a 2 GiB quota in about 8 days). etcd deletes the key
  when its lease ends, so a listed lease is live, with no clock involved.
"""

from __future__ import annotations

import json
import math
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from mooncake_rl import etcd
from mooncake_rl.errors import (
    InvariantViolation,
    MooncakeError,
    ObjectAlreadyExists,
    ObjectNotFound,
)
from mooncake_rl.generations.keys import engines_key, etcd_leases_prefix, lease_key
from mooncake_rl.store import StoreClient


@dataclass(frozen=True)
class Lease:
    engine_id: str
    generation: int
    expires_at: float
    """Wall-clock expiry; ``inf`` for an etcd lease, which etcd removes when it ends."""

    def live(self, now: float) -> bool:
        return self.expires_at > now


class LeaseBook(ABC):
    """One model's serving leases."""

    @abstractmethod
    def renew(
        self, engine_id: str, generation: int, ttl_s: float, now: float | None = None
    ) -> Lease: ...

    @abstractmethod
    def release(self, engine_id: str) -> None: ...

    @abstractmethod
    def leases(self) -> dict[str, Lease]: ...

    def live_generations(self, now: float | None = None) -> set[int]:
        """The generations some unexpired lease names."""
        moment = time.time() if now is None else now
        return {lease.generation for lease in self.leases().values() if lease.live(moment)}


def lease_book(store: StoreClient, model: str) -> LeaseBook:
    """The book ``store``'s kind of Store keeps leases in."""
    if store.durable:
        return EtcdLeaseBook(store.settings.master, store.settings.cluster_id, model)
    return StoreLeaseBook(store, model)


def check_holder(engine_id: str) -> None:
    if not engine_id or "/" in engine_id:
        raise InvariantViolation(f"engine id {engine_id!r} must be non-empty without '/'")


ENGINE_SLOT_PROBE = 64
"""Engine slots probed per existence check when listing lease holders."""


class StoreLeaseBook(LeaseBook):
    """Leases as Store records, found through engine slots: ``engines/1``, ``engines/2``,
    ... each created exclusively (the master arbitrates) and naming one engine, so two
    engines that register at once both get listed, and a lease is visible to GC as soon as
    ``renew`` returns. Slots are never removed (a restarted engine finds and reuses its own).
    """

    def __init__(self, store: StoreClient, model: str) -> None:
        self.store = store
        self.model = model
        self._registered: set[str] = set()

    def _slot(self, number: int) -> str:
        return f"{engines_key(self.model)}/{number}"

    def _slot_owner(self, number: int) -> str | None:
        for _ in range(20):  # a slot being created is briefly not readable yet
            try:
                return self.store.get_bytes(self._slot(number)).decode()
            except ObjectNotFound:
                return None
            except MooncakeError:
                time.sleep(0.01)
        return None

    def _slots(self) -> list[str | None]:
        """Every slot's engine (None: unreadable), in slot order."""
        owners: list[str | None] = []
        start = 1
        while True:
            numbers = range(start, start + ENGINE_SLOT_PROBE)
            present = self.store.exists([self._slot(n) for n in numbers])
            for number, exists in zip(numbers, present, strict=True):
                if not exists:
                    return owners
                owners.append(self._slot_owner(number))
            start += ENGINE_SLOT_PROBE

    def _engines(self) -> list[str]:
        return sorted({owner for owner in self._slots() if owner})

    def _register(self, engine_id: str) -> None:
        if engine_id in self._registered:
            return
        while True:
            owners = self._slots()
            if engine_id in owners:
                break
            try:
                self.store.create_exclusive(self._slot(len(owners) + 1), engine_id.encode())
                break
            except ObjectAlreadyExists:
                continue  # another engine took that slot first: look again
        self._registered.add(engine_id)

    def renew(
        self, engine_id: str, generation: int, ttl_s: float, now: float | None = None
    ) -> Lease:
        check_holder(engine_id)
        lease = Lease(engine_id, generation, (now or time.time()) + ttl_s)
        self.store.upsert_bytes(
            lease_key(self.model, engine_id), json.dumps(lease.__dict__).encode()
        )
        self._register(engine_id)
        return lease

    def release(self, engine_id: str) -> None:
        self.store.remove([lease_key(self.model, engine_id)], force=True)

    def leases(self) -> dict[str, Lease]:
        found: dict[str, Lease] = {}
        for engine_id in self._engines():
            try:
                found[engine_id] = Lease(
                    **json.loads(self.store.get_bytes(lease_key(self.model, engine_id)))
                )
            except ObjectNotFound:
                continue
        return found


@dataclass
class _Held:
    """The etcd lease this process keeps a holder's key on, and what the key says."""

    lease: int
    generation: int
    ttl_s: int


_HELD: dict[str, _Held] = {}
"""Per etcd key: the lease this process holds it on. Module-wide, because engines make a
book per call (the loader, the serving task and the update worker share one holder)."""
_HELD_LOCK = threading.Lock()


class EtcdLeaseBook(LeaseBook):
    """Leases as etcd keys on etcd leases, in the durable Store's etcd."""

    def __init__(self, master: str, cluster_id: str, model: str) -> None:
        self.endpoints = master.removeprefix(etcd.ETCD_SCHEME)
        self.prefix = etcd_leases_prefix(cluster_id, model)

    def renew(
        self, engine_id: str, generation: int, ttl_s: float, now: float | None = None
    ) -> Lease:
        """Keep the holder's etcd lease alive while it names ``generation`` with this TTL;
        otherwise (a new generation, another TTL, or a lease etcd already ended) write the
        key on a fresh lease. The previous lease, keyless now, runs out by itself."""
        check_holder(engine_id)
        key, ttl = self.prefix + engine_id, max(1, math.ceil(ttl_s))
        with _HELD_LOCK:
            held = _HELD.get(key)
        kept = (
            held is not None
            and (held.generation, held.ttl_s) == (generation, ttl)
            and etcd.keep_alive(self.endpoints, held.lease)
        )
        if not kept:
            lease = etcd.grant(self.endpoints, ttl)
            body = {"engine_id": engine_id, "generation": generation}
            etcd.put(self.endpoints, key, json.dumps(body), lease)
            with _HELD_LOCK:
                _HELD[key] = _Held(lease, generation, ttl)
        return Lease(engine_id, generation, math.inf)

    def release(self, engine_id: str) -> None:
        key = self.prefix + engine_id
        with _HELD_LOCK:
            _HELD.pop(key, None)
        etcd.delete(self.endpoints, key)

    def leases(self) -> dict[str, Lease]:
        found = {}
        for key, value in etcd.prefixed(self.endpoints, self.prefix).items():
            body = json.loads(value)
            found[key.removeprefix(self.prefix)] = Lease(
                body["engine_id"], int(body["generation"]), math.inf
            )
        return found
