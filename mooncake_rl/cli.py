"""``mooncake-rl`` command line: thin argument parsing over the library's entry points."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from mooncake_rl.commands.engines import add_engine_commands
from mooncake_rl.commands.generations import add_generation_commands
from mooncake_rl.commands.services import add_service_commands
from mooncake_rl.errors import MooncakeRLError
from mooncake_rl.store import exit_process

# The program: its parser and main(); each command group (parsers and code) lives in
# mooncake_rl.commands. The docstring above is the parser's description (--help).


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
    add_service_commands(commands)
    add_generation_commands(commands)
    add_engine_commands(commands)

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
