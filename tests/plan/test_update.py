"""The engine-facing adapter (``plan.update``): worker descriptions in, executor slices out.

Every plan is executed on byte arrays through ``UpdatePlan.worker_slice`` (reads from random
object bytes, pushes in stage and batch order) and each worker's regions are compared with
the bytes its declared shards must hold, computed independently with numpy slicing.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mooncake.reshard.weight import OwnershipAxis, ReplicatedAxis, SplitAxis, TensorDescriptor

from mooncake_rl.apply.wire import decode_slice, with_checksums
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import TensorSpec, build_manifest
from mooncake_rl.generations.checksums import ObjectChecksum
from mooncake_rl.generations.layout import layout_digest
from mooncake_rl.plan import update as update_module
from mooncake_rl.plan.cache import Lru
from mooncake_rl.plan.demand import COMPAT_REGION
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.plan.update import RoutingCache, UpdatePlan, encode_workers, plan_update
from mooncake_rl.protocol import (
    PLACEMENT_DIGEST,
    placement_digest,
    reports_own_placement,
    without_boxes,
)

from .helpers import reporting

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@st.composite
def models(draw: Any) -> list[TensorSpec]:
    count = draw(st.integers(1, 12))
    specs = []
    for index in range(count):
        rank = draw(st.integers(1, 3))
        shape = tuple(draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12])) for _ in range(rank))
        specs.append(TensorSpec(f"t{index}", shape, draw(st.sampled_from(sorted(DTYPES)))))
    return specs


@st.composite
def clusters(draw: Any) -> list[tuple[str, int]]:
    """Engines as (node, tp size)."""
    return draw(
        st.lists(
            st.tuples(st.sampled_from(["n0", "n1", "n2", "n3"]), st.sampled_from([1, 2, 4])),
            min_size=1,
            max_size=4,
        )
    )


def simulate(plan: UpdatePlan, objects: dict[str, np.ndarray]) -> dict[tuple[str, str], Any]:
    prefix = f"{plan.group_id}/payload/"
    memory = {
        (w, r): np.zeros(size, dtype=np.uint8)
        for w, regions in plan.routing.regions.items()
        for r, size in regions.items()
    }
    for stage in range(plan.stages):
        for worker in sorted(plan.routing.regions):
            for batch in plan.worker_slice(worker).stages[stage]:
                for read in batch.reads:
                    raw = objects[read.key.removeprefix(prefix)]
                    memory[(worker, read.region)][
                        read.dst_offset : read.dst_offset + read.length
                    ] = raw[read.src_offset : read.src_offset + read.length]
                for push in batch.pushes:
                    memory[(push.peer, push.dst_region)][
                        push.dst_offset : push.dst_offset + push.length
                    ] = memory[(worker, push.src_region)][
                        push.src_offset : push.src_offset + push.length
                    ]
    return memory


def expected_shard(spec: TensorSpec, raw: np.ndarray, shard: dict) -> np.ndarray:
    tensor = raw.view(DTYPES[spec.dtype]).reshape(spec.shape)
    index = tuple(
        slice(o, o + n) for o, n in zip(shard["global_offset"], shard["local_shape"], strict=True)
    )
    return np.ascontiguousarray(tensor[index]).view(np.uint8).reshape(-1)


def assert_direct_shards_land(
    plan: UpdatePlan, engines: dict[str, list[dict]], specs: list[TensorSpec], seed: int
) -> None:
    """Every worker's every declared shard holds exactly its bytes of random objects."""
    rng = np.random.default_rng(seed)
    objects = {s.name: rng.integers(0, 256, s.nbytes, dtype=np.uint8) for s in specs}
    memory = simulate(plan, objects)
    by_name = {s.name: s for s in specs}
    for workers in engines.values():
        for worker in workers:
            for shard in worker["shards"]:
                want = expected_shard(by_name[shard["tensor"]], objects[shard["tensor"]], shard)
                assert np.array_equal(memory[(worker["worker_id"], shard["region"])], want)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    models(),
    clusters(),
    st.sampled_from(["compat", "direct"]),
    st.sampled_from([16, 64, 1 << 20]),
    st.integers(0, 99),
)
def test_slices_deliver_exactly_the_demanded_bytes_reading_each_once(
    specs: list[TensorSpec], cluster: list[tuple[str, int]], mode: str, batch_bytes: int, seed: int
) -> None:
    manifest = build_manifest("m", 1, specs, "now")
    engines = simulated_engines(specs, cluster, mode)
    plan = plan_update(manifest, engines, mode, batch_bytes, RoutingCache())
    if mode == "compat":
        rng = np.random.default_rng(seed)
        objects = {s.name: rng.integers(0, 256, s.nbytes, dtype=np.uint8) for s in specs}
        memory = simulate(plan, objects)
        by_name = {s.name: s for s in specs}
        for worker in plan.routing.regions:
            for entry in plan.routing.layout:
                got = memory[(worker, COMPAT_REGION)][
                    entry["offset"] : entry["offset"] + by_name[entry["name"]].nbytes
                ]
                assert np.array_equal(got, objects[entry["name"]])
    else:
        assert_direct_shards_land(plan, engines, specs, seed)
    model_bytes = sum(s.nbytes for s in specs)
    assert plan.store_read_bytes == plan.unique_demand_bytes == model_bytes
    slices = [plan.worker_slice(w) for w in plan.routing.regions]
    assert sum(s.read_bytes for s in slices) == plan.store_read_bytes
    assert sum(s.pushed_bytes for s in slices) == plan.pushed_bytes
    received = plan.routing.received_bytes()
    for workers in engines.values():
        for worker in workers:
            declared = sum(r["bytes"] for r in worker["regions"].values())
            # compat: the padding between tensors is never written
            want = model_bytes if mode == "compat" else declared
            assert received[worker["worker_id"]] == want
    nodes = {node for node, _ in cluster}
    if mode == "compat":
        assert plan.routing.cross_node_pushed_bytes == model_bytes * (len(nodes) - 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    models(),
    clusters(),
    st.sampled_from(["compat", "direct"]),
    st.sampled_from([16, 64, 1 << 20]),
)
def test_prepare_bodies_from_columns_decode_to_the_executors_slices(
    specs: list[TensorSpec], cluster: list[tuple[str, int]], mode: str, batch_bytes: int
) -> None:
    """``engine_workers`` encodes each slice from the table's columns, a strided record as
    one strided run; what a worker decodes is exactly the executor's own slice, with and
    without checksums, and the body's JSON is the standard library's bytes. Each stage's
    apply peers are the workers those ops push to. A checksum table that lacks an object
    the slice reads is refused by key."""
    manifest = build_manifest("m", 1, specs, "now")
    engines = simulated_engines(specs, cluster, mode)
    plan = plan_update(manifest, engines, mode, batch_bytes, RoutingCache())
    slices = {w: plan.worker_slice(w) for w in plan.routing.regions}
    rows = {key: ObjectChecksum.of(key.encode()) for s in slices.values() for key in s.read_keys}
    for url, workers in plan.engines.items():
        with_rows, plain = plan.engine_workers(url, rows), plan.engine_workers(url)
        for body in (with_rows, plain):
            standard = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
            assert encode_workers(body) == standard
        for worker in workers:
            assert decode_slice(plain[worker]["slice"]) == slices[worker]
            assert decode_slice(with_rows[worker]["slice"]) == with_checksums(slices[worker], rows)
        for stage in range(plan.stages):
            pushed: dict[str, set[str]] = {}
            for w in workers:  # a worker's pushes to itself are local copies: no peer
                for op in (op for b in slices[w].stages[stage] for op in b.pushes):
                    if op.peer != w:
                        pushed.setdefault(op.peer, set()).add(op.dst_region)
            assert plan.push_regions(url, stage) == pushed
    reader = next(w for w, s in slices.items() if s.read_keys)
    url = next(u for u, ws in plan.engines.items() if reader in ws)
    first = min(slices[reader].read_keys)
    with pytest.raises(InvariantViolation, match=f"checksum table has no entry for {first}"):
        plan.engine_workers(url, {k: v for k, v in rows.items() if k != first})


