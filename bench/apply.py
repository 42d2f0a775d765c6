"""Apply throughput: ``python -m bench.apply --size 1GiB --workers 4 --nodes 2 --mode direct``.

Publishes a synthetic model, plans an update for simulated workers (one process each, split
over node labels), runs it with real Store reads and TE pushes, and prints one JSON object:
this project's figures, the raw TE loopback GB/s measured in the same run, the pipeline
efficiency, and the same update done naively (every worker reads all it needs itself).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from bench.common import parse_size, store_services, synthetic_model
from mooncake_rl.apply.executor import Batch, PushOp, ReadOp
from mooncake_rl.apply.process import WorkerCluster, run_planned_update
from mooncake_rl.apply.wire import WorkerSlice
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.plan.table import bind, record_ranges
from mooncake_rl.plan.update import RoutingCache, UpdatePlan, plan_update
from mooncake_rl.store import StoreClient


def cluster_shape(workers: int, nodes: int, mode: str) -> list[tuple[str, int]]:
    """compat: one TP=1 engine per worker; direct: one TP engine per node (DP replicas)."""
    if mode == "compat":
        return [(f"node{w % nodes}", 1) for w in range(workers)]
    return [(f"node{n}", workers // nodes) for n in range(nodes)]


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
    """One read per demanded row of every worker (the table's coverage contract), no pushes."""
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


def measure(
    cluster: WorkerCluster, plan: UpdatePlan | NaivePlan, delivered: int
) -> dict[str, object]:
    run = run_planned_update(cluster, plan)
    return {
        "update_seconds": round(run["seconds"], 4),
        "update_gbps": round(delivered / run["seconds"] / 1e9, 3),
        "delivered_bytes": delivered,
        "store_read_bytes": sum(w["read"] for w in run["workers"].values()),
        "pushed_bytes": sum(w["pushed"] for w in run["workers"].values()),
        "peak_staging_bytes": max(w["peak_staging"] for w in run["workers"].values()),
    }


def raw_te_gbps(cluster: WorkerCluster, region_sizes: dict[str, dict[str, int]]) -> float:
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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--mode", choices=["compat", "direct"], default="direct")
    parser.add_argument("--batch", default="64MiB")
    args = parser.parse_args()
    model = synthetic_model(parse_size(args.size), args.tensors)
    total = sum(t.numel() * t.element_size() for _, t in model)
    with store_services(int(total * 1.2) + (64 << 20)) as (_, _, settings):
        with StoreClient(settings) as store:
            record = publish_local(store, "bench-apply", model, dtype="bfloat16")
            from mooncake_rl.generations.registry import GenerationRegistry

            manifest = GenerationRegistry(store, "bench-apply").load_manifest(record.generation)
        del model
        engines = simulated_engines(
            specs_of_manifest(manifest),
            cluster_shape(args.workers, args.nodes, args.mode),
            args.mode,
        )
        plan = plan_update(
            manifest,
            engines,
            args.mode,
            parse_size(args.batch),
            RoutingCache(),
            record.layout_digest,
        )
        nodes = {w["worker_id"]: w["node"] for ws in engines.values() for w in ws}
        batch_bytes = parse_size(args.batch)
        worker_settings = {
            w: settings.with_overrides(
                node=n, batch_bytes=batch_bytes, staging_watermark_bytes=4 * batch_bytes
            )
            for w, n in nodes.items()
        }
        with WorkerCluster(worker_settings, plan.routing.regions) as cluster:
            raw = raw_te_gbps(cluster, {w: dict(r) for w, r in plan.routing.regions.items()})
            delivered = sum(plan.routing.received_bytes().values())
            ours = measure(cluster, plan, delivered)
            baseline = measure(cluster, naive(plan, batch_bytes), delivered)
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
                "pipeline_efficiency": round(ours["update_gbps"] / raw, 3),
                "naive": baseline,
                "store_read_ratio_naive_over_ours": round(
                    baseline["store_read_bytes"] / ours["store_read_bytes"], 3
                ),
            }
        )
    )


def specs_of_manifest(manifest: object) -> list:
    from mooncake_rl.generations.catalog import specs_of as manifest_specs

    return manifest_specs(manifest)


if __name__ == "__main__":
    main()
