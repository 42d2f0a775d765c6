"""Per-process byte counters: the evidence behind the single-pull invariant.

The Store and TE wrappers add to them on every successful operation; benchmarks and tests
read a snapshot before and after an update and compare the difference with the plan.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class ByteCounts:
    store_read_bytes: int = 0
    store_put_bytes: int = 0
    te_pushed_bytes: int = 0

    def __sub__(self, other: ByteCounts) -> ByteCounts:
        return ByteCounts(
            self.store_read_bytes - other.store_read_bytes,
            self.store_put_bytes - other.store_put_bytes,
            self.te_pushed_bytes - other.te_pushed_bytes,
        )

    def __add__(self, other: ByteCounts) -> ByteCounts:
        return ByteCounts(
            self.store_read_bytes + other.store_read_bytes,
            self.store_put_bytes + other.store_put_bytes,
            self.te_pushed_bytes + other.te_pushed_bytes,
        )


class ByteCounters:
    """Thread-safe running totals; one instance per process (``COUNTERS``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = ByteCounts()

    def add(self, *, read: int = 0, put: int = 0, pushed: int = 0) -> None:
        with self._lock:
            self._counts = self._counts + ByteCounts(read, put, pushed)

    def snapshot(self) -> ByteCounts:
        with self._lock:
            return self._counts


COUNTERS = ByteCounters()
