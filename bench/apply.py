"""Apply throughput: ``python -m bench.apply --size 1GiB --workers 4 --nodes 2 --mode direct``.

Publishes a synthetic model, plans an update for simulated workers (one process each, split
over node labels), runs it with real Store reads and TE pushes, and prints one JSON object:
this project's figures, the raw TE loopback GB/s measured in the same run, the pipeline
efficiency, and the same update done naively (every worker reads all it needs itself).
Updates check what they read against the generation's checksum table, as engines do;
``checksums`` compares the same update with and without that check (``--repeats`` runs each,
alternating) and gives the check's share of update time. In compat mode ``pulls`` runs the
update planned with a single pull and with a pull per node (``PlanParams.pull``),
alternating, ``--repeats`` times each.

With ``--delta-rate R`` (direct mode) it compares a delta generation's two updates instead:

    synthetic model --publish_local--> keyframe; R of its elements changed --publish_local
        (DeltaPolicy, the keyframe kept)--> N as a delta; N realized from its chain
    workers (one TP=1 engine each: every box a whole tensor) holding the keyframe
        --full: the planned update of N (Store reads, TE pushes, reads checked)
        --delta: in each worker at once, fetch its entries, scatter, check against N
        (``mooncake_rl.apply.delta``)--> every region compared with N's bytes

alternating, ``--repeats`` times each: bytes moved, median seconds, their ratios against
issue 52's goals (at most 1/10 of the bytes, 1/4 of the seconds), and the Store's
``get_into`` GB/s of the same run.

The pieces (publishing, planning, the naive baseline, measuring, raw TE) are shared with
``python -m bench`` (``bench.compare``), which runs every approach side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import torch
from mooncake.reshard.weight import WeightManifest

from bench.common import get_into_gbps, parse_size, store_services, synthetic_model
from bench.common import specs_of as bench_specs
from bench.delta import adam_steps
from bench.ops import host
from mooncake_rl.apply.delta import DeltaRead, delta_reads
from mooncake_rl.apply.executor import Batch, PushOp, ReadOp
from mooncake_rl.apply.process import WorkerCluster, run_planned_update
from mooncake_rl.apply.wire import WorkerSlice
from mooncake_rl.coordinator.delta import BoxRow
from mooncake_rl.generations.catalog import specs_of
from mooncake_rl.generations.chain import (
    DeltaPolicy,
    DeltaTable,
    load_delta_table,
    realize_generation,
)
from mooncake_rl.generations.checksums import ChecksumTable, ObjectChecksum
from mooncake_rl.generations.pack_order import PackOrder, save_pack_order
from mooncake_rl.generations.packing import object_extents
from mooncake_rl.generations.publisher import LastPublished, publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.plan.delta import DeltaDemand, EntryBlock, entry_blocks, plan_delta_fetch
from mooncake_rl.plan.synthetic import shard_bytes, simulated_engines
from mooncake_rl.plan.table import bind, record_ranges
from mooncake_rl.plan.update import RoutingCache, UpdatePlan, plan_update
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

MODES = ("compat", "direct")
Model = list[tuple[str, torch.Tensor]]
Engines = dict[str, list[dict[str, Any]]]
"""Engine URL -> its workers' placements (``simulated_engines``)."""


