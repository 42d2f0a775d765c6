"""etcd growth of the durable Store: ``python -m bench.etcd_growth [--repeats 60]``.

Starts etcd and one HA master with the operation log plus a segment holder
(``DurableStore``), runs each kind of Store write ``--repeats`` times from one client and
reads etcd's database size and key count before and after (:func:`mooncake_rl.etcd.usage`):
etcd bytes and keys per operation. Then the same for whole tiny generations (publish,
announce, retention) and for the records an update and a serving engine rewrite. The
operation log is never pruned, so these add up for the life of the Store's cluster id: the
per-generation figures are extrapolated to Kimi-K2 fp8 from the objects its publishers store
(``bench.simulate.publish_layout``, 128 MiB packs) and to the generations that fit etcd's
default quota. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mooncake_rl import etcd
from mooncake_rl.generations.gc import collect_garbage
from mooncake_rl.generations.leases import lease_book
from mooncake_rl.generations.packing import DEFAULT_PACK_BYTES
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.services import DurableConfig, DurableStore, SegmentHolder
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient, exit_process

MODEL = "bench-etcd"


@dataclass(frozen=True)
class Growth:
    """etcd's database bytes and keys added by ``count`` repeats of one operation."""

    operation: str
    count: int
    db_bytes: int
    keys: int
    log_bytes: int

    def __post_init__(self) -> None:
        if self.count <= 0:
            raise ValueError(f"growth of {self.operation} needs a positive count")

    @property
    def bytes_per_op(self) -> float:
        """Of the database: etcd grows it by pages, so only many repeats make this steady."""
        return self.db_bytes / self.count

    @property
    def log_bytes_per_op(self) -> float:
        """Of the operation log's keys and values: what no compaction frees."""
        return self.log_bytes / self.count

    @property
    def keys_per_op(self) -> float:
        return self.keys / self.count

    def row(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "db_bytes_per_op": round(self.bytes_per_op),
            "log_bytes_per_op": round(self.log_bytes_per_op),
            "keys_per_op": round(self.keys_per_op, 2),
        }


def measured(
    store: StoreClient, operation: str, count: int, step: Callable[[int], object]
) -> Growth:
    """``step(i)`` for ``i < count``; what etcd and the operation log grew by meanwhile."""
    endpoints, cluster = (
        store.settings.master.removeprefix(etcd.ETCD_SCHEME),
        store.settings.cluster_id,
    )
    before, (_, log_before) = etcd.usage(endpoints), etcd.log_size(endpoints, cluster)
    for index in range(count):
        step(index)
    after, (_, log_after) = etcd.usage(endpoints), etcd.log_size(endpoints, cluster)
    return Growth(
        operation,
        count,
        after.db_bytes - before.db_bytes,
        after.keys - before.keys,
        log_after - log_before,
    )


def tiny(scale: float) -> list[tuple[str, torch.Tensor]]:
    """A generation of two small tensors (one object each): its records dominate its log."""
    return [("embed", torch.arange(4096, dtype=torch.float32) * scale), ("norm", torch.ones(64))]


TINY_OBJECTS = 2
TINY_RANKS = 1


def store_operations(store: StoreClient, repeats: int) -> list[Growth]:
    """The Store calls everything of ours is made of, each on small records."""
    fresh = [f"bench-etcd/put/{i}" for i in range(repeats)]
    return [
        measured(store, "put", repeats, lambda i: store.put_bytes(fresh[i], b"x" * 64)),
        measured(store, "remove", repeats, lambda i: store.remove([fresh[i]], force=True)),
        measured(store, "remove_absent", repeats, lambda i: store.remove([fresh[i]])),
        measured(
            store,
            "upsert_same_key",
            repeats,
            lambda i: store.upsert_bytes("bench-etcd/upsert", str(i).encode()),
        ),
        measured(
            store,
            "create_exclusive",
            repeats,
            lambda i: store.create_exclusive(f"bench-etcd/fence/{i}", b"f"),
        ),
    ]


