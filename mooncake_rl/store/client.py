"""Keys --> removed: the last step of an object's life, and :class:`StoreClient`, the
client every other module holds (connection, reads, writes and removal in one).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mooncake_rl.errors import mooncake_error
from mooncake_rl.store.connection import LEADER_LOST, check, rides_failover
from mooncake_rl.store.writes import StoreWrites


def regex_literal(text: str) -> str:
    """``text`` as a pattern of the master's (ECMAScript) regular expressions."""
    return re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", text)


class StoreClient(StoreWrites):
    """A connected Mooncake Store client that lends ``segment_bytes`` to the cluster: it
    connects (:class:`StoreConnection`), reads (:class:`StoreReads`), writes
    (:class:`StoreWrites`) and removes."""

    @rides_failover
    def remove(self, keys: Sequence[str], *, force: bool = False) -> dict[str, int]:
        """Remove keys; returns the keys that failed with their codes (missing keys are fine)."""
        if not keys:
            return {}
        codes = self._store.batch_remove(list(keys), force)
        lost = next((c for c in codes if c in LEADER_LOST), None)
        if lost is not None:  # repeated whole: keys already removed answer OBJECT_NOT_FOUND
            raise mooncake_error(lost, "batch_remove", f"{len(keys)} keys")
        return {k: c for k, c in zip(keys, codes, strict=True) if c < 0 and c != -704}

    @rides_failover
    def remove_matching(self, pattern: str, *, force: bool = False) -> int:
        """Remove every key ``pattern`` (the master's ECMAScript regex) matches: the Store
        lists no keys, so this is how records nobody tracked are found."""
        return check(self._store.remove_by_regex(pattern, force), "remove_by_regex", pattern)

    def remove_prefix(self, prefix: str, *, force: bool = False) -> int:
        """Remove every key starting with ``prefix``, including ones nobody listed."""
        return self.remove_matching("^" + regex_literal(prefix), force=force)
