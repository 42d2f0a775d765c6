"""``mooncake-rl`` command line: thin argument parsing over the library's entry points."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.table import Table

from mooncake_rl.errors import ConfigurationError, MooncakeRLError
from mooncake_rl.generations.packing import DEFAULT_PACK_BYTES
from mooncake_rl.plan.params import PULLS
from mooncake_rl.progress import progress
from mooncake_rl.protocol import PAUSE_MODES
from mooncake_rl.router import KINDS, Rotation, Router, RouterSpec, open_router
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
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient, exit_process
from mooncake_rl.transport.modes import TransportMode
from mooncake_rl.units import parse_size

EXIT_MIXED_INVALID = 3
"""``update``: an auto update under MOONCAKE_RL_ASSERT_MIXED_TRANSPORT=1 lacked a leg."""
EXIT_OUT_OF_ROTATION = 4
"""``update --router``: the engines synced, but some could not be re-added to the router."""


def _client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--master", help="host:port of mooncake_master or etcd://h:p;h:p (MOONCAKE_RL_MASTER)"
    )
    parser.add_argument("--cluster-id", help="durable Store's cluster id (MOONCAKE_RL_CLUSTER_ID)")
    parser.add_argument("--metadata", help="metadata URL or P2PHANDSHAKE (MOONCAKE_RL_METADATA)")
    parser.add_argument("--protocol", choices=["tcp", "rdma"], help="(MOONCAKE_RL_PROTOCOL)")
    parser.add_argument("--hostname", help="this client's address (MOONCAKE_RL_HOSTNAME)")
    parser.add_argument("--node", help="node label for NIC accounting (MOONCAKE_RL_NODE)")
    parser.add_argument("--local-segment", help="segment to prefer (MOONCAKE_RL_LOCAL_SEGMENT)")


def settings_from(args: argparse.Namespace) -> Settings:
    keys = ("master", "cluster_id", "metadata", "protocol", "hostname", "node", "local_segment")
    return Settings().with_overrides(**{k: getattr(args, k, None) for k in keys})


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


@contextlib.contextmanager
def _store(args: argparse.Namespace) -> Iterator[StoreClient]:
    """A CLI process is short-lived: it lends no memory, so nothing it writes dies with it;
    its client of a durable Store is parked at close and, run as the program, ends with the
    process (:func:`exit_process`)."""
    with StoreClient(settings_from(args).with_overrides(segment_bytes=0)) as store:
        yield store


def cmd_publish(args: argparse.Namespace) -> int:
    from mooncake_rl.generations.commands import checkpoint_bytes, publish_checkpoint

    model_dir = Path(args.model_dir)
    total = checkpoint_bytes(model_dir)
    with progress("publish", total, unit="bytes") as steps, _store(args) as store:
        record = publish_checkpoint(
            store,
            args.name,
            model_dir,
            args.dtype,
            args.replicas,
            args.keep,
            args.pack_bytes,
            steps.advance,
        )
    print(record.generation)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from mooncake_rl.generations.commands import generation_status

    with _store(args) as store:
        status = generation_status(store, args.name)
        usage = store.etcd_usage()
    if usage is not None:
        status["etcd"] = {**asdict(usage), "quota_fraction": round(usage.quota_fraction, 4)}
    if status["problem"]:
        print(f"mooncake-rl: {status['problem']}", file=sys.stderr)
    if args.json:
        print(json.dumps(status, indent=2))
        return 1 if status["problem"] else 0
    print(
        f"model {status['model']}: active generation {status['active']} "
        f"(Store incarnation {status['incarnation']})"
    )
    if usage is not None:
        print(f"etcd: {usage.describe()}; see docs/etcd-growth.md")
        if (warning := usage.warning()) is not None:
            print(f"WARNING: {warning}")
    for row in status["generations"]:  # type: ignore[union-attr]
        mark = "*" if row["active"] else " "
        readable = "" if row["readable"] else f", UNREADABLE: {row['unreadable_objects'][0]}"
        print(
            f"{mark} g{row['generation']}: {row['tensors']} tensors, {row['bytes']} bytes, "
            f"digest {row['digest'][:12]}, segments {row.get('bytes_per_segment')}{readable}"
        )
    return 1 if status["problem"] else 0


def cmd_activate(args: argparse.Namespace) -> int:
    from mooncake_rl.generations.commands import activate_generation

    with _store(args) as store:
        print(json.dumps(activate_generation(store, args.name, args.generation)))
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from mooncake_rl.generations.commands import gc_generations

    with _store(args) as store:
        print(json.dumps(gc_generations(store, args.name, args.keep)))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from mooncake_rl.generations.commands import verify_generation

    with _store(args) as store:
        report = verify_generation(store, args.name, args.generation)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


def cmd_update(args: argparse.Namespace) -> int:
    from rich.console import Console

    from mooncake_rl.coordinator import Coordinator, ReadmitFailed, UpdateFailed
    from mooncake_rl.metrics import MetricsExport, UpdateMetrics
    from mooncake_rl.transport.topology import MixedTransportInvalid

    console = Console(stderr=True)
    token = Settings().auth_token
    metrics = UpdateMetrics(MetricsExport(args.metrics_port, args.metrics_textfile))
    with (
        progress("update") as steps,
        _store(args) as store,
        Coordinator(
            store,
            args.engine,
            token=token.get_secret_value() if token else None,
            session_ttl_s=args.session_ttl,
            progress=lambda phase: steps.step(f"{phase} done"),
            max_connections=args.max_connections,
        ) as coordinator,
        _router(args) as router,
        metrics.serving(),
    ):
        try:
            result = metrics.observe(
                lambda: coordinator.update(
                    args.name,
                    mode=args.mode,
                    drain_mode=args.drain,
                    direct_fallback=args.direct_fallback,
                    batch_bytes=args.batch_bytes,
                    min_engines=args.min_engines,
                    transport=args.transport,
                    train_gpus=args.train_gpus,
                    router=router,
                    max_unavailable=args.max_unavailable,
                    in_place=not args.staged,
                    pull=args.pull,
                )
            )
        except UpdateFailed as failed:
            print(json.dumps(failed.result.to_json(), indent=2))
            return 1
        except ReadmitFailed as stuck:
            print(json.dumps(stuck.result.to_json(), indent=2))
            console.print(f"[bold red]OUT OF ROTATION[/]: {stuck}")
            return EXIT_OUT_OF_ROTATION
        except MixedTransportInvalid as invalid:
            console.print(f"[bold red]INVALID[/]: {invalid}")
            return EXIT_MIXED_INVALID
    console.print(leg_table(result.legs))
    print(json.dumps(result.to_json(), indent=2))
    return 0


@contextlib.contextmanager
def _router(args: argparse.Namespace) -> Iterator[Router | None]:
    if args.router is None:
        yield None
        return
    router = open_router(RouterSpec(args.router, args.router_kind, token=_router_key(args)))
    try:
        yield router
    finally:
        router.close()


def _router_key(args: argparse.Namespace) -> str | None:
    """``--router-api-key``, else ``MOONCAKE_RL_ROUTER_API_KEY``: read, never printed."""
    if args.router_api_key:
        return str(args.router_api_key)
    key = Settings().router_api_key
    return key.get_secret_value() if key else None


def cmd_router(args: argparse.Namespace) -> int:
    """Scale-up and scale-down through the same serialized steps as an update's bracket."""
    if args.action != "list" and not args.engine:
        raise ConfigurationError(f"`mooncake-rl router {args.action}` needs an engine URL")
    with _store(args) as store, _router(args) as router:
        assert router is not None
        rotation = Rotation(router, store, holder=f"mooncake-rl router {args.action}")
        if args.action == "add":
            rotation.admit(args.engine, force=args.force)
        elif args.action == "remove":
            rotation.retire(args.engine)
        held = {url: entry.__dict__ for url, entry in rotation.held_out().items()}
        print(json.dumps({"workers": router.workers(), "held_out": held}, indent=2))
    return 0


