"""The explicit cache of routing tables: the only state in the planning package.

A table depends only on (source layout digest, target digest, topology digest, params), and
none of those change between generations, so every update after the first reuses it: a hit
returns the very same table object and recomputes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.table import RoutingTable


class PlanKey(NamedTuple):
    source_digest: str
    target_digest: str
    topology_digest: str
    params: PlanParams


class PlanCache:
    """Bounded LRU of routing tables, with hit/miss counters for tests and benchmarks."""

    def __init__(self, max_entries: int = 8) -> None:
        if max_entries <= 0:
            raise InvariantViolation("a plan cache needs room for at least one table")
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._tables: OrderedDict[PlanKey, RoutingTable] = OrderedDict()

    def get(self, key: PlanKey) -> RoutingTable | None:
        table = self._tables.get(key)
        if table is None:
            self.misses += 1
            return None
        self.hits += 1
        self._tables.move_to_end(key)
        return table

    def put(self, key: PlanKey, table: RoutingTable) -> None:
        self._tables[key] = table
        self._tables.move_to_end(key)
        while len(self._tables) > self.max_entries:
            self._tables.popitem(last=False)

    def __len__(self) -> int:
        return len(self._tables)
