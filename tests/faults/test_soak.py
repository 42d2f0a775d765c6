"""Soak: a hundred generations through the VeRL bridge with automatic retention, while a
reader process holds a lease on an old generation and keeps reading it (``make faults``).

The fast smoke of the same churn (ten generations) runs in the normal suite:
``tests/test_leases.py::test_retention_smoke_with_a_leased_reader``.
"""

from __future__ import annotations

import pytest

from mooncake_rl.services import EmbeddedMaster
from tests.test_leases import churn

pytestmark = pytest.mark.faults


def test_hundred_generations_stay_bounded_around_a_leased_reader(
    master: EmbeddedMaster, holders
) -> None:
    report = churn(master, holders("node-soak").segment, "soak-retention", 100, pace_s=0.25)
    print(
        f"\nsoak start: {report.start[0]} payload objects, {report.start[1]} bytes; "
        f"master keys {report.metrics_start['master_key_count']:.0f}, "
        f"allocated {report.metrics_start['master_allocated_bytes']:.0f} B"
    )
    print(
        f"soak end: {report.end[0]} payload objects, {report.end[1]} bytes; "
        f"master keys {report.metrics_end['master_key_count']:.0f}, "
        f"allocated {report.metrics_end['master_allocated_bytes']:.0f} B; "
        f"peak {report.peak_generations} generations listed; reader read generation "
        f"{report.leased} {report.reads} times; {report.syncs} syncs in {report.churn_s}s"
    )
    assert report.reads > 10
    assert report.end == report.start  # the same two-generation footprint as at the start