def test_identical_engines_are_read_once_and_each_slice_names_its_placement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three identical TP2 engines and a TP1 one: two distinct placements are read and turned
    into planner parts (a 1T MoE's TP8 engine describes a million boxes), every worker still
    receives exactly its bytes, and each slice names the digest its worker reported. An
    engine that copies another's reports while it describes something else is not read, so
    its workers' slices name a digest their own placement does not hash to, and each worker
    refuses it at prepare (tests/sglang). A representative's false report is refused here."""
    specs = [TensorSpec("a", (8, 4), "float32"), TensorSpec("b", (6,), "float16")]
    cluster = [("n0", 2), ("n1", 2), ("n2", 2), ("n3", 1)]
    engines = reporting(simulated_engines(specs, cluster, "direct"))
    first_ranks = {w[PLACEMENT_DIGEST] for ws in engines.values() for w in ws if w["tp_rank"] == 0}
    assert len(first_ranks) == 2  # one digest per rank of identical engines
    read: list[Any] = []
    for name in ("_engine_layout", "_engine_parts"):
        real = getattr(update_module, name)
        monkeypatch.setattr(
            update_module, name, lambda *a, _real=real, _name=name: read.append(_name) or _real(*a)
        )
    plan = plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, RoutingCache())
    assert sorted(read) == ["_engine_layout"] * 2 + ["_engine_parts"] * 2
    assert_direct_shards_land(plan, engines, specs, seed=7)
    for url, workers in engines.items():
        bodies = plan.engine_workers(url)
        assert {w["worker_id"]: w[PLACEMENT_DIGEST] for w in workers} == {
            worker: body["placement_digest"] for worker, body in bodies.items()
        }
    copied = engines["http://engine1"][0]
    copied["shards"][0]["region_offset"] = 4  # no longer what engine0's rank 0 describes
    plan = plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, RoutingCache())
    named = plan.engine_workers("http://engine1")["e1/tp0"]["placement_digest"]
    assert named == copied[PLACEMENT_DIGEST] != placement_digest(copied)
    false = engines["http://engine0"][0]
    false["shards"][0]["region_offset"] = 4
    with pytest.raises(InvariantViolation, match="worker e0/tp0 reported placement digest"):
        plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, RoutingCache())


_JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),  # past 64 bits too: orjson refuses those
    st.floats(allow_nan=False, allow_infinity=False),  # 1e16: orjson and json spell it apart
    st.text(max_size=6),  # not only ASCII: json escapes it, orjson does not
)
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    fields=st.fixed_dictionaries({f: _JSON for f in ("tp_rank", "tp_size", "regions", "shards")}),
    other=_JSON,
)
def test_a_report_is_true_exactly_when_it_is_the_canonical_digest(
    fields: dict[str, Any], other: Any
) -> None:
    """The coordinator's fast check of a placement report (orjson) decides as the canonical
    form (the standard library's JSON) does, whatever the description holds: a true report
    is never refused, a report of another description never accepted."""
    worker = {"worker_id": "e0/tp0", "node": "n0", **fields}
    assert reports_own_placement(worker)  # no report: nothing to check
    assert reports_own_placement({**worker, PLACEMENT_DIGEST: placement_digest(worker)})
    changed = {**worker, "shards": [worker["shards"], other]}
    assert not reports_own_placement({**changed, PLACEMENT_DIGEST: placement_digest(worker)})


def test_a_fleet_change_replans_with_the_parts_of_placements_it_kept() -> None:
    """An engine added to the fleet changes the topology (a miss), not the distinct
    placement: its planner parts are not built again, and every worker, the new engine's
    included, still receives exactly its bytes. Another layout or another direct fallback
    builds them anew."""
    specs = [TensorSpec("a", (8, 4), "float32"), TensorSpec("b", (6,), "float16")]
    manifest = build_manifest("m", 1, specs, "now")
    cache = RoutingCache()
    two = reporting(simulated_engines(specs, [("n0", 2), ("n1", 2)], "direct"))
    plan_update(manifest, two, "direct", 64, cache)
    three = reporting(simulated_engines(specs, [("n0", 2), ("n1", 2), ("n2", 2)], "direct"))
    plan = plan_update(manifest, three, "direct", 64, cache)
    assert (cache.misses, cache.parts.built) == (2, 1)
    assert_direct_shards_land(plan, three, specs, seed=3)
    plan_update(manifest, three, "direct", 64, cache, direct_fallback="^b$")
    assert (cache.misses, cache.parts.built) == (3, 2)
    wider = [TensorSpec("a", (8, 4), "float32"), TensorSpec("b", (6,), "float32")]
    engines = reporting(simulated_engines(wider, [("n0", 2), ("n1", 2), ("n2", 2)], "direct"))
    plan = plan_update(build_manifest("m", 2, wider, "later"), engines, "direct", 64, cache)
    assert (cache.misses, cache.parts.built) == (4, 3)
    assert_direct_shards_land(plan, engines, wider, seed=4)