def cluster_shape(workers: int, nodes: int, mode: str) -> list[tuple[str, int]]:
    """compat: one TP=1 engine per worker; direct: one TP engine per node (DP replicas)."""
    if workers % nodes:
        raise ValueError(f"{workers} workers do not split evenly over {nodes} nodes")
    if mode == "compat":
        return tp1_engines(workers, nodes)
    return [(f"node{n}", workers // nodes) for n in range(nodes)]


def tp1_engines(workers: int, nodes: int) -> list[tuple[str, int]]:
    """One TP=1 engine per worker, round robin over the node labels: every box is a whole
    tensor."""
    return [(f"node{w % nodes}", 1) for w in range(workers)]


@dataclass(frozen=True)
class Published:
    manifest: WeightManifest
    model_bytes: int
    shapes: tuple[tuple[int, ...], ...]  # in the model's tensor order
    checksums: Mapping[str, ObjectChecksum]
    generation: int
    seconds: float
    """How long the publish took (claim, puts, announce)."""


def publish_model(
    store: StoreClient,
    name: str,
    model: Model,
    delta: DeltaPolicy | None = None,
    kept: LastPublished | None = None,
) -> Published:
    """Publish ``model`` as bf16 from one process (with ``delta``: as the policy says)."""
    started = time.perf_counter()
    record = publish_local(store, name, model, dtype="bfloat16", delta=delta, kept=kept)
    seconds = time.perf_counter() - started
    registry = GenerationRegistry(store, name)
    manifest = registry.load_manifest(record.generation)
    table = registry.load_checksums(record.generation, record.checksums_digest)
    return Published(
        manifest,
        sum(t.numel() * t.element_size() for _, t in model),
        tuple(tuple(t.shape) for _, t in model),
        table.objects,
        record.generation,
        seconds,
    )


def publish_synthetic(
    settings: Settings,
    name: str,
    total_bytes: int,
    tensors: int,
    taught: Callable[[Model], Engines] | None = None,
) -> Published:
    """Publish ``synthetic_model(total_bytes, tensors)`` as bf16 from one process. With
    ``taught`` (the engines that will take it), packs are laid out in the order those
    engines' first update teaches (``generations.pack_order``): an RL run's steady state,
    as ``bench.gpu_check`` publishes; without, tensor after tensor, a run's first update."""
    model = synthetic_model(total_bytes, tensors)
    with StoreClient(settings) as store:
        if taught is not None:
            save_pack_order(store, name, PackOrder.of_engines(taught(model)))
        return publish_model(store, name, model)


def planned(
    manifest: WeightManifest,
    workers: int,
    nodes: int,
    mode: str,
    batch_bytes: int,
    pull: str = "single",
    by_columns: Collection[str] = (),
) -> tuple[UpdatePlan, dict[str, str]]:
    """The update plan for simulated engines, and each worker's node label."""
    plan, engines = planned_for(
        manifest, cluster_shape(workers, nodes, mode), mode, batch_bytes, pull, by_columns
    )
    return plan, worker_nodes(engines)


def planned_for(
    manifest: WeightManifest,
    cluster: list[tuple[str, int]],
    mode: str,
    batch_bytes: int,
    pull: str = "single",
    by_columns: Collection[str] = (),
) -> tuple[UpdatePlan, Engines]:
    """The update plan for simulated engines of ``cluster`` (node label, TP), and the
    engines' placements (worker descriptions: their regions and boxes); the tensors named
    in ``by_columns`` split by columns (``simulated_engines``)."""
    engines = simulated_engines(specs_of(manifest), cluster, mode, by_columns)
    return plan_update(manifest, engines, mode, batch_bytes, RoutingCache(), pull=pull), engines


def worker_nodes(engines: Engines) -> dict[str, str]:
    """Each simulated worker's node label."""
    return {w["worker_id"]: w["node"] for ws in engines.values() for w in ws}


def worker_settings(
    settings: Settings, nodes: Mapping[str, str], batch_bytes: int
) -> dict[str, Settings]:
    """Each worker on its node label; a watermark admitting four batches."""
    return {
        w: settings.with_overrides(
            node=n, batch_bytes=batch_bytes, staging_watermark_bytes=4 * batch_bytes
        )
        for w, n in nodes.items()
    }


def _chunked(reads: list[ReadOp], batch_bytes: int) -> tuple[Batch, ...]:
    batches, current, size = [], [], 0
    for read in reads:
        if current and size + read.length > batch_bytes:
            batches.append(Batch(tuple(current), ()))
            current, size = [], 0
        current.append(read)
        size += read.length
    return (*batches, Batch(tuple(current), ())) if current else tuple(batches)


@dataclass(frozen=True)
class NaivePlan:
    """The baseline: every worker reads everything it needs from the Store itself."""

    slices: dict[str, WorkerSlice]
    stages: int = 1

    def worker_slice(self, worker: str) -> WorkerSlice:
        return self.slices[worker]


def naive(plan: UpdatePlan, batch_bytes: int) -> NaivePlan:
    """One read per demanded row of every worker (the table's coverage contract), no pushes.

    On a compat plan every worker reads the whole model; on a direct plan, its own shards.
    """
    table = plan.routing.table
    keys = bind(table, plan.group_id).keys
    reads: dict[str, list[ReadOp]] = {w: [] for w in plan.routing.regions}
    for d in table.demands:
        worker, region = table.workers[int(d["worker"])], table.regions[int(d["dst_region"])]
        key = keys[int(d["object"])]
        for src, dst, length in record_ranges(d):
            reads[worker].append(ReadOp(key, src, region, dst, length))
    return NaivePlan(
        {
            w: WorkerSlice(
                plan.routing.regions[w], (_chunked(sorted(r, key=_by_source), batch_bytes),)
            )
            for w, r in reads.items()
        }
    )


def _by_source(op: ReadOp) -> tuple[str, int]:
    return op.key, op.src_offset


def node_nic_bytes(run: Mapping[str, Any], nodes: Mapping[str, str]) -> dict[str, int]:
    """NIC accounting by node label, from measured counters: Store bytes the node's workers
    read plus bytes they pushed to workers on other nodes (intra-node pushes cost 0)."""
    out = dict.fromkeys(sorted(set(nodes.values())), 0)
    for worker, counts in run["workers"].items():
        out[nodes[worker]] += counts["read"] + sum(
            moved
            for peer, moved in counts["pushed_per_peer"].items()
            if nodes[peer] != nodes[worker]
        )
    return out


def measure(
    cluster: WorkerCluster,
    plan: UpdatePlan | NaivePlan,
    nodes: Mapping[str, str],
    model_bytes: int,
    delivered: int,
    checksums: Mapping[str, ObjectChecksum] | None = None,
) -> dict[str, Any]:
    """Run one update on the cluster; figures from the workers' own byte counters. With
    ``checksums`` every worker checks its reads (``verify_seconds``: hashing time summed over
    workers, on their verify threads, overlapped with reads and pushes)."""
    run = run_planned_update(cluster, plan, checksums=checksums)
    seconds = run["seconds"]
    workers = run["workers"].values()
    nic = node_nic_bytes(run, nodes)
    return {
        "seconds": round(seconds, 4),
        "gbps": round(model_bytes / seconds / 1e9, 3),
        "delivered_bytes": delivered,
        "delivered_gbps": round(delivered / seconds / 1e9, 3),
        "store_read_bytes": sum(w["read"] for w in workers),
        "pushed_bytes": sum(w["pushed"] for w in workers),
        "max_node_nic_bytes": max(nic.values()),
        "node_nic_bytes": nic,
        "peak_staging_bytes": max(w["peak_staging"] for w in workers),
        "verified_bytes": sum(w["verified"] for w in workers),
        "unverified_bytes": sum(w["unverified"] for w in workers),
        "verify_seconds": round(sum(w["verify_seconds"] for w in workers), 4),
    }


def checksum_overhead(
    cluster: WorkerCluster,
    plan: UpdatePlan,
    nodes: Mapping[str, str],
    published: Published,
    delivered: int,
    repeats: int,
) -> dict[str, Any]:
    """The same update with and without checking reads, alternating; medians and share."""
    checked, unchecked = [], []
    for _ in range(repeats):
        args = (cluster, plan, nodes, published.model_bytes, delivered)
        checked.append(measure(*args, checksums=published.checksums))
        unchecked.append(measure(*args))
    with_s = statistics.median(r["seconds"] for r in checked)
    without_s = statistics.median(r["seconds"] for r in unchecked)
    last = checked[-1]
    return {
        "repeats": repeats,
        "seconds_checked": [r["seconds"] for r in checked],
        "seconds_unchecked": [r["seconds"] for r in unchecked],
        "median_seconds_checked": with_s,
        "median_seconds_unchecked": without_s,
        "overhead_fraction": round(with_s / without_s - 1, 4),
        "verify_seconds_per_worker": round(last["verify_seconds"] / len(nodes), 4),
        "verify_share_of_update": round(last["verify_seconds"] / len(nodes) / with_s, 4),
        "verified_bytes": last["verified_bytes"],
        "unverified_bytes": last["unverified_bytes"],
    }


def pull_comparison(
    cluster: WorkerCluster,
    plans: Mapping[str, UpdatePlan],
    nodes: Mapping[str, str],
    published: Published,
    delivered: int,
    repeats: int,
) -> dict[str, Any]:
    """The same update planned with each pull (``PlanParams.pull``), alternating, reads
    unchecked; median seconds and each pull's bytes, against the single pull."""
    runs: dict[str, list[dict[str, Any]]] = {pull: [] for pull in plans}
    for _ in range(repeats):
        for pull, plan in plans.items():
            runs[pull].append(measure(cluster, plan, nodes, published.model_bytes, delivered))
    medians = {pull: statistics.median(r["seconds"] for r in rs) for pull, rs in runs.items()}
    return {
        pull: {
            "seconds": [r["seconds"] for r in rs],
            "median_seconds": medians[pull],
            "vs_single": round(medians[pull] / medians["single"], 3),
            **{
                key: rs[-1][key]
                for key in ("store_read_bytes", "pushed_bytes", "max_node_nic_bytes")
            },
        }
        for pull, rs in runs.items()
    }


def raw_te_gbps(cluster: WorkerCluster, region_sizes: Mapping[str, Mapping[str, int]]) -> float:
    """One worker writes its largest region into another worker's, in 64 MiB batches."""
    first, second = sorted(region_sizes)[:2]
    region = max(region_sizes[first], key=lambda r: region_sizes[first][r])
    size = min(region_sizes[first][region], region_sizes[second].get(region, 0)) or 0
    if size == 0:
        return float("nan")
    chunk = 64 << 20
    batches = tuple(
        Batch((), (PushOp(second, region, o, region, o, min(chunk, size - o)),))
        for o in range(0, size, chunk)
    )
    descriptions = [cluster.call(w, "prepare", [()]) for w in (first, second)]
    started = time.perf_counter()
    cluster.call(first, "run", batches, descriptions)
    return size / (time.perf_counter() - started) / 1e9


DELTA_MODEL = "bench-apply-delta"
DELTA_SEED = 1
GOAL_DELTA_BYTES = 1 / 10
GOAL_DELTA_SECONDS = 1 / 4


def with_changes(model: Model, rate: float, seed: int = DELTA_SEED) -> Model:
    """``model`` (2-byte elements: bf16) with each element changed with probability
    ``rate``, at random places (seeded): its lowest bit flipped, so its bytes differ by the
    least a step can change them."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for name, tensor in model:
        bits = tensor.view(torch.int16).clone()
        changed = torch.rand(bits.shape, generator=generator) < rate
        bits[changed] ^= 1
        out.append((name, bits.view(tensor.dtype)))
    return out


def changed_fraction(base: Model, new: Model) -> float:
    """The fraction of elements whose bytes differ (2-byte elements)."""
    changed = sum(
        int((a.view(torch.int16) != b.view(torch.int16)).sum())
        for (_, a), (_, b) in zip(base, new, strict=True)
    )
    return changed / sum(t.numel() for _, t in base)


@dataclass(frozen=True)
class DeltaWorker:
    """A simulated worker serving the base, for the in-place delta path: the reads that
    rewrite its boxes, and its regions' bytes at the base and at N."""

    reads: tuple[DeltaRead, ...]
    blocks: tuple[EntryBlock, ...]
    base: Mapping[str, bytes]
    expected: Mapping[str, bytes]


def delta_workers(
    engines: Engines, published: Published, table: DeltaTable, base: Model, new: Model
) -> dict[str, DeltaWorker]:
    """Every worker of ``engines`` as a :class:`DeltaWorker` of the delta generation
    ``published`` (its boxes and regions as the planned update lands them)."""
    before, after = shard_bytes(engines, dict(base)), shard_bytes(engines, dict(new))
    out = {}
    for worker in (w for ws in engines.values() for w in ws):
        boxes = [BoxRow.of(shard) for shard in worker["shards"]]
        reads = delta_reads(
            published.manifest, published.checksums, table, boxes, set(worker["regions"])
        )
        name = worker["worker_id"]
        blocks = entry_blocks(table, [(r.key, r.offset, r.length) for r in reads])
        out[name] = DeltaWorker(tuple(reads), blocks, before[name], after[name])
    return out


def call_each(cluster: WorkerCluster, commands: Mapping[str, tuple]) -> dict[str, Any]:
    """Every worker's command at once; their values, or the first failure raised."""
    replies = cluster.call_all(commands)
    failed = {w: value for w, (status, value) in replies.items() if status != "ok"}
    if failed:
        raise RuntimeError(f"{commands[next(iter(failed))][0]} failed: {failed}")
    return {w: value for w, (_, value) in replies.items()}


def from_base(
    cluster: WorkerCluster,
    workers: Mapping[str, DeltaWorker],
    update: Callable[[], dict[str, Any]],
) -> tuple[dict[str, Any], bool]:
    """Fill every worker's regions with the base (not timed), run ``update``; its figures,
    and whether every region then holds N exactly (each dumped and compared)."""
    call_each(cluster, {w: ("fill", d.base) for w, d in workers.items()})
    figures = update()
    exact = all(
        np.array_equal(
            np.frombuffer(cluster.call(w, "dump", region), np.uint8),
            np.frombuffer(expected, np.uint8),
        )
        for w, d in workers.items()
        for region, expected in d.expected.items()
    )
    return figures, exact


def delta_update(
    cluster: WorkerCluster,
    table: DeltaTable,
    checksums: Mapping[str, ObjectChecksum],
    workers: Mapping[str, DeltaWorker],
    nodes: Mapping[str, str],
    batch_bytes: int,
) -> dict[str, Any]:
    """Every worker's in-place delta update, in its own process, on regions that hold the
    base, as engines take it: each entry buffer laid out and registered (not timed, as at
    an engine's prepare); then, timed, the planned fetch on every worker at once (each entry
    read from the Store once, pushed to the workers that share it), a barrier, and each
    worker's decode, scatter and check (:class:`mooncake_rl.apply.process.DeltaTaker`)."""
    demand = DeltaDemand({w: nodes[w] for w in workers}, {w: d.blocks for w, d in workers.items()})
    slices = plan_delta_fetch(demand, batch_bytes)
    described = call_each(
        cluster,
        {
            w: ("delta_prepare", table, d.reads, d.blocks, slices[w].stages[0])
            for w, d in workers.items()
        },
    )
    descriptions = list(described.values())
    started = time.perf_counter()
    fetched = call_each(cluster, {w: ("delta_fetch", descriptions) for w in workers})
    landed = call_each(
        cluster,
        {
            w: ("delta_land", {r.checksum_key: checksums[r.checksum_key] for r in d.reads})
            for w, d in workers.items()
        },
    )
    return {
        "seconds": time.perf_counter() - started,
        "workers": {w: {**fetched[w], **landed[w]} for w in workers},
    }


def delta_comparison(
    cluster: WorkerCluster,
    plan: UpdatePlan,
    nodes: Mapping[str, str],
    published: Published,
    table: DeltaTable,
    workers: Mapping[str, DeltaWorker],
    repeats: int,
    batch_bytes: int,
) -> dict[str, Any]:
    """The full planned update of N (reads checked) and the in-place delta update, each
    from regions holding the base, alternating; medians, bytes moved, and whether every
    region held N exactly after each run."""
    delivered = sum(plan.routing.received_bytes().values())
    checksums = published.checksums
    full_runs, delta_runs, exact = [], [], {"full": True, "delta": True}
    for _ in range(repeats):
        full, exact_full = from_base(
            cluster,
            workers,
            lambda: measure(cluster, plan, nodes, published.model_bytes, delivered, checksums),
        )
        delta, exact_delta = from_base(
            cluster,
            workers,
            lambda: delta_update(cluster, table, checksums, workers, nodes, batch_bytes),
        )
        full_runs.append(full)
        delta_runs.append(delta)
        exact["full"] &= exact_full
        exact["delta"] &= exact_delta

    def slowest(step: Callable[[Mapping[str, float]], float]) -> float:
        """The median over runs of the slowest worker's seconds in ``step``."""
        return round(
            statistics.median(max(map(step, r["workers"].values())) for r in delta_runs), 4
        )

    def summed(key: str) -> int:
        return sum(figures[key] for figures in delta_runs[-1]["workers"].values())

    last_full = full_runs[-1]
    full_moved = last_full["store_read_bytes"] + last_full["pushed_bytes"]
    full_s = statistics.median(r["seconds"] for r in full_runs)
    delta_s = statistics.median(r["seconds"] for r in delta_runs)
    delta_moved = summed("store_read_bytes") + summed("pushed_bytes")
    bytes_ratio = delta_moved / full_moved
    seconds_ratio = delta_s / full_s
    return {
        "full": {
            "seconds": [r["seconds"] for r in full_runs],
            "median_seconds": full_s,
            "moved_bytes": full_moved,
            **{k: last_full[k] for k in ("store_read_bytes", "pushed_bytes", "verified_bytes")},
        },
        "delta": {
            "seconds": [round(r["seconds"], 4) for r in delta_runs],
            "median_seconds": round(delta_s, 4),
            "median_slowest_fetch_seconds": slowest(lambda f: f["fetch_seconds"]),
            "median_slowest_decode_seconds": slowest(lambda f: f["decode_seconds"]),
            "median_slowest_scatter_check_seconds": slowest(
                lambda f: f["scatter_seconds"] + f["check_seconds"]
            ),
            "median_slowest_scatter_seconds": slowest(lambda f: f["scatter_seconds"]),
            "median_slowest_check_seconds": slowest(lambda f: f["check_seconds"]),
            "moved_bytes": delta_moved,
            "store_read_bytes": summed("store_read_bytes"),
            "pushed_bytes": summed("pushed_bytes"),
            "received_bytes": summed("entry_bytes"),
            "stored_bytes": table.delta_bytes,
            "changed_bytes": summed("changed_bytes"),
            "checked_bytes": summed("checked_bytes"),
            "reads": sum(len(d.reads) for d in workers.values()),
        },
        "exact": exact,
        "goals": {
            "bytes_ratio": round(bytes_ratio, 4),
            "bytes_at_most_1/10": bytes_ratio <= GOAL_DELTA_BYTES,
            "seconds_ratio": round(seconds_ratio, 4),
            "seconds_at_most_1/4": seconds_ratio <= GOAL_DELTA_SECONDS,
            "bit_exact": exact["full"] and exact["delta"],
        },
    }


def worker_threads(workers: int) -> int:
    """This host's cores shared among ``workers`` processes (at least one each)."""
    return max(1, (os.cpu_count() or 1) // workers)


@dataclass(frozen=True)
class DeltaPublished:
    """A keyframe, the delta generation N published after it, N's delta table, and how
    long rebuilding N's payloads from the chain took."""

    keyframe: Published
    generation: Published
    table: DeltaTable
    realize_seconds: float


def publish_delta(store: StoreClient, name: str, base: Model, new: Model) -> DeltaPublished:
    """Publish ``base`` (a keyframe), then ``new`` as a delta against it (this process's
    kept copy of the keyframe as the base), then realize ``new`` for full readers."""
    policy, kept = DeltaPolicy(), LastPublished()
    keyframe = publish_model(store, name, base, policy, kept)
    published = publish_model(store, name, new, policy, kept)
    table = load_delta_table(store, name, published.generation)
    if table is None or table.base != keyframe.generation:
        raise RuntimeError(f"generation {published.generation} was not published as a delta")
    started = time.perf_counter()
    realize_generation(store, name, published.generation, ChecksumTable(published.checksums))
    return DeltaPublished(keyframe, published, table, time.perf_counter() - started)


def delta_policies(size: int, args: argparse.Namespace) -> tuple[Model, Model]:
    """Two consecutive bf16 policies of the synthetic model's shapes: with ``--delta-lr``,
    fp32 masters (std 0.02, as trained weights) before and after one Adam step at that
    learning rate (``bench.delta.adam_steps``, random gradients, three warm-up steps);
    else the model and a copy with ``--delta-rate`` of its elements flipped."""
    base = synthetic_model(size, args.tensors)
    if args.delta_lr is None:
        return base, with_changes(base, args.delta_rate)
    generator = torch.Generator().manual_seed(DELTA_SEED)
    master = {n: torch.randn(t.shape, generator=generator) * 0.02 for n, t in base}
    before, after = adam_steps(master, args.delta_lr, 3, generator)
    return (
        [(n, before[n].to(torch.bfloat16)) for n, _ in base],
        [(n, after[n].to(torch.bfloat16)) for n, _ in base],
    )


def run_delta(args: argparse.Namespace, size: int, batch_bytes: int) -> dict[str, Any]:
    """Publish a keyframe of the synthetic model, then the next policy
    (:func:`delta_policies`) as a delta; then compare N's full update with the in-place delta
    update of workers at the keyframe (one TP=1 engine per worker, direct mode)."""
    base, new = delta_policies(size, args)
    # The keyframe, N's delta objects and N realized, with room to spare.
    with store_services(int(size * 2.4) + (64 << 20)) as (_, _, settings):
        with StoreClient(settings) as store:
            published = publish_delta(store, DELTA_MODEL, base, new)
        generation = published.generation
        plan, engines = planned_for(
            generation.manifest, tp1_engines(args.workers, args.nodes), "direct", batch_bytes
        )
        nodes = worker_nodes(engines)
        workers = delta_workers(engines, generation, published.table, base, new)
        # Workers sharing the cores each get their share of torch threads: more stall
        # torch's parallel scatter on a busy core (10x here), a cost no GPU worker pays.
        os.environ.setdefault("OMP_NUM_THREADS", str(worker_threads(args.workers)))
        with WorkerCluster(
            worker_settings(settings, nodes, batch_bytes), plan.routing.regions
        ) as cluster:
            compared = delta_comparison(
                cluster,
                plan,
                nodes,
                generation,
                published.table,
                workers,
                args.repeats,
                batch_bytes,
            )
        objects = {key: o.nbytes for key, o in object_extents(generation.manifest).items()}
        store_gbps = get_into_gbps(settings, "cpu", objects)
    return {
        "bench": "apply-delta",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": host(),
        "mode": "direct",
        "workers": args.workers,
        "nodes": args.nodes,
        "tensors": args.tensors,
        "model_bytes": generation.model_bytes,
        "delta_rate": args.delta_rate,
        "delta_lr": args.delta_lr,
        "changed_elements_fraction": round(changed_fraction(base, new), 5),
        "repeats": args.repeats,
        "torch_threads_per_worker": int(os.environ["OMP_NUM_THREADS"]),
        "publish_seconds": {
            "keyframe": round(published.keyframe.seconds, 4),
            "delta": round(generation.seconds, 4),
            "realize": round(published.realize_seconds, 4),
        },
        **compared,
        "store_get_into_gbps": round(store_gbps, 3),
        "full_gbps_over_get_into": round(
            generation.model_bytes / compared["full"]["median_seconds"] / 1e9 / store_gbps, 3
        ),
        "assumptions": {
            "workers": "one TP=1 engine per worker (round robin over node labels), so every "
            "box is a whole tensor (stored alone or a packed fragment), a checksummed unit; "
            "a TP>1 row shard of a tensor stored alone takes the full path",
            "full": "N realized from its chain first (publish_seconds.realize, not in the "
            "update); bench.apply's planned update in direct mode over worker processes, "
            "reads checked against N's checksums; moved: Store reads + TE pushes",
            "delta": "every worker's regions (those the full update lands in) hold the "
            "keyframe; delta_reads and the planned fetch made in the bench's process, each "
            "worker's entry buffer registered (not timed: an engine does both at prepare); "
            "then, timed, in every worker process at once: the fetch (each entry read from "
            "the Store once, pushed to the workers that share it), a barrier, then decode "
            "(hash-checked), scatter and check each box against N's checksums; seconds: the "
            "wall time of all workers; moved: Store reads + TE pushes",
            "changes": (
                "each bf16 element changed with probability delta_rate (seeded "
                f"{DELTA_SEED}): its lowest bit flipped"
                if args.delta_lr is None
                else "fp32 masters (std 0.02, seeded) after 3 Adam steps at delta_lr and "
                "after a fourth (random gradients), each cast to bf16"
            ),
            "threads": "each worker process runs torch with OMP_NUM_THREADS threads (its "
            "share of the cores unless set), for both updates",
            "exact": "each run starts from regions holding the keyframe; after it every "
            "region is dumped from its worker and compared with N's bytes",
        },
    }


def main() -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # Mooncake logs every connection at INFO
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--mode", choices=MODES, default="direct")
    parser.add_argument("--batch", default="64MiB")
    parser.add_argument("--repeats", type=int, default=3, help="checked/unchecked pairs")
    parser.add_argument(
        "--pack-order",
        action="store_true",
        help="publish as an RL run's steady state: packs laid out in the order the engines' "
        "first update teaches (the coordinator saves it; bench.gpu_check's default)",
    )
    parser.add_argument(
        "--row-parallel",
        action="store_true",
        help="direct mode: split every second tensor by columns, as TP engines split "
        "row-parallel layers (o_proj, down_proj); the others by rows",
    )
    parser.add_argument(
        "--delta-rate",
        type=float,
        help="instead: the full update of a generation with this fraction of elements "
        "changed against its in-place delta update (direct mode), e.g. 0.01",
    )
    parser.add_argument(
        "--delta-lr",
        type=float,
        help="instead: as --delta-rate, with the next policy one Adam step at this learning "
        "rate from fp32 masters (bench.delta), e.g. 1e-6",
    )
    args = parser.parse_args()
    batch_bytes = parse_size(args.batch)
    size = parse_size(args.size)
    if args.delta_rate is not None and args.delta_lr is not None:
        parser.error("--delta-rate and --delta-lr each make the next policy: give one")
    if args.row_parallel and (args.mode != "direct" or args.delta_rate or args.delta_lr):
        parser.error(
            "--row-parallel splits the shards of a direct-mode full update: give --mode "
            "direct, without --delta-rate or --delta-lr"
        )
    if args.pack_order and (args.delta_rate or args.delta_lr):
        parser.error(
            "--pack-order lays out the packs of a full update's generation: give it without "
            "--delta-rate or --delta-lr"
        )
    if args.delta_lr is not None and (args.mode != "direct" or not 0 < args.delta_lr < 1):
        parser.error("--delta-lr takes a learning rate in (0, 1) and --mode direct")
    if args.delta_lr is not None:
        print(json.dumps(run_delta(args, size, batch_bytes)))
        return
    if args.delta_rate is not None:
        if args.mode != "direct" or not 0 < args.delta_rate <= 1:
            parser.error("--delta-rate takes a rate in (0, 1] and --mode direct")
        print(json.dumps(run_delta(args, size, batch_bytes)))
        return
    with store_services(int(size * 1.2) + (64 << 20)) as (_, _, settings):
        by_columns = [f"w{i}" for i in range(1, args.tensors, 2)] if args.row_parallel else []
        shape = cluster_shape(args.workers, args.nodes, args.mode)
        published = publish_synthetic(
            settings,
            "bench-apply",
            size,
            args.tensors,
            (lambda m: simulated_engines(bench_specs(m), shape, args.mode, by_columns))
            if args.pack_order
            else None,
        )
        total = published.model_bytes
        plan, nodes = planned(
            published.manifest,
            args.workers,
            args.nodes,
            args.mode,
            batch_bytes,
            by_columns=by_columns,
        )
        pulls = {"single": plan}
        if args.mode == "compat":  # a pull per node lands in the same regions
            pulls["node"] = planned(
                published.manifest, args.workers, args.nodes, args.mode, batch_bytes, "node"
            )[0]
            assert pulls["node"].routing.regions == plan.routing.regions
        delivered = sum(plan.routing.received_bytes().values())
        with WorkerCluster(
            worker_settings(settings, nodes, batch_bytes), plan.routing.regions
        ) as cluster:
            raw = raw_te_gbps(cluster, plan.routing.regions)
            ours = measure(cluster, plan, nodes, total, delivered, published.checksums)
            overhead = checksum_overhead(cluster, plan, nodes, published, delivered, args.repeats)
            baseline = measure(cluster, naive(plan, batch_bytes), nodes, total, delivered)
            by_pull = (
                pull_comparison(cluster, pulls, nodes, published, delivered, args.repeats)
                if len(pulls) > 1
                else None
            )
        objects = {key: o.nbytes for key, o in object_extents(published.manifest).items()}
        store_gbps = get_into_gbps(settings, "cpu", objects)
    print(
        json.dumps(
            {
                "bench": "apply",
                "mode": args.mode,
                "workers": args.workers,
                "nodes": args.nodes,
                "split_by_columns": len(by_columns),
                "pack_order": args.pack_order,
                "model_bytes": total,
                "unique_demand_bytes": plan.unique_demand_bytes,
                **ours,
                "raw_te_gbps": round(raw, 3),
                "store_get_into_gbps": round(store_gbps, 3),
                "gbps_over_get_into": round(ours["gbps"] / store_gbps, 3),
                "pipeline_efficiency": round(ours["delivered_gbps"] / raw, 3),
                "naive": baseline,
                "checksums": overhead,
                "pulls": by_pull,
                "store_read_ratio_naive_over_ours": round(
                    baseline["store_read_bytes"] / ours["store_read_bytes"], 3
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
