"""Publish throughput and locality: ``python -m bench.publish [--size 512MiB --ranks 2 --nodes 2]``.

Starts a master and one segment holder per node label, runs one trainer rank per process,
publishes a synthetic model of mixed-size tensors, and prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

import torch

from mooncake_rl.generations import GenerationPublisher, TrainerTopology, finalize_generation
from mooncake_rl.services import EmbeddedMaster, SegmentHolder
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def synthetic_model(total_bytes: int, tensors: int) -> list[tuple[str, torch.Tensor]]:
    """Mixed sizes: one embedding-like tensor of 1/8 and the rest from a fixed spread."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(tensors, generator=generator) + 0.05
    weights[0] = weights[1:].sum() / 7
    sizes = (weights / weights.sum() * total_bytes / 2).long().clamp(min=1)  # bf16 elements
    return [
        (f"w{i}", torch.randn(int(n), generator=generator).to(torch.bfloat16))
        for i, n in enumerate(sizes)
    ]


def _rank(
    settings: Settings, rank: int, nodes: tuple[str, ...], total: int, count: int, out: Any
) -> None:
    tensors = synthetic_model(total, count)
    with StoreClient(settings) as store:
        publisher = GenerationPublisher(
            store, "bench", 1, rank, TrainerTopology(nodes), "bfloat16", check_locality=True
        )
        started = time.perf_counter()
        report = publisher.publish(tensors)
        if rank == 0:
            finalize_generation(publisher, report, timeout_s=600)
        out.put((rank, time.perf_counter() - started, report.put_bytes, report.nonlocal_put_bytes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=2)
    args = parser.parse_args()
    total = parse_size(args.size)
    nodes = tuple(f"node{r % args.nodes}" for r in range(args.ranks))
    ctx = mp.get_context("spawn")
    with EmbeddedMaster() as master:
        per_node_segment = int(total * 1.5 / args.nodes) + (64 << 20)
        holders = {
            node: SegmentHolder(
                master.master_address, master.metadata_url, per_node_segment
            ).start()
            for node in sorted(set(nodes))
        }
        try:
            out = ctx.Queue()
            procs = []
            for rank, node in enumerate(nodes):
                settings = Settings(
                    master=master.master_address,
                    metadata=master.metadata_url,
                    node=node,
                    segment_bytes=0,
                    local_segment=holders[node].segment,
                    buffer_bytes=16 << 20,
                )
                procs.append(
                    ctx.Process(
                        target=_rank, args=(settings, rank, nodes, total, args.tensors, out)
                    )
                )
            for proc in procs:
                proc.start()
            rows = sorted(out.get(timeout=1200) for _ in procs)
            for proc in procs:
                proc.join()
        finally:
            for holder in holders.values():
                holder.stop()
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