def test_a_table_names_only_the_regions_workers_declare() -> None:
    """Workers with destinations land nothing in the default per-fragment regions, so the
    table (kept in the Store) names staging and the declared regions only."""
    specs = [TensorSpec("a", (8, 4), "float32"), TensorSpec("b", (6,), "float16")]
    engines = simulated_engines(specs, [("n0", 2), ("n1", 4)], "direct")
    plan = plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, RoutingCache())
    declared = {r for ws in engines.values() for w in ws for r in w["regions"]}
    assert sorted(plan.routing.table.regions) == sorted({"staging"} | declared)
    assert_direct_shards_land(plan, engines, specs, seed=5)


def test_region_maps_are_checked_once_per_rank_and_a_contradicted_size_is_refused() -> None:
    """Ranks of identical engines declare one layout, so the planned regions are checked
    once per rank and they share the merged map. A table that plans another size for a
    declared region is refused by worker and region, and the declared map is left as it
    was (the layout cache holds it)."""
    specs = [TensorSpec("a", (8, 4), "float32"), TensorSpec("b", (6,), "float16")]
    engines = reporting(simulated_engines(specs, [("n0", 2), ("n1", 2), ("n2", 2)], "direct"))
    plan = plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, RoutingCache())
    declared = {
        w["worker_id"]: {name: spec["bytes"] for name, spec in w["regions"].items()}
        for ws in engines.values()
        for w in ws
    }
    assert plan.routing.regions == declared
    assert plan.routing.regions["e0/tp1"] is plan.routing.regions["e2/tp1"]
    assert plan.routing.regions["e0/tp0"] is not plan.routing.regions["e0/tp1"]
    contradicted = {**declared, "e1/tp1": {**declared["e1/tp1"], "a": 1}}
    with pytest.raises(InvariantViolation, match=r"e1/tp1:a declares 1 bytes, plan needs 64"):
        update_module._planned_regions(plan.routing.table, contradicted)
    assert contradicted["e1/tp1"] == {"a": 1, "b": 6}
    compat = plan_update(
        build_manifest("m", 1, specs, "now"), engines, "compat", 64, RoutingCache()
    )
    (buffer,) = {id(r): r for r in compat.routing.regions.values()}.values()
    assert set(compat.routing.regions) == set(declared) and list(buffer) == [COMPAT_REGION]


def test_cache_hit_replans_nothing_and_binds_the_new_generation() -> None:
    specs = [TensorSpec("a", (4, 4), "float32"), TensorSpec("b", (8,), "float16")]
    engines = simulated_engines(specs, [("n0", 2), ("n1", 1)], "direct")
    cache = RoutingCache()
    first = plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, cache)
    second = plan_update(build_manifest("m", 2, specs, "later"), engines, "direct", 64, cache)
    assert cache.misses == 1 and cache.hits == 1
    assert second.routing.table is first.routing.table
    keys = {
        op.key for stage in second.worker_slice("e0/tp0").stages for b in stage for op in b.reads
    }
    assert keys and all(k.startswith("mooncake-rl/m/g000000000002/payload/") for k in keys)


