"""Per-class planning equals planning the whole placement with mooncake.reshard directly."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mooncake.reshard.weight import (
    ParallelRank,
    ParallelTopology,
    TopologyParticipant,
    WeightPlacementManifest,
    plan_stored_transfer_to_target_placement,
)

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan import DirectDemand, Topology, Worker
from mooncake_rl.plan.reshard import region_runs
from mooncake_rl.plan.source import source_layout
from mooncake_rl.plan.targets import demand_set

from .helpers import Spec, manifest, parts
from .test_properties import models


def full_placement(m, instance_parts):
    topology = ParallelTopology(
        tp_size=len(instance_parts),
        pp_size=1,
        ep_size=1,
        dp_size=1,
        participants=tuple(
            TopologyParticipant(f"tp{r}", ParallelRank(tp=r)) for r in range(len(instance_parts))
        ),
    )
    fields = dict(
        resource_id=m.resource_id,
        revision=m.revision,
        weight_generation=m.weight_generation,
        placement_set_id="ps",
    )
    rebuilt = tuple(
        replace(p, topology_id=topology.topology_id, participant_id=f"tp{r}", **fields)
        for r, p in enumerate(instance_parts)
    )
    return WeightPlacementManifest(topology=topology, parts=rebuilt, **fields)


def expand(run):
    src, dst, length, count, s_stride, d_stride = run
    return [(src + k * s_stride, dst + k * d_stride, length) for k in range(count)]


@settings(max_examples=40, deadline=None)
@given(models(), st.sampled_from([1, 2, 4]), st.booleans())
def test_class_replay_equals_whole_placement_planning(specs, tp, packed):
    m = manifest(specs, packed=packed)
    instance = parts(specs, tp)
    plan = plan_stored_transfer_to_target_placement(m, full_placement(m, instance))
    layout = source_layout(m)
    prefix = f"{m.group_id}/payload/"
    want = set()
    for op in plan.operations:
        segments = [seg for run in region_runs(op) for seg in expand(run)]
        assert segments == list(op.iter_segments(max_segments=1 << 20))
        obj = layout.objects.index(op.source.object_key[len(prefix) :])
        for src, dst, length, count, s_stride, d_stride in region_runs(op):
            want.add(
                (
                    obj,
                    op.source.object_offset + src,
                    length,
                    count,
                    s_stride,
                    d_stride,
                    op.target.rank.tp,
                    op.target.placement_fragment_id,
                    dst,
                )
            )
    topology = Topology.of(Worker(f"w{r}", "n0", "i0", r) for r in range(tp))
    demands = demand_set(
        m, layout, topology, DirectDemand.of({f"w{r}": instance[r] for r in range(tp)})
    )
    got = set()
    for p in range(len(demands.obj)):
        for c in range(int(demands.ptr[p]), int(demands.ptr[p + 1])):
            got.add(
                (
                    int(demands.obj[p]),
                    int(demands.src_offset[p]),
                    int(demands.length[p]),
                    int(demands.count[p]),
                    int(demands.src_stride[p]),
                    int(demands.dst_stride[p]),
                    int(demands.worker[c]),
                    demands.regions[int(demands.region[c])],
                    int(demands.dst_offset[c]),
                )
            )
    assert got == want


def test_loops_fuse_when_uniform_and_expand_otherwise():
    specs = [Spec("cube", (2, 4, 4), "float32", kind="split", dim=2)]
    m = manifest(specs)
    plan = plan_stored_transfer_to_target_placement(m, full_placement(m, parts(specs, 2)))
    runs = region_runs(plan.operations[0])
    assert [(r[2], r[3], r[4], r[5]) for r in runs] == [(8, 8, 16, 8)]  # 2x4 loops fused
    region = SimpleNamespace(
        outer_loop_counts=(2, 3),
        source_strides=(100, 20),  # 100 != 3 * 20: not fusable
        target_strides=(30, 10),
        inner_bytes=5,
        source_base_offset=7,
        target_base_offset=1,
    )
    assert region_runs(region) == [(7, 1, 5, 3, 20, 10), (107, 31, 5, 3, 20, 10)]


def test_planner_rejections_name_real_tensors():
    specs = [Spec("a.weight", (4, 4), kind="split", dim=0), Spec("b.weight", (4,))]
    instance = parts(specs, 2)
    broken = replace(
        instance[1], fragments=instance[1].fragments[:1], tensors=instance[1].tensors[:1]
    )
    topology = Topology.of(Worker(f"w{r}", "n0", "i0", r) for r in range(2))
    demand = DirectDemand.of({"w0": instance[0], "w1": broken})
    with pytest.raises(InvariantViolation, match=r"a\.weight|b\.weight") as error:
        demand_set(manifest(specs), source_layout(manifest(specs)), topology, demand)
    assert "class0" not in str(error.value)