def _router_flags(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--router",
        required=required,
        metavar="URL",
        help="the request router in front of the engines: each engine leaves its rotation "
        "before it drains and is re-admitted after its sync",
    )
    parser.add_argument(
        "--router-kind", choices=KINDS, default="vllm", help="its worker API (default vllm)"
    )
    parser.add_argument(
        "--router-api-key",
        metavar="KEY",
        help="bearer key of the router's worker API (default: MOONCAKE_RL_ROUTER_API_KEY; "
        "the variable keeps the key out of the process list)",
    )


def leg_table(legs: dict[str, dict[str, Any]]) -> Table:
    """Per engine: how its bytes came, how many, how fast (the CLI summary)."""
    table = Table("engine", "transport", "bytes", "seconds", title="delivery per engine")
    for url, row in sorted(legs.items()):
        table.add_row(url, row["transport"], f"{row['bytes']:,}", f"{row['seconds']:.3f}")
    return table


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"not a regular expression: {error}") from None
    return value


def _size(value: str) -> int:
    try:
        size = parse_size(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {value!r} (bytes, or a number with KiB, MiB or GiB)"
        ) from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value!r}")
    return size


def _count(value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value!r}")
    return count


def cmd_demo(args: argparse.Namespace) -> int:
    from engine_ext.vllm.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mooncake-rl", description=__doc__)
    parser.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        help="show Mooncake's native log (MOONCAKE_RL_LOG_LEVEL=info); by default a healthy "
        "run keeps it in mooncake-native.log",
    )
    commands = parser.add_subparsers(dest="command", required=True)

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

    publish = commands.add_parser(
        "publish", help="publish a safetensors checkpoint as the next generation"
    )
    publish.add_argument("model_dir")
    publish.add_argument("--name", required=True, help="model name in the Store")
    publish.add_argument(
        "--dtype",
        default="bfloat16",
        help="rollout dtype (bfloat16, float16, float32) or fp8_e4m3 (block fp8, docs/fp8.md)",
    )
    publish.add_argument(
        "--replicas",
        type=int,
        default=1,
        choices=range(1, 9),
        metavar="N",
        help="copies of every object, each in another segment (1-8; needs N segments)",
    )
    publish.add_argument(
        "--keep", type=int, default=2, help="retention after announce: newest generations kept"
    )
    publish.add_argument(
        "--pack-bytes",
        type=parse_size,
        default=DEFAULT_PACK_BYTES,
        metavar="SIZE",
        help="size of the Store objects small tensors share (e.g. 128MiB; at most 1GiB)",
    )
    _client_flags(publish)
    publish.set_defaults(func=cmd_publish)

    status = commands.add_parser("status", help="list a model's generations")
    status.add_argument("--name", required=True)
    status.add_argument("--json", action="store_true")
    _client_flags(status)
    status.set_defaults(func=cmd_status)

    gc = commands.add_parser("gc", help="delete old generations nobody serves")
    gc.add_argument("--name", required=True)
    gc.add_argument("--keep", type=int, default=2)
    _client_flags(gc)
    gc.set_defaults(func=cmd_gc)

    activate = commands.add_parser(
        "activate", help="make an older, fully readable generation active again"
    )
    activate.add_argument("--name", required=True)
    activate.add_argument("--generation", type=int, required=True)
    _client_flags(activate)
    activate.set_defaults(func=cmd_activate)

    verify = commands.add_parser("verify", help="check a generation is whole in the Store")
    verify.add_argument("--name", required=True)
    verify.add_argument("--generation", type=int, help="default: the active one")
    _client_flags(verify)
    verify.set_defaults(func=cmd_verify)

    update = commands.add_parser("update", help="bring engines to the active generation")
    update.add_argument("--name", required=True)
    update.add_argument("--engine", action="append", required=True, help="engine base URL")
    update.add_argument("--mode", choices=["compat", "direct"], default="compat")
    update.add_argument(
        "--drain",
        choices=PAUSE_MODES,
        default="abort",
        help="how in-flight requests fare when an engine pauses to land: abort, wait for "
        "them, or keep them (frozen, resumed on the new weights)",
    )
    update.add_argument(
        "--direct-fallback",
        type=_regex,
        metavar="REGEX",
        help="direct mode: parameters whose names match land through the engine's "
        "load_weights (full tensors) instead of its shard discovery",
    )
    update.add_argument(
        "--batch-bytes",
        type=_size,
        metavar="SIZE",
        help="bytes each worker reads per pipeline batch, e.g. 64MiB (MOONCAKE_RL_BATCH_BYTES, "
        "default 64MiB); every engine's staging watermark must hold two batches",
    )
    update.add_argument(
        "--pull",
        choices=list(PULLS),
        default="single",
        help="read each published byte from the Store once for the fleet (single), or once "
        "per rollout node (node), which fans compat mode's full tensors out inside each "
        "node as they land; the trainers' NICs then serve the model once per node",
    )
    update.add_argument(
        "--staged",
        action="store_true",
        help="direct mode: stage every byte and land it at commit, instead of receiving "
        "into live parameters that need no post-load processing (a failed update then "
        "leaves engines on their old generation rather than rebuilding from the Store)",
    )
    update.add_argument(
        "--min-engines",
        type=int,
        metavar="N",
        help="go on when at least N engines can end on the new generation (default: all); "
        "the others are released on their old generation and reported",
    )
    update.add_argument(
        "--session-ttl",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="engines free themselves this long after this command stops renewing its session",
    )
    update.add_argument(
        "--max-connections",
        type=_count,
        metavar="N",
        help="at most N engine calls of a phase in flight at once, the rest wait their turn "
        "(default: every engine at once; bound it when the engines outnumber this "
        "process's open-file limit)",
    )
    update.add_argument(
        "--transport",
        choices=[m.value for m in TransportMode],
        help="how the bytes travel (MOONCAKE_RL_TRANSPORT, default store): the Store path, "
        "broadcast to every engine, CPU serialization to every engine, or auto (broadcast "
        "to engines disjoint from the train pool, CPU serialization to colocated ones)",
    )
    update.add_argument(
        "--train-gpus",
        metavar="IDS",
        help="the train pool's physical GPU ids, comma-separated (MOONCAKE_RL_TRAIN_GPUS); "
        "needed by every transport but store",
    )
    _router_flags(update, required=False)
    update.add_argument(
        "--max-unavailable",
        type=int,
        metavar="K",
        help="rolling update: take K engines out at a time, all pinned to one generation "
        "(default: all at once)",
    )
    update.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the update's mooncake_rl_* metrics for Prometheus on this port while the "
        "command runs (docs/metrics.md)",
    )
    update.add_argument(
        "--metrics-textfile",
        type=Path,
        metavar="PATH",
        help="write the update's mooncake_rl_* metrics to this node-exporter textfile "
        "(*.prom), atomically, when it ends (docs/metrics.md)",
    )
    _client_flags(update)
    update.set_defaults(func=cmd_update)

    router = commands.add_parser(
        "router", help="list, add (scale up) or remove (scale down) a router's engines"
    )
    router.add_argument("action", choices=["list", "add", "remove"])
    router.add_argument("engine", nargs="?", help="engine base URL (add, remove)")
    router.add_argument(
        "--force",
        action="store_true",
        help="add: also an engine an update holds out (that update's coordinator died)",
    )
    _router_flags(router, required=True)
    _client_flags(router)
    router.set_defaults(func=cmd_router)

    demo = commands.add_parser("demo", help="the end-to-end demonstration (make demo)")
    demo.set_defaults(func=cmd_demo)

    # Parsed by bench itself (main() forwards before argparse sees its flags); listed for help.
    commands.add_parser(
        "bench",
        help="benchmarks side by side (JSON + PNG); `bench simulate` estimates 1T-scale updates; "
        "`bench scale` plans for up to 1,000 engines; `bench control-plane` drives fake ones; "
        "`bench failover` SIGKILLs the durable Store's leader",
        add_help=False,
    )

    return parser


def cmd_bench(argv: Sequence[str]) -> int:
    """Forward everything after ``bench`` to the bench package (imported only when used)."""
    from bench.__main__ import main as bench_main

    return bench_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``mooncake-rl`` program. Run as the program (``argv`` from ``sys.argv``), it ends
    the process at once after a command that used a durable Store (:func:`exit_process`);
    called with ``argv`` (tests, scripts) it returns the exit code."""
    if argv is not None:
        return _run(list(argv))
    return exit_process(_run(sys.argv[1:]))


def _run(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])
    args = build_parser().parse_args(argv)
    if args.verbose:  # before any settings are read; children inherit it
        os.environ["MOONCAKE_RL_LOG_LEVEL"] = "info"
    try:
        return int(args.func(args) or 0)
    except MooncakeRLError as error:
        print(f"mooncake-rl: error: {error}", file=sys.stderr)
        return 2
    except ValidationError as error:  # a MOONCAKE_RL_* variable the settings refuse
        print(f"mooncake-rl: error: invalid MOONCAKE_RL_* setting: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