def test_recorded_layout_digest_flows_through_the_update_adapter() -> None:
    """The coordinator passes ``ActiveRecord.layout_digest``: it keys the cache (a hit for
    the next generation of the same layout) and a miss refuses one that does not match."""
    specs = [TensorSpec("a", (4, 4), "float32")]
    engines = simulated_engines(specs, [("n0", 2)], "direct")
    one, two = build_manifest("m", 1, specs, "now"), build_manifest("m", 2, specs, "later")
    cache = RoutingCache()
    first = plan_update(one, engines, "direct", 64, cache, layout_digest(one))
    second = plan_update(two, engines, "direct", 64, cache, layout_digest(two))
    assert second.routing.table is first.routing.table and (cache.hits, cache.misses) == (1, 1)
    other = build_manifest("m", 3, [TensorSpec("a", (2, 8), "float32")], "x")
    with pytest.raises(InvariantViolation, match="does not match its manifest"):
        plan_update(one, engines, "direct", 64, RoutingCache(), layout_digest(other))


def _worker(rank: int, tp: int, regions: dict[str, int], shards: list[tuple]) -> dict[str, Any]:
    return {
        "worker_id": f"e/tp{rank}",
        "node": "n0",
        "tp_rank": rank,
        "tp_size": tp,
        "regions": {name: {"bytes": size} for name, size in regions.items()},
        "shards": [
            {
                "tensor": tensor,
                "global_offset": list(offset),
                "local_shape": list(shape),
                "region": region,
                "region_offset": base,
            }
            for tensor, offset, shape, region, base in shards
        ],
    }


def test_fused_gate_up_boxes_land_back_to_back() -> None:
    """Two checkpoint tensors stacked in one fused parameter, as vLLM's gate_up does."""
    specs = [TensorSpec("gate", (4, 2), "float32"), TensorSpec("up", (4, 2), "float32")]
    manifest = build_manifest("m", 1, specs, "now")
    engines = {
        "http://e": [
            _worker(
                r,
                2,
                {"gate_up": 32},
                [
                    ("gate", (2 * r, 0), (2, 2), "gate_up", 0),
                    ("up", (2 * r, 0), (2, 2), "gate_up", 16),
                ],
            )
            for r in range(2)
        ]
    }
    plan = plan_update(manifest, engines, "direct", 64, RoutingCache())
    objects = {s.name: np.arange(s.nbytes, dtype=np.uint8) + 100 * i for i, s in enumerate(specs)}
    memory = simulate(plan, objects)
    assert np.array_equal(
        memory[("e/tp1", "gate_up")], np.concatenate([objects["gate"][16:], objects["up"][16:]])
    )
    assert plan.store_read_bytes == 64 and plan.pushed_bytes == 0


def test_experts_owned_by_one_rank_are_read_once_by_their_owner() -> None:
    """Under EP each expert tensor lives on one rank: no pushes, one read per expert."""
    specs = [TensorSpec(f"experts.{i}.w", (4, 4), "bfloat16") for i in range(4)]
    manifest = build_manifest("m", 1, specs, "now")
    engines = {
        "http://e": [
            _worker(
                r,
                2,
                {f"experts.{i}.w": 32 for i in range(4) if i % 2 == r},
                [
                    (f"experts.{i}.w", (0, 0), (4, 4), f"experts.{i}.w", 0)
                    for i in range(4)
                    if i % 2 == r
                ],
            )
            for r in range(2)
        ]
    }
    plan = plan_update(manifest, engines, "direct", 64, RoutingCache())
    prefix = f"{plan.group_id}/payload/"
    reads = sorted(
        (w, op.key.removeprefix(prefix))
        for w in plan.routing.regions
        for stage in plan.worker_slice(w).stages
        for batch in stage
        for op in batch.reads
    )
    assert reads == sorted((f"e/tp{i % 2}", f"experts.{i}.w") for i in range(4))
    assert plan.pushed_bytes == 0 and plan.store_read_bytes == 4 * 32


def _described_parts(manifest: Any, workers: list[dict]) -> list[Any]:
    layouts = update_module._engine_layout(manifest, workers)
    return [d.part for d in update_module._engine_parts(manifest, layouts).values()]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(), clusters())
