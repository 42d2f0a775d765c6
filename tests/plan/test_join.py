"""Joining ranges that continue one another: the same bytes to the same places, fewer ranges,
and a compat update of a packed generation issues a handful of reads instead of one per tensor."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.common import synthetic_model
from mooncake_rl.generations.catalog import TensorSpec, build_manifest
from mooncake_rl.generations.packing import pack_layout
from mooncake_rl.plan.demand import CompatDemand
from mooncake_rl.plan.merge import Ranges, join_adjacent, merge_demands
from mooncake_rl.plan.source import source_layout
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.plan.targets import demand_set
from mooncake_rl.plan.update import RoutingCache, plan_update, topology_of


def _packed(tensors: int, seed_bytes: int = 2 << 20):
    model = synthetic_model(seed_bytes, tensors)
    specs = [TensorSpec.of(name, t, "bfloat16") for name, t in model]
    rows = [(s.name, s.nbytes, s.dtype, 0) for s in specs]
    return specs, build_manifest("m", 1, specs, "x", pack_layout(rows, 128 << 20))


def _moves(r: Ranges) -> set[tuple[int, int, int, int, int]]:
    """(object, source byte, worker, region, destination byte) of every byte a range moves."""
    out = set()
    for i in range(len(r)):
        width = int(r.c1[i] - r.c0[i])
        for c in range(int(r.ptr[i]), int(r.ptr[i + 1])):
            for row in range(int(r.r0[i]), int(r.r1[i])):
                src = row * int(r.pitch[i]) + int(r.c0[i])
                dst = int(r.dst_offset[c]) + (row - int(r.r0[i])) * int(r.dst_pitch[c])
                out.update(
                    (int(r.obj[i]), src + k, int(r.worker[c]), int(r.region[c]), dst + k)
                    for k in range(width)
                )
    return out


@settings(max_examples=10, deadline=None)
@given(st.integers(2, 40), st.integers(1, 3))
def test_joined_ranges_move_exactly_the_same_bytes(tensors: int, workers: int) -> None:
    specs, manifest = _packed(tensors, 64 << 10)
    engines = simulated_engines(specs, [("node0", workers)], "compat")
    ranges = merge_demands(
        demand_set(manifest, source_layout(manifest), topology_of(engines), CompatDemand())
    )
    joined = join_adjacent(ranges)
    assert _moves(joined) == _moves(ranges)
    assert len(joined) == 1  # one pack, laid out in stored order: one range
    assert np.array_equal(np.diff(joined.ptr), [workers])


def test_a_packed_compat_update_reads_a_few_ranges_not_one_per_tensor() -> None:
    specs, manifest = _packed(2000)
    engines = simulated_engines(specs, [("node0", 2)], "compat")
    plan = plan_update(manifest, engines, "compat", 1 << 20, RoutingCache())  # validated
    for worker in ("e0/tp0", "e0/tp1"):
        reads = [op for stage in plan.worker_slice(worker).stages for b in stage for op in b.reads]
        # Unjoined, each worker read about 1,000 tensors, one range each.
        assert 0 < len(reads) <= 16
