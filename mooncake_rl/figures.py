"""What updates did, accumulated in plain Python: the figures behind the ``mooncake_rl_*``
metrics, which :mod:`mooncake_rl.metrics` names and exposes.

No ``prometheus_client`` here on purpose: the engine's receiver records into these figures
from the moment SGLang loads the plugin, and SGLang picks prometheus_client's multiprocess
mode when that package is first imported, which must be SGLang's own import, made after it
set ``PROMETHEUS_MULTIPROC_DIR``.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PHASE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Upper bounds of the phase-seconds buckets: a drain of a tiny model to an apply of a 1T one."""
LANDINGS = ("in_place", "staged")
"""Where received bytes land: straight into live parameters, or staging landed at commit."""


@dataclass
class Histogram:
    """Observations counted into fixed buckets (``le`` bounds, then +Inf), and their sum."""

    bounds: tuple[float, ...] = PHASE_BUCKETS_S
    counts: list[int] = field(init=False)
    total: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)) or not all(
            math.isfinite(b) for b in self.bounds
        ):
            raise ValueError(f"bucket bounds must be finite and increasing: {self.bounds}")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"an observation must be finite and >= 0, got {value}")
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it), ending with (inf, every observation)."""
        running, rows = 0, []
        for bound, count in zip((*self.bounds, math.inf), list(self.counts), strict=True):
            running += count
            rows.append((bound, running))
        return rows


@dataclass
class UpdateFigures:
    """Running totals of the updates one engine served or one coordinator process ran.

    Read by a scrape on another thread (the coordinator's HTTP server): readers copy the
    dicts before iterating them.
    """

    phases: dict[str, Histogram] = field(default_factory=dict)
    store_read_bytes: int = 0
    pushed_bytes: int = 0
    received_bytes: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    rebuilds: int = 0

    def timed(self, phase: str, seconds: float) -> None:
        self.phases.setdefault(phase, Histogram()).observe(seconds)

    def received(self, in_place: int, staged: int) -> None:
        self.received_bytes.update({"in_place": in_place, "staged": staged})

    def applied(self, reply: Mapping[str, Any]) -> None:
        """One apply stage's reply: every worker's Store reads and Transfer Engine pushes."""
        for worker in reply.get("workers", ()):
            self.store_read_bytes += int(worker.get("store_read_bytes", 0))
            self.pushed_bytes += int(worker.get("pushed_bytes", 0))
