"""Planning benchmark: plan a model shape onto a cluster shape and print ONE JSON object.

    python -m bench.plan --model kimi-k2 --target 16xTP8 [--mode direct|compat]

Both calls are made the way the coordinator makes them, with the layout digest that
``GenerationRegistry.announce`` sealed into each generation's active record (computed here
during setup, its cost reported as ``layout_digest_seconds``: publish side, once per
generation). ``plan_seconds_cold`` is one ``plan_routing`` call on an empty cache (planning,
re-checking the recorded digest, validation); ``plan_seconds_cached`` is the next
generation's call (new manifest, same layout: a cache hit) plus binding its keys.
``plan_seconds_cached_unrecorded`` is the same hit when the record carries no layout digest
(records written before it was recorded): the planner then hashes the manifest itself.
Building the shapes and manifests is reported separately as ``setup_seconds``. The machine
is shared, so CPU seconds of this process and the 1-minute load average are reported next
to wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from mooncake_rl.generations.layout import layout_digest
from mooncake_rl.plan import CompatDemand, PlanCache, PlanParams, bind, plan_routing
from mooncake_rl.plan.shapes import MODELS, cluster, parse_target, weight_manifest


def cross_node_sends_per_tensor(table) -> float:
    """Mean over tensors of how many times each of its bytes crossed a NIC in a push."""
    reads, pushes = table.reads, table.pushes
    node = table.worker_node
    landing = {
        (int(r["worker"]), int(r["dst_region"]), int(r["dst_offset"])): int(r["object"])
        for r in reads
    }
    cross = pushes[node[pushes["worker"]] != node[pushes["peer"]]]
    per_object = np.zeros(len(table.objects))
    for p in cross:
        key = (int(p["worker"]), int(p["src_region"]), int(p["src_offset"]))
        per_object[landing[key]] += int(p["length"]) * int(p["count"])
    return float((per_object / table.object_sizes).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="kimi-k2")
    parser.add_argument("--target", default="16xTP8", help="INSTANCESxTPn, e.g. 16xTP8")
    parser.add_argument("--mode", choices=("direct", "compat"), default="direct")
    parser.add_argument("--workers-per-node", type=int, default=8)
    parser.add_argument("--batch-bytes", type=int, default=PlanParams().batch_bytes)
    args = parser.parse_args()

    t0 = time.perf_counter()
    model = MODELS[args.model]()
    instances, tp = parse_target(args.target)
    manifest = weight_manifest(model, 42)
    next_manifest = weight_manifest(model, 43)
    topology, direct = cluster(model, instances, tp, args.workers_per_node)
    demand = direct if args.mode == "direct" else CompatDemand()
    params = PlanParams(batch_bytes=args.batch_bytes)
    recorded = layout_digest(manifest)
    t1, c1 = time.perf_counter(), time.process_time()
    next_recorded = layout_digest(next_manifest)  # what announce seals into the record
    digest_seconds, digest_cpu = time.perf_counter() - t1, time.process_time() - c1
    setup = time.perf_counter() - t0

    cache = PlanCache()
    t0, c0 = time.perf_counter(), time.process_time()
    table = plan_routing(
        manifest, topology, demand, params=params, cache=cache, layout_digest=recorded
    )
    cold, cold_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    again = plan_routing(
        next_manifest, topology, demand, params=params, cache=cache, layout_digest=next_recorded
    )
    bound = bind(again, next_manifest.group_id)
    cached, cached_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert again is table and cache.hits == 1 and cache.misses == 1
    assert bound.keys[0].startswith(next_manifest.group_id)
    t0, c0 = time.perf_counter(), time.process_time()
    unrecorded = plan_routing(next_manifest, topology, demand, params=params, cache=cache)
    bind(unrecorded, next_manifest.group_id)
    fallback, fallback_cpu = time.perf_counter() - t0, time.process_time() - c0
    assert unrecorded is table and cache.hits == 2 and cache.misses == 1

    totals = table.totals
    nic = totals.node_nic_bytes
    result = {
        "model": args.model,
        "target": args.target,
        "mode": args.mode,
        "tensors": len(model.tensors),
        "model_bytes": model.nbytes,
        "workers": len(topology.workers),
        "nodes": len(topology.nodes),
        "plan_seconds_cold": round(cold, 3),
        "plan_seconds_cached": round(cached, 4),
        "plan_cpu_seconds_cold": round(cold_cpu, 3),
        "plan_cpu_seconds_cached": round(cached_cpu, 4),
        "plan_seconds_cached_unrecorded": round(fallback, 4),
        "plan_cpu_seconds_cached_unrecorded": round(fallback_cpu, 4),
        "layout_digest_seconds": round(digest_seconds, 4),
        "layout_digest_cpu_seconds": round(digest_cpu, 4),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "setup_seconds": round(setup, 2),
        "reads": len(table.reads),
        "pushes": len(table.pushes),
        "store_read_bytes": totals.store_read_bytes,
        "unique_demand_bytes": totals.unique_demand_bytes,
        "store_read_bytes / unique_demand_bytes": totals.store_read_bytes
        / totals.unique_demand_bytes,
        "delivered_bytes": int(totals.delivered_bytes.sum()),
        "lower_bound_bytes": table.lower_bound_bytes,
        "delivered_bytes / lower_bound_bytes": int(totals.delivered_bytes.sum())
        / table.lower_bound_bytes,
        "cross_node_push_bytes": totals.cross_node_push_bytes,
        "intra_node_push_bytes": totals.intra_node_push_bytes,
        "max_node_nic_bytes": int(nic.max()),
        "mean_node_nic_bytes": float(nic.mean()),
        "max_node_nic_bytes / mean_node_nic_bytes": float(nic.max() / nic.mean()),
        "balance_bound (mean + max_chunk_cost) / mean": float(
            (nic.mean() + table.max_chunk_cost) / nic.mean()
        ),
        "max_worker_nic_bytes / mean_worker_nic_bytes": float(
            totals.worker_nic_bytes.max() / totals.worker_nic_bytes.mean()
        ),
    }
    if args.mode == "compat":
        result["cross_node_sends_per_tensor"] = cross_node_sends_per_tensor(table)
        result["nodes - 1"] = len(topology.nodes) - 1
    print(json.dumps(result))


if __name__ == "__main__":
    main()
