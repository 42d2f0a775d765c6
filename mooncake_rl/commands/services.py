"""``master`` and ``holder``: the Store's processes in the foreground --> their addresses as
JSON and as a shell ``export`` line --> served until SIGTERM/SIGINT (exit 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from collections.abc import Callable

from mooncake_rl.commands.store_client import settings_from
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.services import (
    DEFAULT_CLUSTER_ID,
    DurableConfig,
    DurableStore,
    EmbeddedEtcd,
    EmbeddedMaster,
    MasterConfig,
    SegmentHolder,
    StopSignals,
    serve_until_stopped,
)
from mooncake_rl.units import parse_size


def add_service_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    master = commands.add_parser(
        "master",
        help="run the Store (foreground): durable (etcd + HA masters) unless --plain",
    )
    master.add_argument("--host", default="127.0.0.1")
    master.add_argument(
        "--masters",
        type=int,
        default=2,
        help="HA masters (default 2: a standby takes over when the leader dies)",
    )
    master.add_argument(
        "--etcd", help="endpoints of an existing etcd (h:p;h:p); default: start one embedded"
    )
    master.add_argument(
        "--etcd-members",
        type=int,
        default=1,
        help="members of the embedded etcd (odd; 3 survives one loss)",
    )
    master.add_argument(
        "--etcd-quota-bytes",
        type=parse_size,
        default=None,
        help="the embedded etcd's --quota-backend-bytes (default etcd's 2 GiB; the operation "
        "log is never pruned: docs/etcd-growth.md)",
    )
    master.add_argument(
        "--cluster-id",
        default=DEFAULT_CLUSTER_ID,
        help="the masters' cluster id in etcd (clients: MOONCAKE_RL_CLUSTER_ID)",
    )
    master.add_argument(
        "--plain",
        action="store_true",
        help="one in-memory master with HTTP metadata (loses every object when it dies)",
    )
    master.add_argument(
        "--port", type=int, default=50051, help="--plain: RPC port (0 = any free port)"
    )
    master.add_argument(
        "--metadata-port", type=int, default=8080, help="--plain: HTTP metadata port"
    )
    master.add_argument(
        "--segment-bytes",
        type=int,
        default=1 << 30,
        help="also run a segment holder lending this much memory (0: none)",
    )
    master.set_defaults(func=cmd_master)

    holder = commands.add_parser(
        "holder", help="lend memory to an existing master's Store (segment holder, foreground)"
    )
    holder.add_argument(
        "--segment-bytes", type=int, default=1 << 30, help="memory to lend (default 1 GiB)"
    )
    holder.add_argument(
        "--master", help="host:port of mooncake_master or etcd://h:p;h:p (MOONCAKE_RL_MASTER)"
    )
    holder.add_argument("--metadata", help="metadata URL (MOONCAKE_RL_METADATA)")
    holder.add_argument("--cluster-id", help="durable Store's cluster id (MOONCAKE_RL_CLUSTER_ID)")
    holder.add_argument(
        "--hostname", help="address clients reach this holder at (MOONCAKE_RL_HOSTNAME)"
    )
    holder.set_defaults(func=cmd_holder)


def cmd_master(args: argparse.Namespace) -> int:
    """The Store (and a holder) in the foreground; SIGTERM/SIGINT stop all and exit 0.

    Durable by default: etcd (embedded unless ``--etcd``) and ``--masters`` HA masters, a
    dead master replaced by a fresh standby, a dead embedded etcd member restarted;
    ``--plain``: one in-memory master, HTTP metadata.
    """
    with StopSignals() as stop, contextlib.ExitStack() as running:
        store: DurableStore | EmbeddedMaster
        if args.plain:
            config = MasterConfig(
                host=args.host, rpc_port=args.port, metadata_port=args.metadata_port
            )
            store = running.enter_context(EmbeddedMaster(config))
            services: list[EmbeddedEtcd | EmbeddedMaster | SegmentHolder] = [store]
            exports = {"MOONCAKE_RL_MASTER": store.master_address}
        else:
            durable = DurableConfig(
                host=args.host,
                masters=args.masters,
                etcd=args.etcd,
                etcd_members=args.etcd_members,
                cluster_id=args.cluster_id,
                etcd_quota_bytes=args.etcd_quota_bytes,
            )
            store = running.enter_context(DurableStore(durable))
            services = list(store.etcd)
            exports = {
                "MOONCAKE_RL_MASTER": store.master_address,
                "MOONCAKE_RL_CLUSTER_ID": store.cluster_id,
            }
            if args.etcd_quota_bytes is not None:
                exports["MOONCAKE_RL_ETCD_QUOTA_BYTES"] = str(args.etcd_quota_bytes)
        exports["MOONCAKE_RL_METADATA"] = store.metadata_url
        if args.segment_bytes > 0:
            holder = running.enter_context(
                SegmentHolder(
                    store.master_address,
                    store.metadata_url,
                    args.segment_bytes,
                    args.host,
                    cluster_id=args.cluster_id,
                )
            )
            services.append(holder)
            exports["MOONCAKE_RL_LOCAL_SEGMENT"] = holder.segment
        print(json.dumps({**exports, **_pids(store)}), flush=True)
        print(_export_line(exports), flush=True)
        tick = None if isinstance(store, EmbeddedMaster) else _replacing(store)
        return serve_until_stopped(services, stop, tick=tick)
    return 0  # stopped while starting


def _pids(store: DurableStore | EmbeddedMaster) -> dict[str, object]:
    """The master's pid; a durable Store's leader and every master (what a test kills)."""
    if isinstance(store, EmbeddedMaster):
        return {"pid": store.pid}
    leader = store.leader()
    return {"pid": leader.pid if leader else None, "masters": [m.pid for m in store.masters]}


def _replacing(store: DurableStore) -> Callable[[], None]:
    def tick() -> None:
        for event in store.heal():
            print(event, file=sys.stderr, flush=True)

    return tick


def _export_line(exports: dict[str, str]) -> str:
    """A shell line; values quoted (``etcd://h:p;h:p`` holds a semicolon)."""
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in exports.items())


def cmd_holder(args: argparse.Namespace) -> int:
    """A segment holder for an existing master: the memory short-lived clients write into."""
    if args.segment_bytes <= 0:
        raise ConfigurationError("--segment-bytes must be positive")
    settings = settings_from(args)
    with StopSignals() as stop, contextlib.ExitStack() as running:
        holder = running.enter_context(
            SegmentHolder(
                settings.master,
                settings.metadata,
                args.segment_bytes,
                settings.hostname,
                cluster_id=settings.cluster_id,
            )
        )
        exports = {"MOONCAKE_RL_LOCAL_SEGMENT": holder.segment}
        line = {**exports, "segment": holder.segment, "segment_bytes": args.segment_bytes}
        print(json.dumps({**line, "pid": holder.pid}), flush=True)
        print(_export_line(exports), flush=True)
        return serve_until_stopped([holder], stop)
    return 0  # stopped while starting
