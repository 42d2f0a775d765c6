"""Routing tables kept in the Store: a fresh cache loads exactly the table planned cold, a bad
entry is never used, and the entry encoding round-trips any table."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import TensorSpec, build_manifest
from mooncake_rl.plan import demand as demand_module
from mooncake_rl.plan import planner as planner_module
from mooncake_rl.plan.cache import PlanKey
from mooncake_rl.plan.demand import CompatLayout
from mooncake_rl.plan.params import PlanParams
from mooncake_rl.plan.stored import (
    FORMAT_VERSION,
    PREFIX,
    LocalTables,
    decode_table,
    encode_table,
    entry_key,
)
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.plan.table import (
    DEMAND_DTYPE,
    PUSH_DTYPE,
    READ_DTYPE,
    REGION_DTYPE,
    RoutingTable,
)
from mooncake_rl.plan.update import RoutingCache, RoutingPlan
from mooncake_rl.protocol import PLACEMENT_DIGEST, placement_digest
from mooncake_rl.services import EmbeddedMaster, SegmentHolder
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from tests.conftest import settings_for, trainer_settings

from .helpers import bench_plan, reporting

CLUSTERS = {"compat": [("n0", 1), ("n0", 1), ("n1", 1)], "direct": [("n0", 2), ("n1", 2)]}
BATCH = 4096


def specs() -> list[TensorSpec]:
    """A small model whose tensor names are new to this master: a layout no test planned."""
    tag = uuid.uuid4().hex[:8]
    return [
        TensorSpec(f"{tag}.a", (64, 32), "float32"),
        TensorSpec(f"{tag}.b", (8, 96), "bfloat16"),
        TensorSpec(f"{tag}.c", (128,), "float32"),
    ]


def key_of(table: RoutingTable) -> PlanKey:
    return PlanKey(table.source_digest, table.target_digest, table.topology_digest, table.params)


def assert_same_table(got: RoutingTable, want: RoutingTable) -> None:
    for name in ("worker_node", "object_sizes", "region_sizes", "reads", "pushes", "demands"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    for name in (
        "mode",
        "source_digest",
        "target_digest",
        "topology_digest",
        "params",
        "workers",
        "nodes",
        "objects",
        "regions",
        "lower_bound_bytes",
        "max_chunk_cost",
    ):
        assert getattr(got, name) == getattr(want, name), name
    assert (got.compat is None) == (want.compat is None)
    if want.compat is not None:
        assert got.compat.tensor_ids == want.compat.tensor_ids
        assert got.compat.total_bytes == want.compat.total_bytes
        assert np.array_equal(got.compat.offsets, want.compat.offsets)
        assert np.array_equal(got.compat.nbytes, want.compat.nbytes)


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every table the planner builds (cache misses), in order."""
    calls: list[Any] = []
    real = planner_module.build_routing_table

    def counting(*args: Any, **kwargs: Any) -> RoutingTable:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(planner_module, "build_routing_table", counting)
    return calls


@pytest.fixture
def coordinator_settings(master, holders) -> Settings:
    """A short-lived coordinator client: it lends nothing, tables go to its node's holder."""
    return trainer_settings(master, holders("plans"), "coordinator")


@pytest.fixture
def store(coordinator_settings: Settings) -> Iterator[StoreClient]:
    """One client per test: closing a Mooncake client takes about a second."""
    with StoreClient(coordinator_settings) as client:
        yield client


def plan_in_fresh_process(
    store: StoreClient, mode: str, model: list[TensorSpec], generation: int, batch: int = BATCH
) -> tuple[RoutingPlan, RoutingCache]:
    """What a new ``mooncake-rl update`` process does: an empty cache over the Store (the
    cache holds all of a process's planning state; the client holds none)."""
    manifest = build_manifest("stored", generation, model, "now")
    cache = RoutingCache(store)
    plan = cache.get_or_plan(manifest, simulated_engines(model, CLUSTERS[mode], mode), mode, batch)
    return plan, cache


@pytest.mark.parametrize("mode", ["compat", "direct"])
def test_a_fresh_process_loads_exactly_the_cold_table(
    store: StoreClient, planned: list[Any], mode: str
) -> None:
    model = specs()
    cold, first = plan_in_fresh_process(store, mode, model, generation=1)
    assert (first.hits, first.loads, first.misses) == (0, 0, 1) and len(planned) == 1
    hit, second = plan_in_fresh_process(store, mode, model, generation=2)
    assert (second.hits, second.loads, second.misses) == (0, 1, 0) and len(planned) == 1
    assert_same_table(hit.table, cold.table)
    assert hit.regions == cold.regions and hit.layout == cold.layout
    # Another batch is another plan key: planned, not loaded.
    plan_in_fresh_process(store, mode, model, generation=2, batch=2 * BATCH)
    assert len(planned) == 2