def model_churn(store: StoreClient, repeats: int) -> list[Growth]:
    """Whole generations, and the records a serving engine and the collector rewrite."""
    book = lease_book(store, MODEL)
    return [
        measured(
            store,
            "generation",
            repeats,
            lambda i: publish_local(store, MODEL, tiny(float(i + 1)), dtype="float32", keep=2),
        ),
        measured(store, "lease_renewal", repeats, lambda i: book.renew("engine-0", 1, 60.0)),
        measured(
            store,
            "lease_moved_to_a_new_generation",
            repeats,
            lambda i: book.renew("engine-1", i + 2, 60.0),
        ),
        measured(
            store, "gc_nothing_to_collect", repeats, lambda i: collect_garbage(store, MODEL, 2)
        ),
    ]


def kimi_objects() -> tuple[int, int]:
    """Objects per Kimi-K2 fp8 generation and its publisher ranks (the simulator's layout)."""
    from bench.simulate import Cluster, publish_layout
    from mooncake_rl.plan.shapes import model_shape

    cluster = Cluster()
    published = publish_layout(model_shape("kimi-k2", "fp8"), cluster, DEFAULT_PACK_BYTES)
    return published.objects, cluster.trainer_gpus


def extrapolated(by_op: dict[str, Growth], objects: int, ranks: int) -> dict[str, Any]:
    """A generation of ``objects`` objects from ``ranks`` publishers, kept and later collected:
    the tiny generation's log plus one put and one remove per further object and per
    further rank's report. The database grows by pages, so its bytes are the log's scaled
    by the tiny generations' measured database-to-log ratio; the quota figure is etcd's
    default quota over those."""
    put, remove, generation = by_op["put"], by_op["remove"], by_op["generation"]
    extra = (objects - TINY_OBJECTS) + (ranks - TINY_RANKS)
    per_entry = put.log_bytes_per_op + remove.log_bytes_per_op
    log_bytes = generation.log_bytes_per_op + extra * per_entry
    db_bytes = log_bytes * generation.bytes_per_op / generation.log_bytes_per_op
    return {
        "objects": objects,
        "publisher_ranks": ranks,
        "log_bytes_per_generation": round(log_bytes),
        "db_bytes_per_generation": round(db_bytes),
        "keys_per_generation": round(
            generation.keys_per_op + extra * (put.keys_per_op + remove.keys_per_op)
        ),
        "generations_to_default_quota": int(etcd.ETCD_DEFAULT_QUOTA // db_bytes),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-etcd-growth-"))
    started = time.monotonic()
    with DurableStore(DurableConfig(masters=1, log_dir=log_dir)) as durable:
        holder = SegmentHolder(
            durable.master_address,
            durable.metadata_url,
            256 << 20,
            log_dir=log_dir,
            cluster_id=durable.cluster_id,
        )
        with holder.start():
            settings = Settings(
                master=durable.master_address,
                cluster_id=durable.cluster_id,
                metadata=durable.metadata_url,
                segment_bytes=0,
                local_segment=holder.segment,
                buffer_bytes=16 << 20,
            )
            store = StoreClient(settings)
            try:
                growths = [
                    *store_operations(store, args.repeats),
                    *model_churn(store, args.repeats),
                ]
                usage = etcd.usage(durable.endpoints)
            finally:
                store.close()  # parked: a client that lends nothing ends with the process
    by_op = {growth.operation: growth for growth in growths}
    objects, ranks = kimi_objects()
    tiny_generation = extrapolated(by_op, TINY_OBJECTS, TINY_RANKS)
    return {
        "repeats": args.repeats,
        "per_operation": {growth.operation: growth.row() for growth in growths},
        "tiny_generation": tiny_generation,
        "kimi_k2_fp8_generation": extrapolated(by_op, objects, ranks),
        "default_quota_bytes": etcd.ETCD_DEFAULT_QUOTA,
        "db_bytes_at_end": usage.db_bytes,
        "keys_at_end": usage.keys,
        "seconds": round(time.monotonic() - started, 1),
        "logs": str(log_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench etcd-growth", description=__doc__)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args(argv)
    if args.repeats < 10:
        parser.error("need --repeats >= 10 (etcd's database grows in pages)")
    print(json.dumps(run(args), indent=2), flush=True)
    return exit_process(0)


if __name__ == "__main__":
    raise SystemExit(main())
