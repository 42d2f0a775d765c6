"""The adapter generations an engine keeps beside its base, and the names requests use.

    an update session (the coordinator: drain, prepare, commit) or, at start and for an
    operator, POST /mooncake/adapter {generation?} (default: the Store's active one)
    --every rank: worker ``prepare``/``commit`` or ``adapter`` (read from the Store,
    checked, resident, compared with a fresh build, :mod:`engine_ext.adapting`)-->
    names: ``POLICY@G`` for every resident generation, ``POLICY`` for the newest landed
    --oldest beyond ``versions``: worker ``evict_adapter``, its name dropped

Why both names: an async trainer finishes old rollouts on their own policy (``POLICY@G``)
while new ones take the plain name. Landing touches neither the base nor a resident
adapter, and the plain name moves in one assignment once every rank holds the new one, so
no request ever sees a half-loaded adapter; the session's pause (at commit, short) is what
makes an update's switch a point that requests in flight see whole.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine_ext.backend import WorkerBackend
from engine_ext.served import ServedRecord
from engine_ext.sessions import ReceiverError


class AdapterNames(Protocol):
    """The engine's own table of request names for LoRA adapters."""

    def register(self, name: str, generation: int) -> None: ...

    def drop(self, name: str) -> None: ...

    def resident(self) -> dict[str, int]:
        """Every name this keeper registered, and the generation it serves."""
        ...


def versioned(policy: str, generation: int) -> str:
    return f"{policy}@{generation}"


def bound_to(replies: list[dict[str, Any]]) -> tuple[str, int]:
    """The base an adapter was built against, as its ranks' replies name it."""
    name, generation = replies[0]["base"]
    return str(name), int(generation)


class ResidentAdapters:
    """Up to ``versions`` generations of adapter ``policy`` resident on every rank, and the
    record of the newest (what an adapter update must supersede)."""

    def __init__(
        self, backend: WorkerBackend, policy: str, versions: int, names: AdapterNames
    ) -> None:
        if type(versions) is not int or versions < 1:
            raise ValueError(f"lora_versions must be an integer >= 1, got {versions!r}")
        self.backend, self.policy, self.versions, self.names = backend, policy, versions, names
        self.generations: list[int] = []  # resident, oldest first
        self.bases: dict[int, tuple[str, int]] = {}  # each resident one's base
        self.served = ServedRecord()

    def status(self) -> dict[str, Any]:
        """The adapter's name, the newest generation landed (its fence) and every resident
        name: what the coordinator skips or supersedes."""
        return {
            "model": self.policy,
            "generation": self.served.generation,
            "fence": self.served.fence,
            "resident": self.names.resident(),
        }

    async def load(self, generation: int | None = None) -> dict[str, Any]:
        """Make ``generation`` (default: the Store's active one) resident and the plain
        name's, outside any session (an engine starting); a refusal on any rank changes no
        name and evicts nothing."""
        replies = await self.backend.call_workers("adapter", self.policy, generation)
        failed = [r for r in replies if not r.get("ok")]
        if failed:
            refused = failed[0].get("refused") or {"status": 502, "code": "adapter_failed"}
            raise ReceiverError(refused["status"], refused["code"], failed[0].get("error", ""))
        loaded = ServedRecord(int(replies[0]["generation"]), int(replies[0].get("fence", 0)))
        return {
            **await self.landed(loaded, bound_to(replies)),
            "adapter_bytes": sum(r.get("adapter_bytes", 0) for r in replies),
        }

    async def landed(self, record: ServedRecord, base: tuple[str, int]) -> dict[str, Any]:
        """``record``'s generation (bound to ``base``) is resident on every rank: name it,
        move the plain name to it (one assignment: no request sees a half-loaded adapter),
        evict the oldest beyond ``versions``."""
        loaded = record.generation
        if loaded in self.generations:
            self.generations.remove(loaded)
        self.generations.append(loaded)
        self.bases[loaded] = base
        self.names.register(versioned(self.policy, loaded), loaded)
        self.names.register(self.policy, loaded)
        self.served = record
        while len(self.generations) > self.versions:
            await self._evict(self.generations[0])
        return {"adapter": self.policy, "generation": loaded, "resident": self.names.resident()}

    async def rebased(self, base: tuple[str, int]) -> list[int]:
        """The engine now serves ``base``: evict every resident generation bound to another
        (an adapter applies to the weights it was trained on, so it would serve a model
        nobody trained), its names with it; the generations evicted."""
        stale = [g for g in self.generations if self.bases[g] != base]
        for generation in stale:
            await self._evict(generation)
        if stale and self.generations:  # the plain name: the newest left
            self.names.register(self.policy, self.generations[-1])
        return stale

    async def _evict(self, generation: int) -> None:
        self.generations.remove(generation)
        del self.bases[generation]
        self.names.drop(versioned(self.policy, generation))
        if self.names.resident().get(self.policy) == generation:
            self.names.drop(self.policy)
        await self.backend.call_workers("evict_adapter", generation)

    async def discard(self, generation: int) -> None:
        """A commit that failed on some rank: drop what the others made resident (never
        named, never served)."""
        if generation not in self.generations:
            await self.backend.call_workers("evict_adapter", generation)