def _flip_body_byte(entry: np.ndarray, other: np.ndarray) -> np.ndarray:
    entry[-1] ^= 0xFF
    return entry


def _next_version(entry: np.ndarray, other: np.ndarray) -> np.ndarray:
    magic, _, header = PREFIX.unpack_from(entry)
    entry[: PREFIX.size] = np.frombuffer(PREFIX.pack(magic, FORMAT_VERSION + 1, header), np.uint8)
    return entry


CORRUPTIONS: dict[str, tuple[Callable[[np.ndarray, np.ndarray], np.ndarray], str]] = {
    "body": (_flip_body_byte, "does not match its digest"),
    "cut": (lambda entry, other: entry[: len(entry) - 64], "does not match its digest"),
    "version": (_next_version, f"this reader knows {FORMAT_VERSION}"),
    "foreign": (lambda entry, other: other, "stored for another plan key"),
    "garbage": (lambda entry, other: np.full(256, 7, np.uint8), "not a routing table"),
    "truncated": (lambda entry, other: entry[:5], "truncated"),
    "header": (lambda entry, other: _garbled_header(entry), "header does not parse"),
}


def _garbled_header(entry: np.ndarray) -> np.ndarray:
    entry[PREFIX.size] = ord("}")
    return entry


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_bad_entry_is_ignored_replanned_and_replaced(
    store: StoreClient,
    planned: list[Any],
    caplog: pytest.LogCaptureFixture,
    corruption: str,
) -> None:
    corrupt, reason = CORRUPTIONS[corruption]
    model = specs()
    cold, _ = plan_in_fresh_process(store, "direct", model, generation=1)
    other, _ = plan_in_fresh_process(store, "direct", model, 1, batch=2 * BATCH)
    name = entry_key(key_of(cold.table))
    bad = corrupt(store.get_array(name).copy(), store.get_array(entry_key(key_of(other.table))))
    store.remove([name], force=True)
    store.put_tensor(name, torch.from_numpy(np.ascontiguousarray(bad)), hard_pin=False)
    with caplog.at_level(logging.WARNING, logger="mooncake_rl.plan.stored"):
        replanned, cache = plan_in_fresh_process(store, "direct", model, 2)
    assert (cache.loads, cache.misses) == (0, 1) and len(planned) == 3
    assert any(name in r.message and reason in r.message for r in caplog.records), caplog.text
    assert_same_table(replanned.table, cold.table)
    # The replanned table replaced the bad entry: the next process loads it.
    loaded, cache = plan_in_fresh_process(store, "direct", model, 3)
    assert (cache.loads, cache.misses) == (1, 0) and len(planned) == 3
    assert_same_table(loaded.table, cold.table)


def test_a_lost_holder_only_warns(planned: list[Any], caplog: pytest.LogCaptureFixture) -> None:
    """The holder keeping the table is stopped (its own master, so no other segment can take
    the replacement): the read fails, the table is replanned, keeping it fails; planning
    itself never does."""
    model = specs()
    with EmbeddedMaster() as master:
        holder = SegmentHolder(master.master_address, master.metadata_url, 32 << 20).start()
        try:
            settings = settings_for(master, "plans", segment_bytes=0, local_segment=holder.segment)
            with StoreClient(settings) as store:
                cold, _ = plan_in_fresh_process(store, "compat", model, generation=1)
                holder.stop()
                with caplog.at_level(logging.WARNING, logger="mooncake_rl.plan.stored"):
                    replanned, cache = plan_in_fresh_process(store, "compat", model, 2)
        finally:
            holder.stop()
    assert (cache.loads, cache.misses) == (0, 1) and len(planned) == 2
    assert_same_table(replanned.table, cold.table)
    assert "cannot be read" in caplog.text and "is not kept in the Store" in caplog.text


# -- the encoding, on arbitrary tables ---------------------------------------------------------
NAME = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=6)


def _ints(draw: Any, dtype: np.dtype, count: int) -> np.ndarray:
    """``count`` integers anywhere in ``dtype``'s range."""
    info = np.iinfo(dtype)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.integers(info.min, info.max, count, dtype, endpoint=True)


