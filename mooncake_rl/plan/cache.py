"""The explicit cache of routing tables: the only state in the planning package.

A table depends only on (source layout digest, target digest, topology digest, params), and
none of those change between generations, so every update after the first reuses it: a hit
returns the very same table object and recomputes nothing. A ``backing`` (the Store, see
:mod:`mooncake_rl.plan.stored`) keeps tables beyond this process, so a fresh process loads
a table instead of planning it again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, NamedTuple, Protocol, TypeVar

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.table import RoutingTable

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """At most ``max_entries`` values, the least recently used dropped first: what the
    planner keeps between plans (tables, placement parts) is large."""

    def __init__(self, max_entries: int) -> None:
        if max_entries <= 0:
            raise InvariantViolation(f"a cache needs room for at least one entry: {max_entries}")
        self.max_entries = max_entries
        self._values: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        value = self._values.get(key)
        if value is not None:
            self._values.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._values[key] = value
        self._values.move_to_end(key)
        while len(self._values) > self.max_entries:
            self._values.popitem(last=False)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values


class PlanKey(NamedTuple):
    source_digest: str
    target_digest: str
    topology_digest: str
    params: PlanParams


class TableBacking(Protocol):
    """Where tables outlive the process; ``load`` returns only a usable table, else None."""

    def load(self, key: PlanKey) -> RoutingTable | None: ...

    def save(self, key: PlanKey, table: RoutingTable) -> None: ...


class PlanCache:
    """Bounded LRU of routing tables over an optional backing, with counters for tests and
    benchmarks: ``hits`` (in memory), ``loads`` (from the backing), ``misses`` (planned)."""

    def __init__(self, max_entries: int = 8, backing: TableBacking | None = None) -> None:
        self.backing = backing
        self.hits = 0
        self.loads = 0
        self.misses = 0
        self._tables: Lru[PlanKey, RoutingTable] = Lru(max_entries)

    def get(self, key: PlanKey) -> RoutingTable | None:
        table = self._tables.get(key)
        if table is not None:
            self.hits += 1
            return table
        table = self.backing.load(key) if self.backing is not None else None
        if table is None:
            self.misses += 1
            return None
        self.loads += 1
        self._tables.put(key, table)
        return table

    def holds(self, key: PlanKey) -> bool:
        """Whether ``key``'s table is in memory (the backing is not asked; nothing counted)."""
        return key in self._tables

    def put(self, key: PlanKey, table: RoutingTable) -> None:
        """Keep a table just planned (and validated), here and in the backing."""
        self._tables.put(key, table)
        if self.backing is not None:
            self.backing.save(key, table)

    def __len__(self) -> int:
        return len(self._tables)
