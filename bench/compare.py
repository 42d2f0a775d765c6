"""Every approach side by side, for one model and topology, on this machine.

``mooncake-rl bench`` (``python -m bench``) publishes one synthetic bf16 model to a real
Store and moves it into simulated rollout workers (one process each, on node labels) with:

- ``compat``: this project, every worker gets every full tensor (one TP=1 engine each);
- ``direct``: this project, one TP engine per node, each worker gets only its shards;
- ``naive_store``: the direct placement, every worker reading its own shards from the Store;
- ``naive_store_full``: every worker reading the whole model from the Store (compat's need);
- ``broadcast``: gloo broadcast of every tensor from rank 0 to all ranks (NCCL's shape).

The machine's ceilings (memcpy, one raw TE stream) are measured in the same run. Progress
goes to stderr, one JSON document to stdout, and a PNG comparing the approaches to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.apply import (
    measure,
    naive,
    planned,
    publish_synthetic,
    raw_te_gbps,
    worker_settings,
)
from bench.broadcast import broadcast_accounting, run_broadcast
from bench.common import cpu_model, parse_size, store_services
from mooncake_rl.apply.process import WorkerCluster
from mooncake_rl.progress import progress

APPROACHES = ("compat", "direct", "naive_store", "naive_store_full", "broadcast")
OURS = ("direct", "compat")
STEPS = 10  # the step(...) calls in run() and main()

ACCOUNTING = {
    "seconds": "wall time of the data movement only (workers started, plan made, buffers "
    "registered before the clock starts; the same for every approach)",
    "gbps": "model_bytes / seconds / 1e9: how fast one whole policy reaches every worker",
    "delivered_gbps": "bytes landed in workers' buffers / seconds / 1e9",
    "store_read_bytes": "bytes read from the Store (workers' own counters)",
    "pushed_bytes": "bytes sent worker to worker: TE one-sided writes, or gloo sends",
    "max_node_nic_bytes": "max over node labels of (Store bytes read by the node's workers + "
    "bytes its workers sent to workers on other nodes); intra-node sends cost 0",
    "broadcast_nic": "gloo::broadcast is a binomial tree (gloo/broadcast.cc), reproduced "
    "exactly: a send to a rank on another node costs the sender's node the full tensor; "
    "ranks are placed on nodes in blocks (torchrun order). ring_max_node_nic_bytes is the "
    "ring (NCCL) figure: each node forwards one model to the next",
    "naive_store": "no pushes: every worker reads each byte it needs from the Store itself",
    "transport": "one host: Store reads, TE writes and gloo all run over TCP loopback, so "
    "approaches contend for the same cores; node labels only decide NIC accounting",
}


@dataclass(frozen=True)
class CompareConfig:
    """One side-by-side run: the model, the simulated rollout cluster, the plot path."""

    size_bytes: int = 256 << 20
    tensors: int = 32
    workers: int = 4
    nodes: int = 2
    batch_bytes: int = 64 << 20
    out: Path = Path("out/bench-compare.png")

    def __post_init__(self) -> None:
        for name in ("size_bytes", "tensors", "workers", "nodes", "batch_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.workers < 2 or self.workers % self.nodes:
            raise ValueError("need at least 2 workers, split evenly over the nodes")
        if self.size_bytes < self.tensors * 8192:
            raise ValueError("model too small for that many tensors (8 KiB each at least)")

    @property
    def rank_nodes(self) -> tuple[str, ...]:
        """Broadcast ranks on node labels in blocks, as a launcher places them."""
        per_node = self.workers // self.nodes
        return tuple(f"node{rank // per_node}" for rank in range(self.workers))


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """Best of ``repeats`` host memory copies of ``nbytes`` (torch, default threads)."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def ratios(approaches: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each approach's seconds, Store reads and hottest node NIC over this project's."""
    keys = ("seconds", "store_read_bytes", "max_node_nic_bytes")
    return {
        name: {
            f"vs_{ours}": {
                key: round(figures[key] / approaches[ours][key], 3)
                if approaches[ours][key]
                else None
                for key in keys
            }
            for ours in OURS
        }
        for name, figures in approaches.items()
    }


Step = Callable[[str], Any]


