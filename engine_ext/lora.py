"""The adapter generations an engine keeps beside its base, and the names requests use.

    POST /mooncake/adapter {generation?} (the coordinator; at start, the Store's active one)
    --every rank: worker ``adapter`` (read from the Store, checked, resident, pinned)-->
    names: ``POLICY@G`` for every resident generation, ``POLICY`` for the newest loaded
    --oldest beyond ``versions``: worker ``evict_adapter``, its name dropped

Why both names: an async trainer finishes old rollouts on their own policy (``POLICY@G``)
while new ones take the plain name. Loading touches neither the base nor a resident
adapter, and the plain name moves in one assignment once every rank holds the new one, so
no request ever sees a half-loaded adapter: this needs no pause.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine_ext.backend import WorkerBackend
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


class ResidentAdapters:
    """Up to ``versions`` generations of adapter ``policy`` resident on every rank."""

    def __init__(
        self, backend: WorkerBackend, policy: str, versions: int, names: AdapterNames
    ) -> None:
        if type(versions) is not int or versions < 1:
            raise ValueError(f"lora_versions must be an integer >= 1, got {versions!r}")
        self.backend, self.policy, self.versions, self.names = backend, policy, versions, names
        self.generations: list[int] = []  # resident, oldest first

    async def load(self, generation: int | None = None) -> dict[str, Any]:
        """Make ``generation`` (default: the Store's active one) resident and the plain
        name's; a refusal on any rank changes no name and evicts nothing."""
        replies = await self.backend.call_workers("adapter", self.policy, generation)
        failed = [r for r in replies if not r.get("ok")]
        if failed:
            refused = failed[0].get("refused") or {"status": 502, "code": "adapter_failed"}
            raise ReceiverError(refused["status"], refused["code"], failed[0].get("error", ""))
        loaded = int(replies[0]["generation"])
        if loaded in self.generations:
            self.generations.remove(loaded)
        self.generations.append(loaded)
        self.names.register(versioned(self.policy, loaded), loaded)
        self.names.register(self.policy, loaded)
        while len(self.generations) > self.versions:
            oldest = self.generations.pop(0)
            self.names.drop(versioned(self.policy, oldest))
            await self.backend.call_workers("evict_adapter", oldest)
        return {
            "adapter": self.policy,
            "generation": loaded,
            "adapter_bytes": sum(r.get("adapter_bytes", 0) for r in replies),
            "resident": self.names.resident(),
        }
