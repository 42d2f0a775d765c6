"""Publish throughput and locality: ``python -m bench.publish [--size 512MiB --ranks 2 --nodes 2]``.

Starts a master and one segment holder per node label, runs one trainer rank per process,
publishes a synthetic model of mixed-size tensors, and prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import time
from typing import Any

from bench.common import node_services, parse_size, synthetic_model
from mooncake_rl.generations import GenerationPublisher, TrainerTopology, finalize_generation
from mooncake_rl.generations.publisher import start_attempt
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient


def _rank(
    settings: Settings,
    rank: int,
    nodes: tuple[str, ...],
    claimed: tuple[int, str],
    total: int,
    count: int,
    out: Any,
) -> None:
    tensors = synthetic_model(total, count)
    generation, attempt = claimed
    with StoreClient(settings) as store:
        publisher = GenerationPublisher(
            store,
            "bench",
            generation,
            rank,
            TrainerTopology(nodes),
            "bfloat16",
            check_locality=True,
            attempt=attempt if rank == 0 else None,
        )
        started = time.perf_counter()
        report = publisher.publish(tensors)
        if rank == 0:
            finalize_generation(publisher, report, timeout_s=600)
        out.put((rank, time.perf_counter() - started, report.put_bytes, report.nonlocal_put_bytes))


def _results(procs: list[Any], out: Any, timeout_s: float = 1200) -> list[tuple]:
    """Every rank's row; a rank that exits without one fails the run instead of hanging it."""
    rows: list[tuple] = []
    deadline = time.monotonic() + timeout_s
    while len(rows) < len(procs):
        try:
            rows.append(out.get(timeout=1))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for proc in procs:
                    proc.kill()
                raise SystemExit(
                    f"bench.publish: rank(s) {dead or 'all'} ended without a result"
                ) from None
    for proc in procs:
        proc.join()
    return sorted(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=2)
    args = parser.parse_args(argv)
    total = parse_size(args.size)
    nodes = tuple(f"node{r % args.nodes}" for r in range(args.ranks))
    ctx = mp.get_context("spawn")
    per_node_segment = int(total * 1.5 / args.nodes) + (64 << 20)
    with node_services(per_node_segment, nodes) as (_, settings):
        with StoreClient(settings[nodes[0]]) as store:
            claimed = start_attempt(store, "bench")  # rank 0's claim, as a trainer makes it
        out = ctx.Queue()
        procs = [
            ctx.Process(
                target=_rank,
                args=(settings[node], rank, nodes, claimed, total, args.tensors, out),
            )
            for rank, node in enumerate(nodes)
        ]
        for proc in procs:
            proc.start()
        rows = _results(procs, out)
    seconds = max(row[1] for row in rows)
    put_bytes = sum(row[2] for row in rows)
    bytes_per_node: dict[str, int] = {}
    for rank, _, nbytes, _ in rows:
        bytes_per_node[nodes[rank]] = bytes_per_node.get(nodes[rank], 0) + nbytes
    print(
        json.dumps(
            {
                "bench": "publish",
                "ranks": args.ranks,
                "nodes": args.nodes,
                "tensors": args.tensors,
                "published_bytes": put_bytes,
                "publish_seconds": round(seconds, 3),
                "publish_gbps": round(put_bytes / seconds / 1e9, 3),
                "bytes_per_node": bytes_per_node,
                "node_imbalance": round(
                    max(bytes_per_node.values()) / min(bytes_per_node.values()), 4
                ),
                "nonlocal_put_bytes": sum(row[3] for row in rows),
            }
        )
    )


if __name__ == "__main__":
    main()
