"""``publish``, ``status``, ``gc``, ``activate``, ``verify``: a model's generations in the
Store --> :mod:`mooncake_rl.generations.commands` through a short-lived client --> JSON or
a status listing on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from mooncake_rl.commands.store_client import add_client_flags, open_store
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations.chain import DEFAULT_DELTA_FRACTION
from mooncake_rl.generations.packing import DEFAULT_PACK_BYTES
from mooncake_rl.progress import progress
from mooncake_rl.units import parse_size


def add_generation_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    publish = commands.add_parser(
        "publish", help="publish a safetensors checkpoint as the next generation"
    )
    publish.add_argument("model_dir", nargs="?", help="a safetensors checkpoint directory")
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
    publish.add_argument(
        "--delta-every",
        type=int,
        metavar="K",
        help="publish a delta against the newest generation (only what changed), with a full "
        "keyframe at least every K generations (docs/delta.md); default: always full",
    )
    publish.add_argument(
        "--delta-max-fraction",
        type=float,
        default=DEFAULT_DELTA_FRACTION,
        metavar="F",
        help="with --delta-every: a keyframe once the chain's deltas weigh over F of a full one",
    )
    publish.add_argument(
        "--lora",
        metavar="ADAPTER_DIR",
        help="publish a PEFT LoRA adapter (adapter_config.json + safetensors) instead of a "
        "checkpoint, as a generation of --name bound to --base (docs/lora.md)",
    )
    publish.add_argument("--base", metavar="MODEL", help="with --lora: the base model's name")
    publish.add_argument(
        "--base-generation",
        type=int,
        metavar="G",
        help="with --lora: the base generation it applies to (default: the base's active one)",
    )
    add_client_flags(publish)
    publish.set_defaults(func=cmd_publish)

    status = commands.add_parser("status", help="list a model's generations")
    status.add_argument("--name", required=True)
    status.add_argument("--json", action="store_true")
    add_client_flags(status)
    status.set_defaults(func=cmd_status)

    gc = commands.add_parser("gc", help="delete old generations nobody serves")
    gc.add_argument("--name", required=True)
    gc.add_argument("--keep", type=int, default=2)
    add_client_flags(gc)
    gc.set_defaults(func=cmd_gc)

    activate = commands.add_parser(
        "activate", help="make an older, fully readable generation active again"
    )
    activate.add_argument("--name", required=True)
    activate.add_argument("--generation", type=int, required=True)
    add_client_flags(activate)
    activate.set_defaults(func=cmd_activate)

    verify = commands.add_parser("verify", help="check a generation is whole in the Store")
    verify.add_argument("--name", required=True)
    verify.add_argument("--generation", type=int, help="default: the active one")
    add_client_flags(verify)
    verify.set_defaults(func=cmd_verify)


def cmd_publish(args: argparse.Namespace) -> int:
    from mooncake_rl.generations.commands import checkpoint_bytes, publish_checkpoint

    if (args.model_dir is None) == (args.lora is None):
        raise ConfigurationError("publish takes a checkpoint directory or --lora ADAPTER_DIR")
    if args.lora is not None:
        return _publish_adapter(args)
    model_dir = Path(args.model_dir)
    total = checkpoint_bytes(model_dir)
    with progress("publish", total, unit="bytes") as steps, open_store(args) as store:
        record = publish_checkpoint(
            store,
            args.name,
            model_dir,
            args.dtype,
            args.replicas,
            args.keep,
            args.pack_bytes,
            steps.advance,
            args.delta_every,
            args.delta_max_fraction,
        )
    print(record.generation)
    return 0


def _publish_adapter(args: argparse.Namespace) -> int:
    from mooncake_rl.generations.lora import AdapterBase, publish_adapter, read_adapter
    from mooncake_rl.generations.registry import require_active

    if args.base is None:
        raise ConfigurationError("--lora needs --base MODEL: the base model the adapter applies to")
    adapter = read_adapter(Path(args.lora))  # refused before the Store is touched
    with open_store(args) as store:
        generation = args.base_generation
        if generation is None:
            generation = require_active(store, args.base, "cannot bind the adapter").generation
        base = AdapterBase(args.base, generation)
        record = publish_adapter(store, args.name, adapter, base, dtype=args.dtype, keep=args.keep)
    print(record.generation)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from mooncake_rl.generations.commands import generation_status

    with open_store(args) as store:
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

    with open_store(args) as store:
        print(json.dumps(activate_generation(store, args.name, args.generation)))
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from mooncake_rl.generations.commands import gc_generations

    with open_store(args) as store:
        print(json.dumps(gc_generations(store, args.name, args.keep)))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from mooncake_rl.generations.commands import verify_generation

    with open_store(args) as store:
        report = verify_generation(store, args.name, args.generation)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1
