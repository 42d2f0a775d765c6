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

The pieces (publishing, planning, the naive baseline, measuring, raw TE) are shared with
``python -m bench`` (``bench.compare``), which runs every approach side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mooncake.reshard.weight import WeightManifest

from bench.common import get_into_gbps, parse_size, store_services, synthetic_model
from mooncake_rl.apply.executor import Batch, PushOp, ReadOp
from mooncake_rl.apply.process import WorkerCluster, run_planned_update
from mooncake_rl.apply.wire import WorkerSlice
from mooncake_rl.generations.catalog import specs_of
from mooncake_rl.generations.checksums import ObjectChecksum
from mooncake_rl.generations.packing import object_extents
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.plan.table import bind, record_ranges
from mooncake_rl.plan.update import RoutingCache, UpdatePlan, plan_update
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

MODES = ("compat", "direct")


def cluster_shape(workers: int, nodes: int, mode: str) -> list[tuple[str, int]]:
    """compat: one TP=1 engine per worker; direct: one TP engine per node (DP replicas)."""
    if workers % nodes:
        raise ValueError(f"{workers} workers do not split evenly over {nodes} nodes")
    if mode == "compat":
        return [(f"node{w % nodes}", 1) for w in range(workers)]
    return [(f"node{n}", workers // nodes) for n in range(nodes)]


@dataclass(frozen=True)
class Published:
    manifest: WeightManifest
    model_bytes: int
    shapes: tuple[tuple[int, ...], ...]  # in the model's tensor order
    checksums: Mapping[str, ObjectChecksum] | None = None


def publish_synthetic(settings: Settings, name: str, total_bytes: int, tensors: int) -> Published:
    """Publish ``synthetic_model(total_bytes, tensors)`` as bf16 from one process."""
    model = synthetic_model(total_bytes, tensors)
    with StoreClient(settings) as store:
        record = publish_local(store, name, model, dtype="bfloat16")
        registry = GenerationRegistry(store, name)
        manifest = registry.load_manifest(record.generation)
        table = registry.load_checksums(record.generation, record.checksums_digest)
    return Published(
        manifest,
        sum(t.numel() * t.element_size() for _, t in model),
        tuple(tuple(t.shape) for _, t in model),
        table.objects,
    )


def planned(
    manifest: WeightManifest,
    workers: int,
    nodes: int,
    mode: str,
    batch_bytes: int,
    pull: str = "single",
) -> tuple[UpdatePlan, dict[str, str]]:
    """The update plan for simulated engines, and each worker's node label."""
    engines = simulated_engines(specs_of(manifest), cluster_shape(workers, nodes, mode), mode)
    plan = plan_update(manifest, engines, mode, batch_bytes, RoutingCache(), pull=pull)
    return plan, {w["worker_id"]: w["node"] for ws in engines.values() for w in ws}


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
    args = parser.parse_args()
    batch_bytes = parse_size(args.batch)
    size = parse_size(args.size)
    with store_services(int(size * 1.2) + (64 << 20)) as (_, _, settings):
        published = publish_synthetic(settings, "bench-apply", size, args.tensors)
        total = published.model_bytes
        plan, nodes = planned(published.manifest, args.workers, args.nodes, args.mode, batch_bytes)
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
