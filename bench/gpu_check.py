"""``make gpu-check``: the direct-mode update path on one CUDA GPU, measured and checked.

Starts a real ``mooncake_master`` and segment holder, publishes two synthetic bf16
generations (a MoE-shaped one: at least 50,000 tensors and 4 GiB; a dense one), and updates
the live parameters of worker processes (one TP group on the GPU) in direct mode, through
the project's planner, executor and checksum checks (four times: the figures are the median
of the last three, an RL run's steady state; ``first_apply_seconds`` is the first's, which
also opens the workers' connections), two ways:

- ``in_place``: the parameters are the receive regions (Store reads and peer pushes land in
  live storage; nothing to copy at commit);
- ``staged``: bytes land in a device arena beside the parameters, then a landing planned
  once per worker (``mooncake_rl.apply.landing``: batched ``torch._foreach_copy_``) lands
  them.

For scale, the same run measures a device-to-device copy and the Store's ranged
``get_into`` of the dense generation straight into device memory. Every landed parameter
is compared with the published bytes (XXH3-64 of each shard). One JSON object goes to
stdout, with the issue's goals evaluated: at most 5 us per tensor at 50,000 tensors, update
GB/s at least 0.8 x the Store's ``get_into`` GB/s, staged landing (``land_gbps``: staged
bytes over the workers' landing time) at least 0.8 x the device copy's GB/s in every staged
update, every parameter bit-exact. Where a CUDA
build of vLLM is importable it also updates one real vLLM engine on the GPU (compat and
direct) and checks its outputs against a reference; otherwise the JSON says why not.

``--device cpu`` runs the same on the CPU at any size (the test suite's smoke).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from bench.common import get_into_gbps, parse_size, store_services, synthetic_model
from bench.common import specs_of as bench_specs
from mooncake_rl.apply.process import WorkerCluster, WorkerMemory, run_planned_update
from mooncake_rl.generations.catalog import specs_of
from mooncake_rl.generations.pack_order import PackOrder, save_pack_order
from mooncake_rl.generations.packing import object_extents
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.plan.synthetic import shard_bytes, simulated_engines
from mooncake_rl.plan.update import RoutingCache, plan_update
from mooncake_rl.progress import progress
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

GOAL_US_PER_TENSOR = 5.0
GOAL_GET_INTO_RATIO = 0.8
GOAL_LAND_RATIO = 0.8
EVICT_BYTES = 512 << 20
"""Written between timed CPU copies, several times any last-level cache, so a copy starts
cold as a landing does."""
STEADY_UPDATES = 3
"""Steady updates per generation and mode; the figures are the median one's (the Store's
``get_into`` is the best of three)."""


@dataclass(frozen=True)
class GpuCheckConfig:
    device: str = "cuda"
    moe_bytes: int = 4 << 30
    moe_tensors: int = 50_000
    dense_bytes: int = 1 << 30
    dense_tensors: int = 64
    workers: int = 2
    batch_bytes: int = 64 << 20
    modes: tuple[str, ...] = ("in_place", "staged")
    pack_order: bool = True
    """Publish as an RL run's steady state: packs laid out by the order the engines' first
    update taught (``generations.pack_order``); off, tensor after tensor."""
    steady_updates: int = STEADY_UPDATES
    """Updates after the first whose median is reported (one suffices for a smoke)."""

    def __post_init__(self) -> None:
        if not self.modes or set(self.modes) - {"in_place", "staged"}:
            raise ValueError(f"modes must be among in_place, staged; got {self.modes}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit("gpu-check: no CUDA device visible to torch (--device cpu to smoke)")
        if self.workers < 1 or min(self.moe_tensors, self.dense_tensors) < 1:
            raise ValueError("workers and tensor counts must be positive")
        if self.steady_updates < 1:
            raise ValueError("steady_updates must be at least 1")


def expected_digests(
    engines: Mapping[str, Any], model: Sequence[tuple[str, torch.Tensor]]
) -> dict[str, dict[str, str]]:
    """Per worker, per shard region: XXH3-64 of the published bytes of that shard."""
    return {
        worker: {region: xxhash.xxh3_64_hexdigest(raw) for region, raw in regions.items()}
        for worker, regions in shard_bytes(engines, dict(model)).items()
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def device_copy_gbps(device: str, nbytes: int) -> float:
    """Device-to-device copy of ``nbytes`` (bytes moved / seconds, best of three), as a
    landing copies: between buffers that hold bytes and sit out of the caches. A landing
    reads what the stage staged and writes parameters untouched since the last update; on
    the CPU a never-written buffer reads as the kernel's one zero page, and a 32 MiB copy
    repeated at once runs from the last-level cache (22-26 GB/s here, against 13-15 GB/s
    for written memory out of cache), so each timed copy follows a write of ``EVICT_BYTES``
    elsewhere. A GPU's L2 holds a few tens of MiB: there the default 1 GiB is past it."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    target = torch.zeros_like(source)
    elsewhere = torch.empty(EVICT_BYTES if device == "cpu" else 0, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        elsewhere.fill_(1)
        _sync(device)
        started = time.perf_counter()
        target.copy_(source)
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def update_row(
    settings: Settings,
    config: GpuCheckConfig,
    name: str,
    model: Sequence[tuple[str, torch.Tensor]],
    in_place: bool,
) -> dict[str, Any]:
    """Direct update of one generation into the workers' live parameters; checked."""
    with StoreClient(settings) as store:
        registry = GenerationRegistry(store, name)
        record = registry.active()
        assert record is not None
        manifest = registry.load_manifest(record.generation)
        checksums = registry.load_checksums(record.generation, record.checksums_digest).objects
    engines = simulated_engines(specs_of(manifest), [("node0", config.workers)], "direct")
    plan = plan_update(manifest, engines, "direct", config.batch_bytes, RoutingCache())
    workers = {
        w["worker_id"]: settings.with_overrides(
            batch_bytes=config.batch_bytes, staging_watermark_bytes=4 * config.batch_bytes
        )
        for ws in engines.values()
        for w in ws
    }
    memory = WorkerMemory(config.device, parameters=True, in_place=in_place)
    with WorkerCluster(workers, plan.routing.regions, memory) as cluster:
        # The first update also opens the workers' connections; the later ones are an RL
        # run's steady state: the median of ``steady_updates``, each landed.
        first = run_planned_update(cluster, plan, checksums=checksums)
        steady = []
        for _ in range(config.steady_updates):
            run = run_planned_update(cluster, plan, checksums=checksums)
            landed = {w: cluster.call(w, "land") for w in cluster.processes}
            steady.append(
                (run["seconds"] + max(f["seconds"] for f in landed.values()), run, landed)
            )
        digests = {w: cluster.call(w, "digest") for w in cluster.processes}
    _, run, landed = sorted(steady, key=lambda s: s[0])[len(steady) // 2]
    expected = expected_digests(engines, model)
    mismatched = sorted(
        f"{w}/{region}"
        for w, regions in expected.items()
        for region, digest in regions.items()
        if digests[w].get(region) != digest
    )
    tensors = sum(figures["tensors"] for figures in landed.values())
    nbytes = sum(t.numel() * t.element_size() for _, t in model)
    land = max(figures["seconds"] for figures in landed.values())
    staged = sum(f["staged_bytes"] for f in landed.values())
    # Workers land one after another (one call each), so their bytes over their summed time.
    land_total = sum(figures["seconds"] for figures in landed.values())
    seconds = run["seconds"] + land
    return {
        "tensors": len(model),
        "parameters_landed": tensors,
        "bytes": nbytes,
        "apply_seconds": round(run["seconds"], 4),
        "first_apply_seconds": round(first["seconds"], 4),
        "land_seconds": round(land, 4),
        "land_gbps": round(staged / land_total / 1e9, 3) if staged else None,
        "land_copies": sum(f["copies"] for f in landed.values()),
        "seconds": round(seconds, 4),
        "gbps": round(nbytes / seconds / 1e9, 3),
        "us_per_tensor": round(seconds / len(model) * 1e6, 3),
        "in_place_bytes": sum(f["in_place_bytes"] for f in landed.values()),
        "staged_bytes": staged,
        "store_read_bytes": sum(w["read"] for w in run["workers"].values()),
        "verified_bytes": sum(w["verified"] for w in run["workers"].values()),
        "bit_exact": not mismatched,
        "mismatched": mismatched[:10],
    }


def run(config: GpuCheckConfig) -> dict[str, Any]:
    started = time.monotonic()
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    total = config.moe_bytes + config.dense_bytes
    generations = {
        "moe": (config.moe_bytes, config.moe_tensors),
        "dense": (config.dense_bytes, config.dense_tensors),
    }
    rows: dict[str, dict[str, Any]] = {}
    # One line per step on stderr: a run cut short on a lent machine still says where.
    steps_total = len(generations) * (1 + len(config.modes)) + 3
    with (
        progress("gpu-check", steps_total) as steps,
        store_services(int(total * 1.25) + (256 << 20)) as (_, _, settings),
    ):
        object_sizes: dict[str, int] = {}
        for name, (nbytes, tensors) in generations.items():
            steps.step(f"publish {name}: {tensors} tensors, {nbytes >> 20} MiB")
            model = synthetic_model(nbytes, tensors)
            clock = time.perf_counter()
            with StoreClient(settings) as store:
                if config.pack_order:  # what the coordinator learns from the engines
                    cluster = [("node0", config.workers)]
                    engines = simulated_engines(bench_specs(model), cluster, "direct")
                    save_pack_order(store, f"gpu-check-{name}", PackOrder.of_engines(engines))
                record = publish_local(store, f"gpu-check-{name}", model, dtype="bfloat16")
                manifest = GenerationRegistry(store, f"gpu-check-{name}").load_manifest(
                    record.generation, record.manifest_digest
                )
            publish_seconds = time.perf_counter() - clock
            if name == "dense":
                object_sizes = {k: o.nbytes for k, o in object_extents(manifest).items()}
            for mode in config.modes:
                steps.step(f"update {name} {mode}")
                row = update_row(settings, config, f"gpu-check-{name}", model, mode == "in_place")
                row["publish_seconds"] = round(publish_seconds, 3)
                rows[f"{name}_{mode}"] = row
                print(json.dumps({f"{name}_{mode}": row}), file=sys.stderr, flush=True)
            del model
        steps.step("the Store's get_into into device memory")
        store_gbps = get_into_gbps(settings, config.device, object_sizes)
        steps.step("a real vLLM engine")
        engine = engine_row(settings, config.device)
        steps.step("device-to-device copy")
        copy_gbps = device_copy_gbps(config.device, min(config.dense_bytes, 1 << 30))
    worst = max(rows[f"moe_{mode}"]["us_per_tensor"] for mode in config.modes)
    # Per generation, its best mode's update GB/s over the Store's get_into of the same run.
    ratios = {
        name: round(max(rows[f"{name}_{m}"]["gbps"] for m in config.modes) / store_gbps, 3)
        for name in generations
    }
    landings = [row["land_gbps"] for row in rows.values() if row["land_gbps"] is not None]
    return {
        "check": "gpu",
        "date": date,
        "device": torch.cuda.get_device_name(config.device)
        if config.device.startswith("cuda")
        else "cpu",
        "config": asdict(config),
        "updates": rows,
        "scale": {
            "device_copy_gbps": round(copy_gbps, 2),
            "store_get_into_gbps": round(store_gbps, 2),
        },
        "vllm_engine": engine,
        "goals": {
            "us_per_tensor_at_most_5": worst <= GOAL_US_PER_TENSOR,
            "update_over_get_into": ratios,
            "gbps_at_least_0.8_get_into": min(ratios.values()) >= GOAL_GET_INTO_RATIO,
            "land_over_device_copy": round(min(landings) / copy_gbps, 3) if landings else None,
            "land_at_least_0.8_device_copy": min(landings) >= GOAL_LAND_RATIO * copy_gbps
            if landings
            else None,
            "each_byte_read_once": all(r["store_read_bytes"] == r["bytes"] for r in rows.values()),
            "verified_share": round(
                min(r["verified_bytes"] / r["store_read_bytes"] for r in rows.values()), 3
            ),
            "bit_exact": all(row["bit_exact"] for row in rows.values()),
            "vllm_outputs_match": engine.get("outputs_match"),
        },
        "wall_seconds": round(time.monotonic() - started, 1),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
    }


def engine_row(settings: Settings, device: str) -> dict[str, Any]:
    """One real vLLM engine on the GPU (a tiny tied Qwen2, ``bench.models``) through a compat
    and a direct update, its greedy output checked against transformers' for each
    generation; or why it could not run (no CUDA build of vLLM importable here)."""
    if not device.startswith("cuda"):
        return {"skipped": "a CPU run: vLLM-CPU engines are covered by the test suite"}
    try:
        from vllm.platforms import current_platform
    except ImportError as error:
        return {"skipped": f"vLLM is not installed for this Python ({error})"}
    if not current_platform.is_cuda():
        return {"skipped": f"the installed vLLM is a {current_platform.device_type} build"}
    from bench.models import finish_family, launch_family
    from bench.transports import landing_seconds
    from mooncake_rl.tiny_model import hf_greedy

    with tempfile.TemporaryDirectory() as root, StoreClient(settings) as store:
        launched = launch_family("qwen2", True, 1, Path(root), settings, store, reference=hf_greedy)
        run = finish_family(launched, store)
    modes = {
        name: {
            "error": mode.error,
            "outputs_match": mode.error is None and mode.outputs == mode.reference,
            "seconds": round(mode.seconds, 3),
            "received_bytes": mode.received_bytes,
            "in_place_bytes": mode.in_place_bytes,
            # The pause: the engine stops generating only to land (docs/pause.md).
            "pause_seconds": round(landing_seconds(mode.result.landing), 4)
            if mode.result is not None
            else None,
            "landing": next(iter(mode.result.landing.values()), {}) if mode.result else {},
        }
        for name, mode in (("compat", run.compat), ("direct", run.direct))
    }
    return {
        "family": "qwen2-tied-tp1",
        "error": run.error,
        **modes,
        "outputs_match": run.error is None and all(m["outputs_match"] for m in modes.values()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--moe-bytes", default="4GiB")
    parser.add_argument("--moe-tensors", type=int, default=50_000)
    parser.add_argument("--dense-bytes", default="1GiB")
    parser.add_argument("--dense-tensors", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="TP ranks on the one device")
    parser.add_argument("--batch", default="64MiB")
    parser.add_argument("--modes", nargs="+", choices=["in_place", "staged"])
    parser.add_argument(
        "--no-pack-order",
        action="store_true",
        help="pack tensor after tensor, as before the engines' first update (the baseline)",
    )
    args = parser.parse_args(argv)
    config = GpuCheckConfig(
        device=args.device,
        moe_bytes=parse_size(args.moe_bytes),
        moe_tensors=args.moe_tensors,
        dense_bytes=parse_size(args.dense_bytes),
        dense_tensors=args.dense_tensors,
        workers=args.workers,
        batch_bytes=parse_size(args.batch),
        modes=tuple(args.modes or ("in_place", "staged")),
        pack_order=not args.no_pack_order,
    )
    result = run(config)
    print(json.dumps(result, indent=2))
    return 0 if result["goals"]["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