def run(config: CompareConfig, step: Step) -> dict[str, Any]:
    """Run every approach and return the JSON document (the plot is written by ``main``)."""
    step("memcpy ceiling")
    memcpy = memcpy_gbps(min(config.size_bytes, 256 << 20))
    segment = int(config.size_bytes * 1.2) + (64 << 20)
    approaches: dict[str, dict[str, Any]] = {}
    with store_services(segment) as (_, _, settings):
        step("publish to the Store")
        published = publish_synthetic(settings, "bench-compare", config.size_bytes, config.tensors)
        model_bytes = published.model_bytes
        raw = float("nan")
        for mode, baseline in (("compat", "naive_store_full"), ("direct", "naive_store")):
            step(f"{mode}: plan, start {config.workers} workers")
            plan, nodes = planned(
                published.manifest, config.workers, config.nodes, mode, config.batch_bytes
            )
            delivered = sum(plan.routing.received_bytes().values())
            with WorkerCluster(
                worker_settings(settings, nodes, config.batch_bytes), plan.routing.regions
            ) as cluster:
                if mode == "compat":  # every worker holds a model-sized region: a long stream
                    raw = raw_te_gbps(cluster, plan.routing.regions)
                step(f"{mode}: update")
                approaches[mode] = {
                    **measure(cluster, plan, nodes, model_bytes, delivered, published.checksums),
                    "engines": _engines(plan.engines),
                    "unique_demand_bytes": plan.unique_demand_bytes,
                }
                step(f"{baseline}: update")
                approaches[baseline] = {
                    **measure(
                        cluster, naive(plan, config.batch_bytes), nodes, model_bytes, delivered
                    ),
                    "engines": _engines(plan.engines),
                }
    step(f"broadcast: gloo, {config.workers} ranks")
    approaches["broadcast"] = broadcast_figures(config, published.shapes, model_bytes)
    return {
        "bench": "compare",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": {**asdict(config), "out": str(config.out)},
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "transport": "tcp loopback",
        },
        "model_bytes": model_bytes,
        "ceilings": {"memcpy_gbps": round(memcpy, 3), "raw_te_gbps": round(raw, 3)},
        "approaches": {name: approaches[name] for name in APPROACHES},
        "ratios": ratios({name: approaches[name] for name in APPROACHES}),
        "accounting": ACCOUNTING,
    }


def broadcast_figures(
    config: CompareConfig, shapes: Sequence[tuple[int, ...]], model_bytes: int
) -> dict[str, Any]:
    run_ = run_broadcast(config.rank_nodes, config.size_bytes, config.tensors, shapes)
    accounting = broadcast_accounting(config.rank_nodes, model_bytes)
    seconds = run_["seconds"]
    return {
        "seconds": round(seconds, 4),
        "gbps": round(model_bytes / seconds / 1e9, 3),
        "delivered_bytes": run_["received_bytes"],
        "delivered_gbps": round(run_["received_bytes"] / seconds / 1e9, 3),
        "store_read_bytes": 0,
        "received_bytes": run_["received_bytes"],
        **accounting,
        "rank_nodes": list(config.rank_nodes),
    }


def _engines(engines: Mapping[str, Sequence[str]]) -> str:
    sizes = sorted({len(workers) for workers in engines.values()})
    return f"{len(engines)} x TP{'/'.join(map(str, sizes))}"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-rl bench",
        description=__doc__.split("\n\n")[0],
        epilog="`mooncake-rl bench simulate --help`: the cluster simulator (1T-scale estimates)",
    )
    parser.add_argument("--size", default="256MiB", help="model bytes (e.g. 8MiB, 1GiB)")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4, help="rollout worker processes")
    parser.add_argument("--nodes", type=int, default=2, help="node labels for NIC accounting")
    parser.add_argument("--batch", default="64MiB", help="pipeline batch bytes")
    parser.add_argument("--out", default="out/bench-compare.png", help="PNG plot path")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config = CompareConfig(
        parse_size(args.size),
        args.tensors,
        args.workers,
        args.nodes,
        parse_size(args.batch),
        Path(args.out),
    )
    from bench.plot import plot_compare

    with progress("bench", STEPS) as steps:
        result = run(config, steps.step)
        steps.step("plot")
        plot_compare(result, config.out)
    print(json.dumps(result, indent=2))
    return 0
