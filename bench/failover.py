"""Failover of the durable Store: ``python -m bench failover [--kills 3 --generations 20]``.

Starts etcd and ``--masters`` HA masters with a segment holder (``DurableStore``, as
``mooncake-rl master`` does), publishes tiny generations while measuring etcd's growth per
generation (the operation log is never pruned), then SIGKILLs the leader ``--kills`` times.
After each kill one Store call (the active record) is made at once; it rides the failover,
and the seconds from the kill to its success are the figure (goal: at most 15 s with the
defaults). A fresh standby replaces each killed master, so every kill finds one. Prints one
JSON object; ``close_s`` is the client's native close, which waits out the lost leader.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mooncake_rl import etcd
from mooncake_rl.generations.commands import verify_generation
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry, Incarnation
from mooncake_rl.services import DurableConfig, DurableStore, SegmentHolder
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

MODEL = "bench-failover"
GOAL_S = 15.0


def tiny(scale: float) -> list[tuple[str, torch.Tensor]]:
    """A generation of two small tensors: its records are what the log grows by."""
    return [("embed", torch.arange(4096, dtype=torch.float32) * scale), ("norm", torch.ones(64))]


def etcd_growth(store: StoreClient, endpoints: str, generations: int) -> dict[str, Any]:
    """etcd's database bytes and keys added per tiny generation published and activated."""
    before = etcd.usage(endpoints)
    for index in range(generations):
        publish_local(store, MODEL, tiny(float(index + 1)), dtype="float32")
    after = etcd.usage(endpoints)
    return {
        "generations": generations,
        "db_bytes_before": before.db_bytes,
        "db_bytes_after": after.db_bytes,
        "bytes_per_generation": round((after.db_bytes - before.db_bytes) / generations),
        "keys_per_generation": round((after.keys - before.keys) / generations, 1),
        "quota_fraction": round(after.quota_fraction, 6),
    }


def one_kill(durable: DurableStore, store: StoreClient) -> dict[str, Any]:
    leader = durable.leader()
    if leader is None or leader.pid is None:
        raise RuntimeError("no leader to kill")
    expected = GenerationRegistry(store, MODEL).active()
    os.kill(leader.pid, signal.SIGKILL)
    killed = time.monotonic()
    record = GenerationRegistry(store, MODEL).active()  # rides the failover
    first_call_s = time.monotonic() - killed
    successor = durable.wait_for_leader()
    durable.replace_dead_masters()
    return {
        "kill_to_first_call_s": round(first_call_s, 2),
        "killed": leader.rpc_address,
        "leader_after": successor.rpc_address,
        "record_intact": record == expected,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    config = DurableConfig(masters=args.masters, log_dir=log_dir)
    with DurableStore(config) as durable:
        holder = SegmentHolder(
            durable.master_address,
            durable.metadata_url,
            64 << 20,
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
                failover_s=args.failover_s,
            )
            store = StoreClient(settings)
            try:
                growth = etcd_growth(store, durable.endpoints, args.generations)
                incarnation = Incarnation.read(store)
                kills = [one_kill(durable, store) for _ in range(args.kills)]
                intact = Incarnation.read(store) == incarnation
                verified = bool(verify_generation(store, MODEL)["ok"])
            finally:
                closing = time.monotonic()
                store.close()
                close_s = time.monotonic() - closing
    seconds = [kill["kill_to_first_call_s"] for kill in kills]
    return {
        "masters": args.masters,
        "failover_s_setting": args.failover_s,
        "kills": kills,
        "kill_to_first_call_s": {"median": statistics.median(seconds), "max": max(seconds)},
        "goal_s": GOAL_S,
        "within_goal": max(seconds) <= GOAL_S,
        "incarnation_intact": intact,
        "generation_verified": verified,
        "etcd": growth,
        "close_s": round(close_s, 2),
        "logs": str(log_dir),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench failover", description=__doc__)
    parser.add_argument("--masters", type=int, default=2)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--generations", type=int, default=20)
    parser.add_argument("--failover-s", type=float, default=30.0)
    args = parser.parse_args(argv)
    if args.masters < 2 or args.kills < 1 or args.generations < 1:
        parser.error("need --masters >= 2, --kills >= 1 and --generations >= 1")
    print(json.dumps(run(args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
