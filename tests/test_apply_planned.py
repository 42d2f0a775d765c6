"""Planned updates on 4 worker processes over 2 node labels, real Store and TE, both modes."""

from __future__ import annotations

import pytest
import torch
import xxhash

from mooncake_rl.apply.process import WorkerCluster, WorkerMemory, run_planned_update
from mooncake_rl.generations.catalog import TensorSpec, specs_of
from mooncake_rl.generations.pack_order import PackOrder, save_pack_order
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.plan.demand import COMPAT_REGION
from mooncake_rl.plan.synthetic import shard_bytes, simulated_engines
from mooncake_rl.plan.update import RoutingCache, plan_update
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from tests.conftest import settings_for, trainer_settings

CLUSTERS = {
    "compat": [("node-a", 1), ("node-a", 1), ("node-b", 1), ("node-b", 1)],
    "direct": [("node-a", 2), ("node-b", 2)],
}


def random_model(seed: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (8, 96), (128,), (16, 4, 8), (40, 40), (2, 2)]
    return [(f"t{i}", torch.randn(shape, generator=generator)) for i, shape in enumerate(shapes)]


def published(master: EmbeddedMaster, holders, model: str, seed: int):
    with StoreClient(trainer_settings(master, holders("apply-store"), "trainer")) as store:
        publish_local(store, model, random_model(seed), dtype="float32")
        registry = GenerationRegistry(store, model)
        return registry.load_manifest(registry.active().generation)


def workers_for(master: EmbeddedMaster, engines: dict, **overrides: object) -> dict:
    given = {"batch_bytes": 4096, "staging_watermark_bytes": 16384} | overrides
    return {
        w["worker_id"]: settings_for(master, w["node"], segment_bytes=0, **given)
        for ws in engines.values()
        for w in ws
    }


@pytest.mark.parametrize(
    ("mode", "memory", "pull", "by_columns"),
    [
        ("compat", WorkerMemory(), "single", ()),
        ("compat", WorkerMemory(), "node", ()),
        ("direct", WorkerMemory(parameters=True, in_place=True), "single", ("t0", "t4")),
        ("direct", WorkerMemory(parameters=True), "single", ()),
    ],
    ids=["compat", "compat-pull-per-node", "direct-in-place-row-parallel", "direct-staged"],
)
def test_planned_update_is_byte_exact_and_single_pull(
    master: EmbeddedMaster,
    holders,
    mode: str,
    memory: WorkerMemory,
    pull: str,
    by_columns: tuple[str, ...],
) -> None:
    """Compat stages full tensors; direct lands each worker's shards, either straight into
    its live parameters (in place) or in its arena, then one batched copy into them. With a
    pull per node each node reads the model once and copies it inside the node only. In
    place, two tensors are split by columns (row-parallel layers): a shard is every row's
    slice of the tensor."""
    name = f"planned-{mode}-{memory.in_place}-{pull}-{len(by_columns)}"
    manifest = published(master, holders, name, seed=11)
    engines = simulated_engines(specs_of(manifest), CLUSTERS[mode], mode, by_columns)
    if by_columns:  # each rank holds a column block of every row
        shard = next(s for s in engines["http://engine0"][1]["shards"] if s["tensor"] == "t0")
        assert (shard["global_offset"], shard["local_shape"]) == ([0, 16], [64, 16])
    plan = plan_update(manifest, engines, mode, 4096, RoutingCache(), pull=pull)
    with WorkerCluster(workers_for(master, engines), plan.routing.regions, memory) as cluster:
        run = run_planned_update(cluster, plan)
        dumps = {
            w: {r: cluster.call(w, "dump", r) for r in plan.routing.regions[w]}
            for w in cluster.processes
        }
        landed = {w: cluster.call(w, "land") for w in cluster.processes}
        digests = {w: cluster.call(w, "digest") for w in cluster.processes}
    model = dict(random_model(11))
    tensors = {name: t.numpy() for name, t in model.items()}
    if mode == "compat":
        for regions in dumps.values():
            for entry in plan.routing.layout:
                raw = tensors[entry["name"]].tobytes()
                assert regions[COMPAT_REGION][entry["offset"] : entry["offset"] + len(raw)] == raw
    else:
        for worker, regions in shard_bytes(engines, model).items():
            for region, raw in regions.items():
                assert dumps[worker][region] == raw
            # The live parameters hold exactly the shards, whichever way they landed.
            assert digests[worker] == {r: xxhash.xxh3_64_hexdigest(b) for r, b in regions.items()}
            total = sum(len(b) for b in regions.values())
            split = (total, 0) if memory.in_place else (0, total)
            figures = landed[worker]
            assert (figures["in_place_bytes"], figures["staged_bytes"]) == split
            assert figures["tensors"] == len(regions)
    reads = sum(w["read"] for w in run["workers"].values())
    pushed = sum(w["pushed"] for w in run["workers"].values())
    pulls = len(plan.routing.table.nodes) if pull == "node" else 1
    assert reads == pulls * plan.unique_demand_bytes == plan.store_read_bytes
    assert reads == pulls * sum(t.nbytes for t in tensors.values())
    assert pushed == plan.pushed_bytes
    if pull == "node":  # each node's GPUs copy among themselves: nothing crosses a NIC
        table = plan.routing.table
        assert table.totals.cross_node_push_bytes == 0
        assert (table.pushes["stage"] == 1).all()
    assert max(w["peak_staging"] for w in run["workers"].values()) <= 16384


