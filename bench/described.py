"""Planning from engine descriptions, as the coordinator does; ONE JSON object.

    python -m bench.described --model kimi-k2 --engines 4 [--tp 8 --dtype fp8 --experts owned]
    python -m bench.described --model kimi-k2 --dtype fp8 --engines 4 --tp 32 --experts ep \
        --nodes-per-engine 4

``bench.plan`` times the planner core on placement parts built once and shared. A
coordinator starts one step earlier: every engine worker's ``GET /mooncake/placement``
reply (``mooncake_rl.plan.synthetic``: each tensor split along its first dimension the TP
size divides, or with ``--experts owned`` the placement ``bench.plan`` plans, or with
``--experts ep --tp 32 --nodes-per-engine 4`` the matched placement of ``bench.plan
--target 4xEP32``; one region per tensor, every worker reporting its ``placement_digest``).
The plan gets the replies as a coordinator holds them: each engine's without boxes, and
the first engine's (one per distinct placement) with them.
``plan_seconds_cold`` is ``plan.update.plan_routing`` on an empty cache: reading the
descriptions, checking the reports, building the planner's placement parts (one descriptor
per tensor and a box per fragment, checked by mooncake.reshard's rules), planning and
validating.
``plan_seconds_cached`` is the next generation's call (a hit), and
``plan_seconds_cached_without_boxes`` the same hit from replies without boxes
(``GET /mooncake/placement?boxes=false``, what a coordinator reads first); the
``engine_reply_bytes`` of one engine's reply with and without boxes, and the seconds to
parse the former (with the collector paused, as the coordinator reads boxes), are what each
engine's full reply costs a coordinator.
``plan_seconds_fleet_change`` plans once more with one engine added: a miss (the topology
changed) that reuses the distinct placement's parts (``plan.update.PartsCache``).
``prepare_bodies_seconds`` builds every engine's prepare-body slices for that hit
(``UpdatePlan.engine_workers``, what every update costs the coordinator before the drain),
with the checksum rows of the objects each worker reads (synthetic hashes of the real
sizes, one per 4 MiB block as published); ``prepare_body_bytes`` is one engine's as JSON
and ``prepare_body_encode_seconds`` the encoding of them all (``plan.update.encode_workers``,
as the coordinator sends them).
``describe_seconds`` (not part of any) builds the replies and their reports, the engines'
side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections.abc import Sequence
from typing import Any

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import TensorSpec, build_manifest
from mooncake_rl.generations.checksums import BLOCK_BYTES, ObjectChecksum, block_spans
from mooncake_rl.generations.layout import layout_digest
from mooncake_rl.plan.cpu import host_cpu
from mooncake_rl.plan.planner import planning_mode
from mooncake_rl.plan.shapes import DTYPES, MODELS, instance_parts, model_shape
from mooncake_rl.plan.synthetic import described_engines, simulated_engines
from mooncake_rl.plan.update import RoutingCache, encode_workers, plan_routing, plan_update
from mooncake_rl.protocol import reported_placement, without_boxes

BATCH_BYTES = 256 << 20


def synthetic_checksums(manifest: WeightManifest) -> dict[str, ObjectChecksum]:
    """A checksum row per object of ``manifest``, of its size and shape on the wire (block
    hashes per ``BLOCK_BYTES``), with made-up hashes: prepare bodies carry them."""
    rows = {}
    for i, fragment in enumerate(manifest.fragments):
        blocks = len(list(block_spans(fragment.nbytes))) if fragment.nbytes > BLOCK_BYTES else 0
        rows[fragment.object_key] = ObjectChecksum(
            fragment.nbytes, f"{i:032x}", tuple(f"{i + k:016x}" for k in range(blocks))
        )
    return rows


def reset_peak_rss() -> int:
    """The resident set now, made the peak: building every engine's reply peaks higher than
    the plan does. Linux resets the peak on a write of 5 to ``clear_refs``; elsewhere the
    earlier peak stays, and the plan's growth reads as what it added above it."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def bare_replies(workers: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """An engine's ``GET /mooncake/placement?boxes=false`` reply: digests, no boxes."""
    return [without_boxes(reported_placement(w)) for w in workers]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="kimi-k2")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--engines", type=int, default=4, help="identical engines, one per node")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument(
        "--experts",
        choices=("split", "owned", "ep"),
        default="split",
        help="split: every tensor, experts too, split along the first dim the TP size "
        "divides (TP without expert parallelism); owned: each expert whole on one rank, "
        "the rest as plan.shapes places it (expert parallelism over the TP ranks, the "
        "placement bench.plan plans); ep: each expert whole on one rank, every other "
        "tensor whole on each (bench.plan's --layout ep, the matched placement)",
    )
    parser.add_argument(
        "--nodes-per-engine",
        type=int,
        default=1,
        help="nodes each engine spans, its ranks filling them in order (--tp 32 "
        "--nodes-per-engine 4: an instance of 32 GPUs on four 8-GPU nodes)",
    )
    args = parser.parse_args(argv)
    if args.engines < 1 or args.tp < 1:
        parser.error(f"--engines and --tp must be at least 1, got {args.engines} and {args.tp}")
    if args.nodes_per_engine < 1 or args.tp % args.nodes_per_engine:
        parser.error(f"--nodes-per-engine must divide --tp {args.tp}, got {args.nodes_per_engine}")
    if args.nodes_per_engine > 1 and args.experts == "split":
        parser.error("--nodes-per-engine needs --experts owned or ep")

    model = model_shape(args.model, args.dtype)
    specs = [TensorSpec(t.name, t.shape, t.dtype) for t in model.tensors]
    manifests = [build_manifest(model.name, g, specs, "1970-01-01T00:00:00Z") for g in (1, 2)]
    digests = [layout_digest(m) for m in manifests]
    t0 = time.perf_counter()
    nodes = [f"node{i}" for i in range((args.engines + 1) * args.nodes_per_engine)]
    if args.experts != "split":
        try:
            parts = instance_parts(model, args.tp, "ep" if args.experts == "ep" else "tp")
        except InvariantViolation as error:  # e.g. experts that do not split over --tp
            parser.error(f"--experts {args.experts}: {error}")
        described = described_engines(specs, parts, nodes, args.nodes_per_engine)
    else:
        described = simulated_engines(specs, [(node, args.tp) for node in nodes], "direct")
    # As a coordinator holds them (``coordinator.survey``): every engine's reply without
    # boxes, and the boxes of one engine per distinct placement, here the first (the others
    # report its digests). Every engine with its boxes would leave the plan a heap 16x the
    # size to pass the collector over when its hold ends.
    grown = {
        url: [reported_placement(w) for w in ws] if i == 0 else bare_replies(ws)
        for i, (url, ws) in enumerate(described.items())
    }
    del described
    engines = dict(list(grown.items())[: args.engines])
    describe = time.perf_counter() - t0
    before = reset_peak_rss()
    cache = RoutingCache()
    t0, c0 = time.perf_counter(), time.process_time()
    cold = plan_routing(manifests[0], engines, "direct", BATCH_BYTES, cache, digests[0])
    cold_s, cold_cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    hit = plan_routing(manifests[1], engines, "direct", BATCH_BYTES, cache, digests[1])
    cached_s = time.perf_counter() - t0
    bare = {url: [without_boxes(w) for w in ws] for url, ws in engines.items()}
    t0 = time.perf_counter()
    bare_hit = plan_routing(manifests[1], bare, "direct", BATCH_BYTES, cache, digests[1])
    cached_bare_s = time.perf_counter() - t0  # no describe: a hit that read a box would fail
    assert hit.table is bare_hit.table is cold.table and (cache.hits, cache.misses) == (2, 1)
    assert bare_hit.regions == hit.regions and bare_hit.region_dtypes == hit.region_dtypes
    update = plan_update(manifests[1], engines, "direct", BATCH_BYTES, cache, digests[1])
    checksums = synthetic_checksums(manifests[1])
    t0 = time.perf_counter()
    bodies = [update.engine_workers(url, checksums) for url in engines]
    bodies_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    encoded = list(map(encode_workers, bodies))  # as the coordinator encodes them
    encode_s = time.perf_counter() - t0
    del bodies
    t0 = time.perf_counter()
    plan_routing(manifests[1], grown, "direct", BATCH_BYTES, cache, digests[1])
    fleet_change_s = time.perf_counter() - t0
    assert (cache.misses, cache.parts.built) == (2, 1)
    one_engine = next(iter(engines.values()))
    replies = [json.dumps({"workers": ws}).encode() for ws in (one_engine, bare[next(iter(bare))])]
    with planning_mode():  # as the coordinator reads boxes
        t0 = time.perf_counter()
        json.loads(replies[0])
        parse_s = time.perf_counter() - t0
    table = cold.table
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "engines": args.engines,
        "tp": args.tp,
        "experts": args.experts,
        "nodes_per_engine": args.nodes_per_engine,
        "tensors": len(specs),
        "boxes_per_engine": sum(len(w["shards"]) for w in one_engine),
        "describe_seconds": round(describe, 2),
        "plan_seconds_cold": round(cold_s, 3),
        "plan_cpu_seconds_cold": round(cold_cpu, 3),
        "plan_seconds_cached": round(cached_s, 3),
        "plan_seconds_cached_without_boxes": round(cached_bare_s, 4),
        "engine_reply_bytes": len(replies[0]),
        "engine_reply_bytes_without_boxes": len(replies[1]),
        "engine_reply_parse_seconds": round(parse_s, 3),
        "plan_seconds_fleet_change": round(fleet_change_s, 3),
        "prepare_bodies_seconds": round(bodies_s, 3),
        "prepare_body_bytes": len(encoded[0]),
        "prepare_body_encode_seconds": round(encode_s, 3),
        "peak_rss_growth_bytes": (peak - before) * 1024,
        "reads": len(table.reads),
        "pushes": len(table.pushes),
        "demands": len(table.demands),
        "region_names": len(table.regions),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "host": host_cpu().as_json(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