def _records(draw: Any, dtype: np.dtype, order: tuple[str, ...] = ()) -> np.ndarray:
    """Records of ``dtype``, every field anywhere in its range, sorted by ``order``."""
    count = draw(st.integers(0, 40))
    records = np.zeros(count, dtype)
    for name in dtype.names:
        records[name] = _ints(draw, dtype.fields[name][0], count)
    return np.sort(records, order=list(order)) if order else records


@st.composite
def tables(draw: Any) -> RoutingTable:
    workers = tuple(draw(st.lists(NAME, min_size=1, max_size=4, unique=True)))
    nodes = tuple(draw(st.lists(NAME, min_size=1, max_size=3, unique=True)))
    objects = tuple(draw(st.lists(NAME, max_size=5, unique=True)))
    regions = ("staging", *draw(st.lists(NAME, max_size=4)))
    compat = None
    if draw(st.booleans()):
        ids = tuple(draw(st.lists(NAME, max_size=4)))
        compat = CompatLayout(
            ids,
            _ints(draw, np.dtype(np.int64), len(ids)),
            _ints(draw, np.dtype(np.int64), len(ids)),
            draw(st.integers(0, 2**63 - 1)),
        )
    return RoutingTable(
        mode=draw(st.sampled_from(["compat", "direct"])),
        source_digest=draw(st.text(max_size=64)),
        target_digest=draw(st.text(max_size=64)),
        topology_digest=draw(st.text(max_size=64)),
        params=PlanParams(
            batch_bytes=draw(st.integers(1, 2**62)),
            balance_slack=draw(st.floats(1e-6, 1.0)),
            min_chunk_bytes=draw(st.integers(1, 2**40)),
            align=draw(st.integers(1, 4096)),
        ),
        workers=workers,
        nodes=nodes,
        worker_node=_ints(draw, np.dtype(np.int64), len(workers)),
        objects=objects,
        object_sizes=_ints(draw, np.dtype(np.int64), len(objects)),
        regions=regions,
        region_sizes=_records(draw, REGION_DTYPE),
        reads=_records(draw, READ_DTYPE, ("worker", "batch")),
        pushes=_records(draw, PUSH_DTYPE, ("worker", "stage", "batch")),
        demands=_records(draw, DEMAND_DTYPE),
        compat=compat,
        lower_bound_bytes=draw(st.integers(0, 2**63 - 1)),
        max_chunk_cost=draw(st.integers(0, 2**63 - 1)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tables())
def test_the_encoding_round_trips_any_table_and_binds_it_to_its_key(table: RoutingTable) -> None:
    entry = encode_table(table)
    key = key_of(table)
    assert_same_table(decode_table(entry, key), table)
    assert_same_table(decode_table(entry.copy(), key), table)  # no state shared with the encoder
    other = key._replace(params=PlanParams(batch_bytes=table.params.batch_bytes % (2**62) + 1))
    with pytest.raises(InvariantViolation, match="another plan key"):
        decode_table(entry, other)
    assert entry_key(key) != entry_key(other)


def test_a_name_with_nul_is_not_encoded() -> None:
    with pytest.raises(InvariantViolation, match="NUL"):
        encode_table(
            RoutingTable(
                mode="direct",
                source_digest="s",
                target_digest="t",
                topology_digest="p",
                params=PlanParams(),
                workers=("w\0",),
                nodes=("n",),
                worker_node=np.zeros(1, np.int64),
                objects=(),
                object_sizes=np.zeros(0, np.int64),
                regions=("staging",),
                region_sizes=np.zeros(0, REGION_DTYPE),
                reads=np.zeros(0, READ_DTYPE),
                pushes=np.zeros(0, PUSH_DTYPE),
                demands=np.zeros(0, DEMAND_DTYPE),
                compat=None,
                lower_bound_bytes=0,
                max_chunk_cost=0,
            )
        )


def test_the_plan_bench_loads_the_table_in_a_fresh_process() -> None:
    result = bench_plan("--model", "small", "--target", "2xTP4", "--store")
    assert result["store_entry_bytes"] > 0
    for path in ("fresh_process_store", "fresh_process_local_copy"):
        fresh = result[path]
        assert fresh["store_hit_equals_cold"] is True, path
        assert 0 < fresh["store_hit_load_seconds"] <= fresh["plan_seconds_store_hit"], path


# -- the node-local copy -----------------------------------------------------------------------
def test_the_next_process_on_the_node_maps_its_copy_and_a_bad_copy_is_dropped(
    coordinator_settings: Settings,
    planned: list[Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = specs()
    local = coordinator_settings.model_copy(update={"plan_dir": tmp_path / "plans"})
    with StoreClient(local) as store:
        cold, _ = plan_in_fresh_process(store, "direct", model, generation=1)
        name = entry_key(key_of(cold.table))
        copy = LocalTables(tmp_path / "plans").path(name)
        assert copy.read_bytes() == store.get_array(name).tobytes()
        store.remove([name], force=True)  # only the node-local copy is left
        mapped, cache = plan_in_fresh_process(store, "direct", model, generation=2)
        assert (cache.loads, cache.misses) == (1, 0) and len(planned) == 1
        assert_same_table(mapped.table, cold.table)
        assert not mapped.table.reads.flags.writeable  # a read-only map of the file
        entry = bytearray(copy.read_bytes())
        entry[-1] ^= 0xFF
        copy.write_bytes(entry)
        with caplog.at_level(logging.WARNING, logger="mooncake_rl.plan.stored"):
            replanned, cache = plan_in_fresh_process(store, "direct", model, generation=3)
    assert (cache.loads, cache.misses) == (0, 1) and len(planned) == 2
    assert f"ignoring routing table file {copy}" in caplog.text
    assert "does not match its digest" in caplog.text
    assert_same_table(replanned.table, cold.table)
    assert copy.read_bytes() == encode_table(cold.table).tobytes()  # replaced by the replan


def test_the_plan_folder_keeps_the_newest_tables(tmp_path: Path) -> None:
    folder = LocalTables(tmp_path, keep=2)
    for index, name in enumerate(("a", "b", "c")):
        folder.write(name, np.full(8, index, np.uint8))
        os.utime(folder.path(name), (index, index))  # a strict age order
    assert sorted(tmp_path.iterdir()) == sorted([folder.path("b"), folder.path("c")])
    assert np.array_equal(folder.read("c"), np.full(8, 2, np.uint8))
    assert folder.read("a") is None
    with pytest.raises(InvariantViolation, match="at least one"):
        LocalTables(tmp_path, keep=0)


# -- the key from the engines' reports ---------------------------------------------------------
def test_reported_placements_key_the_table_and_a_false_report_is_refused(
    store: StoreClient, planned: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = specs()
    engines = reporting(simulated_engines(model, CLUSTERS["direct"], "direct"))
    cold = RoutingCache(store).get_or_plan(
        build_manifest("stored", 1, model, "now"), engines, "direct", BATCH
    )
    hashed: list[Any] = []
    real = demand_module.part_digest
    monkeypatch.setattr(
        demand_module, "part_digest", lambda part: hashed.append(part) or real(part)
    )
    fresh = RoutingCache(store)
    hit = fresh.get_or_plan(build_manifest("stored", 2, model, "now"), engines, "direct", BATCH)
    assert (fresh.loads, fresh.misses, len(planned)) == (1, 0, 1)
    assert hashed == []  # the key came from the reports: no fragment was hashed
    assert_same_table(hit.table, cold.table)
    # Without reports (an engine of an older version) the same key is computed here.
    unreported = simulated_engines(model, CLUSTERS["direct"], "direct")
    again = RoutingCache(store)
    again.get_or_plan(build_manifest("stored", 3, model, "now"), unreported, "direct", BATCH)
    assert (again.loads, again.misses) == (1, 0)
    # A report that is not its description's digest is refused before anything is planned.
    other = specs()
    lying = reporting(simulated_engines(other, CLUSTERS["direct"], "direct"))
    worker = lying[next(iter(lying))][0]
    worker[PLACEMENT_DIGEST] = placement_digest({**worker, "tp_rank": 99})
    with pytest.raises(InvariantViolation, match=f"worker {worker['worker_id']} reported"):
        RoutingCache(store).get_or_plan(
            build_manifest("stored", 1, other, "now"), lying, "direct", BATCH
        )
    worker[PLACEMENT_DIGEST] = "not-a-digest"  # malformed: refused before any lookup
    with pytest.raises(InvariantViolation, match="'not-a-digest', not a SHA-256 hex digest"):
        RoutingCache(store).get_or_plan(
            build_manifest("stored", 1, other, "now"), lying, "direct", BATCH
        )
    assert len(planned) == 1