def test_dead_reader_makes_prepare_fail_with_nothing_written(
    master: EmbeddedMaster, holders
) -> None:
    manifest = published(master, holders, "planned-dead", seed=12)
    engines = simulated_engines(specs_of(manifest), CLUSTERS["compat"], "compat")
    plan = plan_update(manifest, engines, "compat", 4096, RoutingCache())
    with WorkerCluster(workers_for(master, engines), plan.routing.regions) as cluster:
        victim = sorted(cluster.processes)[-1]
        cluster.processes[victim].kill()
        cluster.processes[victim].join()
        with pytest.raises(RuntimeError, match=r"prepare failed: .*process alive: False"):
            run_planned_update(cluster, plan, timeout_s=20)
        for worker in cluster.processes:
            if worker != victim:
                assert cluster.call(worker, "dump", COMPAT_REGION) == bytes(
                    plan.routing.regions[worker][COMPAT_REGION]
                )


def landed_exactly(master, engines, plan, checksums, model, memory, batch) -> list[dict]:
    """Run ``plan`` on worker processes, land it, check every worker's parameters hold
    exactly its shards of ``model``; each worker's run figures."""
    workers = workers_for(master, engines, staging_watermark_bytes=4 * batch)
    with WorkerCluster(workers, plan.routing.regions, memory) as cluster:
        run = run_planned_update(cluster, plan, checksums=checksums)
        cluster.call_all({w: ("land",) for w in cluster.processes})
        digests = {w: cluster.call(w, "digest") for w in cluster.processes}
    for worker, regions in shard_bytes(engines, dict(model)).items():
        assert digests[worker] == {r: xxhash.xxh3_64_hexdigest(b) for r, b in regions.items()}
    return list(run["workers"].values())


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_a_sieved_pack_of_tp_split_tensors_lands_exactly_read_once_and_checked(
    master: EmbeddedMaster, holders, in_place: bool
) -> None:
    """200 small tensors in one pack, TP2 on one node: each rank's shards interleave with the
    other's, so the plan sieves them (``plan.sieve``): a few span reads, each span pushed
    once to the other rank, the shards copied out locally. The live parameters end up holding
    exactly the shards; every byte is read from the Store once and checked before use."""
    generator = torch.Generator().manual_seed(5)
    model = [(f"s{i}", torch.randn(8, 16, generator=generator)) for i in range(200)]
    name = f"sieved-{in_place}"
    with StoreClient(trainer_settings(master, holders("apply-store"), "trainer")) as store:
        publish_local(store, name, model, dtype="float32")
        registry = GenerationRegistry(store, name)
        record = registry.active()
        manifest = registry.load_manifest(record.generation)
        checksums = registry.load_checksums(record.generation, record.checksums_digest).objects
    assert len({f.object_key for f in manifest.fragments}) == 1  # one pack
    engines = simulated_engines(specs_of(manifest), [("node-a", 2)], "direct")
    batch = 256 << 10  # a span stays within half a batch: here the whole 100 KiB pack
    plan = plan_update(manifest, engines, "direct", batch, RoutingCache())
    table = plan.routing.table
    assert len(table.reads) == 1  # not one per shard (400)
    memory = WorkerMemory(parameters=True, in_place=in_place)
    figures = landed_exactly(master, engines, plan, checksums, model, memory, batch)
    nbytes = sum(t.nbytes for _, t in model)
    assert sum(w["read"] for w in figures) == nbytes == plan.store_read_bytes
    assert sum(w["verified"] for w in figures) == nbytes
    assert sum(w["copied"] for w in figures) == nbytes  # every shard copied out of a span
    assert sum(w["pushed"] for w in figures) == plan.pushed_bytes


