"""Per-process byte counters: the evidence behind the single-pull invariant.

The Store and TE wrappers add to them on every successful operation; benchmarks and tests
read a snapshot before and after an update and compare the difference with the plan.
"""

from __future__ import annotations

import threading
from dataclasses import astuple, dataclass


@dataclass(frozen=True)
class ByteCounts:
    store_read_bytes: int = 0
    store_put_bytes: int = 0
    te_pushed_bytes: int = 0
    # Ranged reads repeated because the object's read lease expired before they finished:
    # the bytes crossed the network again, but were delivered once (store_read_bytes).
    store_reread_bytes: int = 0

    def __sub__(self, other: ByteCounts) -> ByteCounts:
        return ByteCounts(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __add__(self, other: ByteCounts) -> ByteCounts:
        return ByteCounts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


class ByteCounters:
    """Thread-safe running totals; one instance per process (``COUNTERS``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = ByteCounts()

    def add(self, *, read: int = 0, put: int = 0, pushed: int = 0, reread: int = 0) -> None:
        with self._lock:
            self._counts = self._counts + ByteCounts(read, put, pushed, reread)

    def snapshot(self) -> ByteCounts:
        with self._lock:
            return self._counts


COUNTERS = ByteCounters()
