"""Direct mode's per-parameter fallback, planned on byte arrays.

An engine whose discovery cannot describe a parameter names a checkpoint tensor the
generation lacks (or the wrong global shape). The plan must then deliver every generation
tensor no described box holds, whole, to each worker with such a parameter (it lands them
through ``load_weights``), still read each stored byte exactly once, and keep delivering
the described boxes exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import TensorSpec, build_manifest
from mooncake_rl.plan.demand import FALLBACK_REGION
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.plan.update import RoutingCache, plan_update
from tests.plan.test_update import clusters, expected_shard, models, simulate


def undescribe(engines: dict[str, list[dict[str, Any]]], names: set[str]) -> None:
    """What a discovery that cannot map ``names`` declares: boxes of tensors nobody stores."""
    for workers in engines.values():
        for worker in workers:
            for shard in worker["shards"]:
                if shard["tensor"] in names:
                    shard["tensor"] += ".unmapped"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(), clusters(), st.data(), st.sampled_from([16, 64, 1 << 20]))
def test_undescribed_parameters_receive_full_tensors_and_each_byte_is_read_once(
    specs: list[TensorSpec], cluster: list[tuple[str, int]], data: Any, batch_bytes: int
) -> None:
    names = {s.name for s in specs}
    lost = data.draw(st.sets(st.sampled_from(sorted(names)), min_size=1))
    manifest = build_manifest("m", 1, specs, "now")
    engines = simulated_engines(specs, cluster, "direct")
    undescribe(engines, lost)
    plan = plan_update(manifest, engines, "direct", batch_bytes, RoutingCache())
    rng = np.random.default_rng(0)
    objects = {s.name: rng.integers(0, 256, s.nbytes, dtype=np.uint8) for s in specs}
    memory = simulate(plan, objects)
    by_name = {s.name: s for s in specs}
    fallback_bytes = plan.routing.fallback_bytes()
    for workers in engines.values():
        for worker in workers:
            worker_id = worker["worker_id"]
            rows = plan.routing.fallback[worker_id]
            assert sorted(row["name"] for row in rows) == sorted(lost)
            for row in rows:
                got = memory[(worker_id, FALLBACK_REGION)][
                    row["offset"] : row["offset"] + row["nbytes"]
                ]
                assert np.array_equal(got, objects[row["name"]])
            described = 0
            for shard in worker["shards"]:
                if shard["tensor"].endswith(".unmapped"):
                    assert shard["region"] not in plan.routing.regions[worker_id]
                    continue
                spec = by_name[shard["tensor"]]
                want = expected_shard(spec, objects[shard["tensor"]], shard)
                assert np.array_equal(memory[(worker_id, shard["region"])], want)
                described += want.nbytes
            assert fallback_bytes[worker_id] == sum(by_name[n].nbytes for n in lost)
            received = plan.routing.received_bytes()[worker_id]
            assert received == described + fallback_bytes[worker_id]
    assert plan.store_read_bytes == plan.unique_demand_bytes == sum(s.nbytes for s in specs)


def test_a_wrong_global_shape_is_undescribed_too() -> None:
    specs = [TensorSpec("a", (4, 4), "float32"), TensorSpec("b", (8,), "float32")]
    engines = simulated_engines(specs, [("n0", 1)], "direct")
    engines["http://engine0"][0]["shards"][0]["global_shape"] = [2, 8]
    plan = plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, RoutingCache())
    assert [row["name"] for row in plan.routing.fallback["e0/tp0"]] == ["a"]
    assert plan.routing.region_dtypes["e0/tp0"] == {"b": "float32"}


def test_generation_tensors_no_parameter_takes_are_refused() -> None:
    specs = [TensorSpec("a", (4,), "float32"), TensorSpec("b", (4,), "float32")]
    engines = simulated_engines(specs[:1], [("n0", 1)], "direct")
    with pytest.raises(InvariantViolation, match=r"lacks tensors the generation has: \['b'\]"):
        plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, RoutingCache())


def test_parameters_no_generation_tensor_can_fill_are_refused() -> None:
    specs = [TensorSpec("a", (4,), "float32")]
    engines = simulated_engines(
        [*specs, TensorSpec("extra", (2,), "float32")], [("n0", 1)], "direct"
    )
    with pytest.raises(InvariantViolation, match=r"no generation tensor can land in .*'extra'"):
        plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, RoutingCache())


def test_the_operator_can_send_named_parameters_through_the_fallback() -> None:
    specs = [TensorSpec("w.a", (4, 4), "float32"), TensorSpec("w.b", (8,), "float32")]
    engines = simulated_engines(specs, [("n0", 2)], "direct")
    manifest = build_manifest("m", 1, specs, "now")
    plan = plan_update(manifest, engines, "direct", 64, RoutingCache(), direct_fallback=r"\.b$")
    for worker in ("e0/tp0", "e0/tp1"):
        assert [row["name"] for row in plan.routing.fallback[worker]] == ["w.b"]
        assert set(plan.routing.regions[worker]) == {"w.a", FALLBACK_REGION}
    with pytest.raises(InvariantViolation, match="is not a regex"):
        plan_update(manifest, engines, "direct", 64, RoutingCache(), direct_fallback="(")


def test_boxes_without_a_global_shape_are_placed_by_the_box_alone() -> None:
    specs = [TensorSpec("a", (4, 4), "float32"), TensorSpec("b", (8,), "float16")]
    engines = simulated_engines(specs, [("n0", 2)], "direct")
    for worker in engines["http://engine0"]:
        for shard in worker["shards"]:
            del shard["global_shape"]
    plan = plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, RoutingCache())
    assert plan.routing.fallback == {"e0/tp0": (), "e0/tp1": ()}
    assert plan.routing.region_dtypes["e0/tp1"] == {"a": "float32", "b": "float16"}


def test_a_region_fed_two_dtypes_is_refused() -> None:
    specs = [TensorSpec("a", (4,), "float32"), TensorSpec("b", (8,), "float16")]
    engines = simulated_engines(specs, [("n0", 1)], "direct")
    worker = engines["http://engine0"][0]
    worker["shards"][1]["region"] = "a"
    del worker["regions"]["b"]
    with pytest.raises(InvariantViolation, match="region a would receive mixed dtypes"):
        plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, RoutingCache())