def test_a_rank_major_pack_is_read_by_each_rank_alone_with_nothing_pushed(
    master: EmbeddedMaster, holders
) -> None:
    """The same 200 small tensors, published after the engines' cut was learnt
    (``generations.pack_order``): each rank's rows of the whole pack are one run, so each
    rank reads its own run once, checks every byte of it, pushes nothing to the other, and
    copies the run's pieces out in one move."""
    generator = torch.Generator().manual_seed(5)
    model = [(f"s{i}", torch.randn(8, 16, generator=generator)) for i in range(200)]
    name = "rank-major-planned"
    specs = [TensorSpec.of(n, t, "float32") for n, t in model]
    engines = simulated_engines(specs, [("node-a", 2)], "direct")
    with StoreClient(trainer_settings(master, holders("apply-store"), "trainer")) as store:
        assert save_pack_order(store, name, PackOrder.of_engines(engines))
        publish_local(store, name, model, dtype="float32")
        registry = GenerationRegistry(store, name)
        record = registry.active()
        manifest = registry.load_manifest(record.generation)
        checksums = registry.load_checksums(record.generation, record.checksums_digest).objects
    assert len({f.object_key for f in manifest.fragments}) == 1  # still one pack
    assert len(manifest.fragments) == 400  # a fragment per rank's rows of each tensor
    batch = 256 << 10
    plan = plan_update(manifest, engines, "direct", batch, RoutingCache())
    assert len(plan.routing.table.reads) == 2  # one run per rank
    assert plan.pushed_bytes == 0
    figures = landed_exactly(
        master, engines, plan, checksums, model, WorkerMemory(parameters=True), batch
    )
    nbytes = sum(t.nbytes for _, t in model)
    assert [w["read"] for w in figures] == [nbytes // 2, nbytes // 2]
    assert sum(w["verified"] for w in figures) == nbytes
    assert sum(w["pushed"] for w in figures) == 0
    # Its 200 pieces leave the run in one move: the arena lies in the order they are copied.
    assert [(w["copied"], w["copy_moves"]) for w in figures] == [(nbytes // 2, 1)] * 2


def test_a_reply_that_comes_after_its_call_gave_up_is_not_taken_for_the_next(
    master: EmbeddedMaster, holders
) -> None:
    """A call that gives up (a worker slow to answer on a loaded host) leaves its reply to
    come; the next call must get its own answer, not that one."""
    manifest = published(master, holders, "planned-late", seed=13)
    engines = simulated_engines(specs_of(manifest), [("node-a", 1)], "compat")
    plan = plan_update(manifest, engines, "compat", 4096, RoutingCache())
    with WorkerCluster(workers_for(master, engines), plan.routing.regions) as cluster:
        (worker,) = cluster.processes
        late = cluster.call_all({worker: ("dump", COMPAT_REGION)}, timeout_s=0)
        assert late[worker] == ("error", "no reply within 0s (process alive: True)")
        assert isinstance(cluster.call(worker, "digest"), dict)  # not the dump's bytes