def test_every_described_tensor_has_the_descriptor_the_library_builds(
    specs: list[TensorSpec], cluster: list[tuple[str, int]]
) -> None:
    """Descriptors after the first of a placement skip mooncake.reshard's constructor:
    it must accept their fields and give an equal descriptor, split along the dim the
    engine cuts (``simulated_engines``: the first its TP size divides), else replicated."""
    manifest = build_manifest("m", 1, specs, "now")
    for workers in simulated_engines(specs, cluster, "direct").values():
        tp = workers[0]["tp_size"]
        for part in _described_parts(manifest, workers):
            described = {d.tensor_id: d for d in part.tensors}
            assert len(described) == len(part.tensors) == len(specs)
            for spec in specs:
                descriptor = described[spec.name]
                assert TensorDescriptor(**vars(descriptor)) == descriptor
                cut = [d for d, n in enumerate(spec.shape) if tp > 1 and n % tp == 0][:1]
                if cut:
                    axes: tuple[Any, ...] = (SplitAxis("tp", cut[0]),)
                else:
                    axes = (ReplicatedAxis("tp"),) if tp > 1 else ()
                assert (descriptor.shard_dims, descriptor.parallel_axes) == (tuple(cut), axes)


def test_a_placed_descriptor_takes_only_declared_fields() -> None:
    """A descriptor takes a checked placement by a copy of its fields; anything else the
    source instance holds (a value some library version caches on it) stays behind, since
    it may depend on the placement it had."""
    manifest = build_manifest("m", 1, [TensorSpec("a", (4, 2), "float32")], "now")
    source = manifest.tensors[0]
    like = replace(source, shard_dims=(0,), parallel_axes=(SplitAxis("tp", 0),))
    object.__setattr__(source, "_cached_by_a_library", "for the old placement")
    placed = update_module._placed_like(source, like)
    assert vars(placed).keys() == {f.name for f in fields(TensorDescriptor)}
    assert placed == like and TensorDescriptor(**vars(placed)) == like


def test_descriptors_say_split_replicated_or_owned_as_the_boxes_do() -> None:
    specs = [
        TensorSpec("split", (4, 2), "float32"),
        TensorSpec("whole", (4, 2), "float32"),
        *(TensorSpec(f"experts.{i}.w", (4, 2), "float32") for i in range(2)),
    ]
    manifest = build_manifest("m", 1, specs, "now")
    engines = {
        "http://e": [
            _worker(
                r,
                2,
                {"split": 16, "whole": 32, f"experts.{r}.w": 32},
                [
                    ("split", (2 * r, 0), (2, 2), "split", 0),
                    ("whole", (0, 0), (4, 2), "whole", 0),
                    (f"experts.{r}.w", (0, 0), (4, 2), f"experts.{r}.w", 0),
                ],
            )
            for r in range(2)
        ]
    }
    axes = {
        d.tensor_id: (d.shard_dims, d.parallel_axes)
        for part in _described_parts(manifest, engines["http://e"])
        for d in part.tensors
    }
    assert axes == {
        "split": ((0,), (SplitAxis("tp", 0),)),
        "whole": ((), (ReplicatedAxis("tp"),)),
        "experts.0.w": ((), (OwnershipAxis("tp"),)),
        "experts.1.w": ((), (OwnershipAxis("tp"),)),
    }


def test_a_tensor_cut_along_two_dims_is_refused_by_name() -> None:
    specs = [TensorSpec("t", (4, 4), "float32")]
    engines = {
        "http://e": [
            _worker(r, 2, {"t": 32}, [("t", (2 * r, 2 * r), (2, 2), "t", 0)]) for r in range(2)
        ]
    }
    with pytest.raises(InvariantViolation, match="t is split along several dimensions"):
        plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 64, RoutingCache())


