"""``mooncake-rl`` command line: thin argument parsing over the library's entry points."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType

from mooncake_rl.errors import MooncakeRLError
from mooncake_rl.services import EmbeddedMaster, MasterConfig
from mooncake_rl.settings import Settings


def _client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", help="host:port of mooncake_master (MOONCAKE_RL_MASTER)")
    parser.add_argument("--metadata", help="metadata URL or P2PHANDSHAKE (MOONCAKE_RL_METADATA)")
    parser.add_argument("--protocol", choices=["tcp", "rdma"], help="(MOONCAKE_RL_PROTOCOL)")
    parser.add_argument("--hostname", help="this client's address (MOONCAKE_RL_HOSTNAME)")
    parser.add_argument("--node", help="node label for NIC accounting (MOONCAKE_RL_NODE)")


def settings_from(args: argparse.Namespace) -> Settings:
    keys = ("master", "metadata", "protocol", "hostname", "node")
    return Settings().with_overrides(**{k: getattr(args, k, None) for k in keys})


def cmd_master(args: argparse.Namespace) -> int:
    master = EmbeddedMaster(
        MasterConfig(host=args.host, rpc_port=args.port, metadata_port=args.metadata_port)
    ).start()

    def stop(signum: int, frame: FrameType | None) -> None:
        master.stop()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(
        json.dumps(
            {"master": master.master_address, "metadata": master.metadata_url, "pid": master.pid}
        ),
        flush=True,
    )
    print(
        f"export MOONCAKE_RL_MASTER={master.master_address} "
        f"MOONCAKE_RL_METADATA={master.metadata_url}",
        flush=True,
    )
    return master.wait()


def cmd_demo(args: argparse.Namespace) -> int:
    from mooncake_rl.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mooncake-rl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    master = commands.add_parser(
        "master", help="run mooncake_master with HTTP metadata (foreground)"
    )
    master.add_argument("--host", default="127.0.0.1")
    master.add_argument("--port", type=int, default=50051, help="RPC port (0 = any free port)")
    master.add_argument("--metadata-port", type=int, default=8080, help="HTTP metadata port")
    master.set_defaults(func=cmd_master)

    demo = commands.add_parser("demo", help="the end-to-end demonstration (make demo)")
    demo.set_defaults(func=cmd_demo)

    for register in EXTRA_COMMANDS:
        register(commands, _client_flags)
    return parser


# Subcommands owned by other modules register themselves here (publish, status, update, ...).
EXTRA_COMMANDS: list[
    Callable[[argparse._SubParsersAction, Callable[[argparse.ArgumentParser], None]], None]
] = []


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MooncakeRLError as error:
        print(f"mooncake-rl: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
