"""Caching: generation-independent keys, and a hit recomputes nothing."""

from __future__ import annotations

import pytest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.plan import (
    CompatDemand,
    DirectDemand,
    PlanCache,
    PlanParams,
    Topology,
    Worker,
    bind,
    plan_routing,
    source_digest,
)
from mooncake_rl.plan import planner as planner_module
from mooncake_rl.plan.update import PartsCache

from .helpers import Spec, manifest, parts

SPECS = [Spec("a", (8, 4), kind="split", dim=0), Spec("b", (4,))]
WORKERS = [Worker(f"w{r}", f"n{r}", "i0", r) for r in range(2)]


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = planner_module.build_routing_table

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(planner_module, "build_routing_table", counting)
    return calls


def test_hit_across_generations_recomputes_nothing(counted):
    topology = Topology.of(WORKERS)
    demand = DirectDemand.of(
        {w.worker_id: p for w, p in zip(WORKERS, parts(SPECS, 2), strict=True)}
    )
    cache = PlanCache()
    first = plan_routing(manifest(SPECS, generation=1), topology, demand, cache=cache)
    second = plan_routing(manifest(SPECS, generation=2), topology, demand, cache=cache)
    assert second is first and len(counted) == 1
    assert (cache.hits, cache.misses) == (1, 1)
    assert tuple(bind(second, "g2").keys) == ("g2/payload/a", "g2/payload/b")


class Untouchable:
    """A manifest stand-in that fails the test if the planner reads anything from it."""

    def __getattr__(self, name):
        raise AssertionError(f"a cache hit read manifest.{name}")


def test_recorded_layout_digest_hit_reads_nothing_and_another_layout_misses(counted, monkeypatch):
    """With the digest the announcer sealed into the active record, a hit hashes nothing
    and touches no manifest field; a generation of another layout (same demand, topology
    and params) misses and is planned."""
    hashed = []
    real = planner_module.source_digest
    monkeypatch.setattr(planner_module, "source_digest", lambda m: hashed.append(m) or real(m))
    topology, demand, cache = Topology.of(WORKERS), CompatDemand(), PlanCache()
    one, two = manifest(SPECS, generation=1), manifest(SPECS, generation=2)
    recorded = source_digest(one)
    assert source_digest(two) == recorded
    first = plan_routing(one, topology, demand, cache=cache, layout_digest=recorded)
    assert len(counted) == 1 and len(hashed) == 1  # a miss re-checks the recorded digest
    second = plan_routing(Untouchable(), topology, demand, cache=cache, layout_digest=recorded)
    assert second is first and len(counted) == 1 and len(hashed) == 1
    assert bind(second, two.group_id).keys[0].startswith(two.group_id + "/payload/")
    for changed in (
        [Spec("a", (4, 8), kind="split", dim=0), Spec("b", (4,))],  # reshaped
        [Spec("a", (8, 4), "float32", kind="split", dim=0), Spec("b", (4,))],  # retyped
    ):
        three = manifest(changed, generation=3)
        third = plan_routing(three, topology, demand, cache=cache, layout_digest=real(three))
        assert third is not first and third.source_digest != first.source_digest
    assert len(counted) == 3 and (cache.hits, cache.misses) == (1, 3)


def test_a_recorded_digest_that_does_not_match_is_refused_before_planning(counted):
    topology = Topology.of(WORKERS)
    m = manifest(SPECS)
    other = manifest(SPECS, packed=True)
    with pytest.raises(InvariantViolation, match="does not match its manifest"):
        plan_routing(
            m, topology, CompatDemand(), cache=PlanCache(), layout_digest=source_digest(other)
        )
    with pytest.raises(InvariantViolation, match="not a SHA-256 hex digest"):
        plan_routing(m, topology, CompatDemand(), layout_digest="g000000000001")
    assert not counted


def test_digest_ignores_generation_but_not_layout():
    one, two = manifest(SPECS, generation=1), manifest(SPECS, generation=2)
    assert one.group_id != two.group_id and source_digest(one) == source_digest(two)
    reshaped = [Spec("a", (4, 8), kind="split", dim=0), Spec("b", (4,))]
    assert source_digest(manifest(reshaped)) != source_digest(one)
    assert source_digest(manifest(SPECS, packed=True)) != source_digest(one)
    retyped = [Spec("a", (8, 4), "float32", kind="split", dim=0), Spec("b", (4,))]
    assert source_digest(manifest(retyped)) != source_digest(one)


def test_misses_when_topology_target_or_params_change(counted):
    cache = PlanCache(max_entries=2)
    m = manifest(SPECS)
    topology = Topology.of(WORKERS)
    plan_routing(m, topology, CompatDemand(), cache=cache)
    plan_routing(m, Topology.of([*WORKERS, Worker("w2", "n2")]), CompatDemand(), cache=cache)
    plan_routing(m, topology, CompatDemand(align=128), cache=cache)
    plan_routing(m, topology, CompatDemand(), params=PlanParams(batch_bytes=1 << 20), cache=cache)
    assert len(counted) == 4 and cache.misses == 4 and len(cache) == 2  # LRU bound
    plan_routing(m, topology, CompatDemand(), params=PlanParams(batch_bytes=1 << 20), cache=cache)
    assert len(counted) == 4 and cache.hits == 1


@pytest.mark.parametrize("make", [PlanCache, PartsCache])
def test_a_cache_without_room_is_refused(make) -> None:
    with pytest.raises(InvariantViolation, match="a cache needs room for at least one entry: 0"):
        make(max_entries=0)


def test_the_parts_cache_keeps_the_most_recently_used_placements() -> None:
    cache = PartsCache(max_entries=2)
    for key in ("a", "b", "a", "c", "a", "b"):
        cache.get_or_build((key,), lambda key=key: {0: key})
    assert cache.built == 4  # a, b, c, then b again: c's build dropped b, the oldest
