"""``update`` and ``router``: engine URLs --> a coordinator (and the request router in front
of them) through a short-lived Store client --> the update's result as JSON and a delivery
table, or the router's workers; ``update``'s own exit codes are the ``EXIT_*`` below.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.table import Table

from mooncake_rl.commands.store_client import add_client_flags, open_store
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.plan.params import PULLS
from mooncake_rl.progress import progress
from mooncake_rl.protocol import PAUSE_MODES
from mooncake_rl.router import KINDS, Rotation, Router, RouterSpec, open_router
from mooncake_rl.settings import Settings
from mooncake_rl.transport.modes import TransportMode
from mooncake_rl.units import parse_size

EXIT_MIXED_INVALID = 3
"""``update``: an auto update under MOONCAKE_RL_ASSERT_MIXED_TRANSPORT=1 lacked a leg."""
EXIT_OUT_OF_ROTATION = 4
"""``update --router``: the engines synced, but some could not be re-added to the router."""


def add_engine_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    add_client_flags(update)
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
    add_client_flags(router)
    router.set_defaults(func=cmd_router)


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
        open_store(args) as store,
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
    with open_store(args) as store, _router(args) as router:
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