@pytest.mark.parametrize(
    ("offset", "shape"),
    [((2, 0), (4, 4)), ((0,), (4,)), ((0, 0, 0), (4, 4, 1))],
    ids=["past-the-end", "fewer-dims", "more-dims"],
)
def test_a_box_that_does_not_fit_its_tensor_is_refused_before_planning(
    offset: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    specs = [TensorSpec("t", (4, 4), "float32")]
    workers = [_worker(0, 1, {"t": 64}, [("t", offset, shape, "t", 0)])]
    with pytest.raises(InvariantViolation, match=r"\(tensor t\)"):
        manifest = build_manifest("m", 1, specs, "now")
        plan_update(manifest, {"http://e": workers}, "direct", 64, RoutingCache())


def test_engines_splitting_one_tensor_along_different_dims() -> None:
    """TP2 splits dim 1 (24-byte rows, 48 apart), TP4 splits dim 2 (2-byte rows, 8 apart):
    the object's grid pitch is 8, so the TP2 ranks receive 2-byte columns strided by 8
    inside one of their 24-byte rows; the plan must be accepted and exact."""
    specs = [TensorSpec("t0", (3, 6, 4), "bfloat16")]
    engines = simulated_engines(specs, [("n0", 2), ("n0", 4)], "direct")
    plan = plan_update(build_manifest("m", 1, specs, "now"), engines, "direct", 16, RoutingCache())
    objects = {"t0": np.random.default_rng(0).integers(0, 256, specs[0].nbytes, dtype=np.uint8)}
    memory = simulate(plan, objects)
    for workers in engines.values():
        for worker in workers:
            for shard in worker["shards"]:
                want = expected_shard(specs[0], objects["t0"], shard)
                assert np.array_equal(memory[(worker["worker_id"], shard["region"])], want)
    assert plan.store_read_bytes == plan.unique_demand_bytes == specs[0].nbytes


def test_a_hit_reads_no_boxes_and_a_miss_reads_each_distinct_placement() -> None:
    """Engines described without boxes (``GET /mooncake/placement?boxes=false``) are planned
    from the cache when it holds the table and the layouts (each worker checks at prepare
    that its slice names its own placement, tests/sglang); a miss reads each distinct
    placement's boxes through ``describe`` and checks its reports against them first."""
    specs = [TensorSpec("a", (4, 4), "float32"), TensorSpec("b", (8,), "float16")]
    engines = reporting(simulated_engines(specs, [("n0", 2), ("n1", 2), ("n2", 1)], "direct"))
    bare = {url: [without_boxes(w) for w in ws] for url, ws in engines.items()}
    gen = [build_manifest("m", g, specs, "now") for g in (1, 2, 3)]
    cache, asked = RoutingCache(), []

    def describe(urls: list[str]) -> dict[str, Any]:
        asked.append(list(urls))
        return {url: engines[url] for url in urls}

    distinct = ["http://engine0", "http://engine2"]  # engine1 is engine0's placement
    assert cache.boxes_wanted(gen[0], bare, "direct", 64) == distinct
    assert cache.boxes_wanted(gen[0], bare, "compat", 64) == []
    with pytest.raises(InvariantViolation, match="http://engine0 was described without its boxes"):
        plan_update(gen[0], bare, "direct", 64, cache)
    first = plan_update(gen[0], bare, "direct", 64, cache, describe=describe)
    assert asked == [distinct]  # one read of each distinct placement's boxes
    assert_direct_shards_land(first, engines, specs, seed=6)
    assert cache.boxes_wanted(gen[1], bare, "direct", 64) == []
    hit = plan_update(gen[1], bare, "direct", 64, cache)  # no describe: reads no box
    assert hit.routing.table is first.routing.table and (cache.hits, cache.misses) == (1, 2)
    assert hit.routing is first.routing  # kept whole: no layout read, no region merged
    assert_direct_shards_land(hit, engines, specs, seed=7)
    cache.plans = Lru(1)  # a hit on a table whose plan was dropped: layouts from the cache
    again = plan_update(gen[1], bare, "direct", 64, cache)
    assert again.routing is not first.routing and again.routing.table is first.routing.table
    assert again.routing.regions == first.routing.regions
    assert again.routing.region_dtypes == first.routing.region_dtypes
    assert cache.boxes_wanted(gen[1], bare, "direct", 128) == distinct  # another table

    # A describe reply whose boxes are another placement than the reports named is refused.
    changed = {url: [dict(w) for w in ws] for url, ws in engines.items()}
    changed["http://engine2"][0]["tp_size"] = 2
    changed["http://engine2"][0][PLACEMENT_DIGEST] = placement_digest(changed["http://engine2"][0])
    with pytest.raises(InvariantViolation, match="engine http://engine2 describes another"):
        plan_update(gen[2], bare, "direct", 128, cache, describe=lambda urls: changed)
