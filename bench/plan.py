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
Building the shapes and manifests is reported separately as ``setup_seconds``;
``table_digest`` is the xxh3 of the cold table's Store encoding (equal digests: equal
tables). The machine is shared, so CPU seconds of this process and the 1-minute load
average are reported next to wall seconds.

With ``--store``, the cold table is also kept in a Store (an embedded ``mooncake_master``
and one segment holder of ``--store-segment`` bytes, ``store_save_seconds``) and in a
node-local plan folder (``MOONCAKE_RL_PLAN_DIR``). Two fresh processes (new interpreters, as
the next ``mooncake-rl update``) build the same shapes and time the next generation's call on
an empty cache: ``fresh_process_store`` reads the Store, ``fresh_process_local_copy`` maps
the node-local copy. In each, ``plan_seconds_store_hit`` is the whole call plus ``bind``,
split into ``store_hit_key_seconds`` (combining the engine workers' placement reports, which
this process computes as each engine would, into the demand digest, plus the topology
digest) and ``store_hit_load_seconds`` (the read, the entry's checks, ``bind``). After it,
the Store entry is read and decoded once more, timed apart (``store_read_seconds``,
``store_decode_seconds``). ``store_hit_equals_cold`` compares the loaded table with the cold
one byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from mooncake.reshard.weight import WeightManifest

from bench.common import parse_size, store_services
from mooncake_rl.generations.layout import layout_digest
from mooncake_rl.plan import (
    CompatDemand,
    DirectDemand,
    PlanCache,
    PlanParams,
    RoutingTable,
    Topology,
    bind,
    plan_key,
    plan_routing,
)
from mooncake_rl.plan.cpu import host_cpu
from mooncake_rl.plan.demand import declared_digest, part_digest
from mooncake_rl.plan.shapes import DTYPES, MODELS, Target, cluster, model_shape, weight_manifest
from mooncake_rl.plan.stored import StoredTables, decode_table, encode_table, entry_key
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient


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


@dataclass(frozen=True)
class Inputs:
    """What the coordinator holds when it plans: two generations of one layout, with the
    layout digests their records carry, and the engines' topology and demand."""

    model: Any
    manifest: WeightManifest
    next_manifest: WeightManifest
    recorded: str
    next_recorded: str
    topology: Topology
    demand: CompatDemand | DirectDemand
    params: PlanParams
    digest_seconds: float
    digest_cpu_seconds: float


def inputs(args: argparse.Namespace) -> Inputs:
    model = model_shape(args.model, args.dtype)
    target = Target.parse(args.target)
    manifest = weight_manifest(model, 42)
    next_manifest = weight_manifest(model, 43)
    topology, direct = cluster(
        model, target.instances, target.size, args.workers_per_node, target.layout
    )
    recorded = layout_digest(manifest)
    t1, c1 = time.perf_counter(), time.process_time()
    next_recorded = layout_digest(next_manifest)  # what announce seals into the record
    return Inputs(
        model,
        manifest,
        next_manifest,
        recorded,
        next_recorded,
        topology,
        direct if args.mode == "direct" else CompatDemand(),
        PlanParams(batch_bytes=args.batch_bytes),
        time.perf_counter() - t1,
        time.process_time() - c1,
    )


def table_digest(table: RoutingTable) -> str:
    """One digest of every field of a table: what its Store entry holds."""
    return xxhash.xxh3_128_hexdigest(encode_table(table))


def worker_reports(demand: CompatDemand | DirectDemand) -> dict[str, str]:
    """What each engine worker reports with its placement: a digest of what it receives
    (engines compute it from their own description, ``placement_digest``; here from the
    part and destinations the synthetic shapes give each worker). Parts shared by several
    workers are hashed once, as equal engines would each hash their own."""
    if isinstance(demand, CompatDemand):
        return {}
    memo: dict[int, str] = {}
    destinations = dict(demand.destinations)
    reports = {}
    for worker, part in demand.parts:
        if id(part) not in memo:
            memo[id(part)] = part_digest(part)
        where = destinations[worker].digest if worker in destinations else "-"
        reports[worker] = hashlib.sha256(f"{memo[id(part)]}/{where}".encode()).hexdigest()
    return reports


def as_reported(
    demand: CompatDemand | DirectDemand, reports: dict[str, str]
) -> CompatDemand | DirectDemand:
    """The demand keyed by the workers' reports, as the coordinator builds it."""
    if isinstance(demand, CompatDemand):
        return demand
    return DirectDemand(demand.parts, demand.destinations, declared_digest(reports.items()))


def fresh_store_hit(args: argparse.Namespace) -> dict[str, Any]:
    """The next generation's call in this fresh process, on an empty cache over the Store
    (and the node-local copy when ``plan_dir`` is given)."""
    given = inputs(args)
    master, metadata, segment, reports_file, plan_dir = args.load_from
    settings = Settings(
        master=master,
        metadata=metadata,
        segment_bytes=0,
        local_segment=segment,
        plan_dir=Path(plan_dir) if plan_dir != "-" else None,
    )
    t0 = time.perf_counter()
    store = StoreClient(settings)
    connect = time.perf_counter() - t0
    with store:
        cache = PlanCache(backing=StoredTables(store))
        t0, c0 = time.perf_counter(), time.process_time()
        demand = as_reported(given.demand, json.loads(Path(reports_file).read_text()))
        key = plan_key(
            given.next_manifest, given.topology, demand.digest, given.params, given.next_recorded
        )
        t1 = time.perf_counter()
        table = plan_routing(
            given.next_manifest,
            given.topology,
            demand,
            params=given.params,
            cache=cache,
            layout_digest=given.next_recorded,
        )
        bind(table, given.next_manifest.group_id)
        t2, c2 = time.perf_counter(), time.process_time()
        assert (cache.loads, cache.misses) == (1, 0), "the fresh process did not load the table"
        entry = store.get_array(entry_key(key))
        t3 = time.perf_counter()
        decode_table(entry, key)
        t4 = time.perf_counter()
    return {
        "plan_seconds_store_hit": round(t2 - t0, 4),
        "plan_cpu_seconds_store_hit": round(c2 - c0, 4),
        "store_hit_key_seconds": round(t1 - t0, 4),
        "store_hit_load_seconds": round(t2 - t1, 4),
        "store_read_seconds": round(t3 - t2, 4),
        "store_decode_seconds": round(t4 - t3, 4),
        "store_connect_seconds": round(connect, 3),
        "store_hit_load_average_1m": round(os.getloadavg()[0], 2),
        "store_hit_table_digest": table_digest(table),
    }


def store_figures(
    args: argparse.Namespace, given: Inputs, reports: dict[str, str], table: RoutingTable
) -> dict[str, Any]:
    """Keep ``table`` in a fresh Store (and a node-local copy), then time its load in two
    fresh processes: one that reads the Store, one that maps the node-local copy."""
    key = plan_key(
        given.manifest, given.topology, given.demand.digest, given.params, given.recorded
    )
    with (
        tempfile.TemporaryDirectory() as scratch,
        store_services(parse_size(args.store_segment)) as (master, holder, settings),
        StoreClient(settings.model_copy(update={"plan_dir": Path(scratch) / "plans"})) as store,
    ):
        t0 = time.perf_counter()
        StoredTables(store).save(key, table)
        saved = time.perf_counter() - t0
        assert store.exists([entry_key(key)]) == [True], "the table was not kept in the Store"
        entry_bytes = store.size(entry_key(key))
        reports_file = Path(scratch) / "reports.json"
        reports_file.write_text(json.dumps(reports))
        figures = {}
        for plan_dir, label in (("-", "store"), (str(Path(scratch) / "plans"), "local")):
            flags = [
                *("--model", args.model, "--target", args.target, "--mode", args.mode),
                *("--dtype", args.dtype),
                *("--workers-per-node", str(args.workers_per_node)),
                *("--batch-bytes", str(args.batch_bytes)),
                "--load-from",
                *(master.master_address, master.metadata_url, holder.segment),
                *(str(reports_file), plan_dir),
            ]
            child = subprocess.run(
                [sys.executable, "-m", "bench.plan", *flags], capture_output=True, text=True
            )
            if child.returncode != 0:
                raise SystemExit(f"the fresh process failed:\n{child.stderr[-3000:]}")
            loaded = json.loads(child.stdout)
            digest = loaded.pop("store_hit_table_digest")
            loaded["store_hit_equals_cold"] = digest == table_digest(table)
            figures[label] = loaded
    return {
        "store_save_seconds": round(saved, 3),
        "store_entry_bytes": entry_bytes,
        "fresh_process_store": figures["store"],
        "fresh_process_local_copy": figures["local"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="kimi-k2")
    parser.add_argument(
        "--target", default="16xTP8", help="INSTANCESxTPn or INSTANCESxEPn, e.g. 16xTP8, 4xEP32"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="rollout weights")
    parser.add_argument("--mode", choices=("direct", "compat"), default="direct")
    parser.add_argument("--workers-per-node", type=int, default=8)
    parser.add_argument("--batch-bytes", type=int, default=PlanParams().batch_bytes)
    parser.add_argument(
        "--store",
        action="store_true",
        help="also keep the table in a Store and time its load in a fresh process",
    )
    parser.add_argument("--store-segment", default="1GiB", help="the Store's segment holder")
    parser.add_argument("--load-from", nargs=5, help=argparse.SUPPRESS)  # the fresh process
    args = parser.parse_args()
    if args.load_from:
        print(json.dumps(fresh_store_hit(args)))
        return

    t0 = time.perf_counter()
    given = inputs(args)
    reports = worker_reports(given.demand)  # the engines' work, once per placement
    given = replace(given, demand=as_reported(given.demand, reports))
    model, manifest, next_manifest = given.model, given.manifest, given.next_manifest
    topology, demand, params = given.topology, given.demand, given.params
    setup = time.perf_counter() - t0

    cache = PlanCache()
    t0, c0 = time.perf_counter(), time.process_time()
    table = plan_routing(
        manifest, topology, demand, params=params, cache=cache, layout_digest=given.recorded
    )
    cold, cold_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    again = plan_routing(
        next_manifest,
        topology,
        demand,
        params=params,
        cache=cache,
        layout_digest=given.next_recorded,
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
    nic_in, nic_out = totals.node_nic_in, totals.node_nic_out
    result = {
        "model": args.model,
        "target": args.target,
        "dtype": args.dtype,
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
        "layout_digest_seconds": round(given.digest_seconds, 4),
        "layout_digest_cpu_seconds": round(given.digest_cpu_seconds, 4),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "host": host_cpu().as_json(),
        "setup_seconds": round(setup, 2),
        "reads": len(table.reads),
        "pushes": len(table.pushes),
        "table_digest": table_digest(table),  # xxh3 of the table's Store encoding
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
        "max_node_nic_in_bytes": int(nic_in.max()),
        "max_node_nic_out_bytes": int(nic_out.max()),
        # A full-duplex NIC's time is max(in, out): the planner's bound is, per node,
        # out <= max(in, mean(out) + max_chunk_cost) (mooncake_rl.plan.assign).
        "duplex_bound_holds": bool(
            (nic_out <= np.maximum(nic_in, nic_out.mean() + table.max_chunk_cost)).all()
        ),
        "max_node_duplex_bytes / max_node_nic_in_bytes": float(
            np.maximum(nic_in, nic_out).max() / nic_in.max()
        ),
        "max_worker_nic_bytes / mean_worker_nic_bytes": float(
            totals.worker_nic_bytes.max() / totals.worker_nic_bytes.mean()
        ),
    }
    if args.mode == "compat":
        result["cross_node_sends_per_tensor"] = cross_node_sends_per_tensor(table)
        result["nodes - 1"] = len(topology.nodes) - 1
    if args.store:
        result.update(store_figures(args, given, reports, table))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
