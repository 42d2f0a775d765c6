"""Updates under live traffic through a real router (``mooncake-rl bench load``).

Starts a real ``mooncake_master``, a segment holder, two real vLLM CPU engines and a real
``vllm-router`` in front of them. Clients send greedy completions through the router without
pause while updates run, in two modes:

- ``rolling``: ``max_unavailable=1``; one engine leaves the rotation at a time, so the router
  always has a worker;
- ``all_at_once``: both engines leave at once; the router has no worker until they return.

Every update is checked (both engines serve the new generation and their greedy completions
equal transformers' for that checkpoint). Per mode the JSON gives requests per second and
p50/p99 latency before, during and after the updates, failed requests (a 5xx, a timeout, a
connection error), aborted ones (finished with ``finish_reason == "abort"``: a drain cut
them; the client retries them, as documented in ``docs/router.md``), the window clients saw
no service, and update seconds under load against an idle update measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.transports import (
    MODEL,
    BenchInvalid,
    TransportsConfig,
    World,
    checkpoint_bytes,
    checkpoints,
    log,
    terminate_as_exit,
)

BACKOFF_S = 0.05
MODES = {"rolling": 1, "all_at_once": None}
"""Mode name -> ``max_unavailable``."""


@dataclass(frozen=True)
class Sample:
    """One client request: when, how it ended, and who served it."""

    started: float
    ended: float
    outcome: str  # ok | aborted | failed
    status: int | None = None
    generation: int | None = None
    engine: str | None = None
    error: str | None = None

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def classify(response: httpx.Response) -> str:
    """ok, aborted (a drain cut it: retryable) or failed."""
    if response.status_code != 200:
        return "failed"
    try:
        reason = response.json()["choices"][0]["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError):
        return "failed"
    return "aborted" if reason == "abort" else "ok"


class Load:
    """``clients`` threads sending completions to ``url`` until the block ends."""

    def __init__(
        self,
        url: str,
        model: str,
        prompt: Sequence[int],
        *,
        clients: int = 4,
        max_tokens: int = 16,
        timeout_s: float = 60.0,
    ) -> None:
        self.url = url
        self.body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens}
        self.body |= {"temperature": 0, "ignore_eos": True}
        self.clients = clients
        self.timeout_s = timeout_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _client(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    response = client.post(f"{self.url}/v1/completions", json=self.body)
                except httpx.HTTPError as error:
                    sample = Sample(started, time.monotonic(), "failed", error=repr(error))
                else:
                    generation = response.headers.get("x-mooncake-generation")
                    sample = Sample(
                        started,
                        time.monotonic(),
                        classify(response),
                        response.status_code,
                        int(generation) if generation else None,
                        response.headers.get("x-mooncake-engine"),
                        None if response.status_code == 200 else response.text[:200],
                    )
                with self._lock:
                    self.samples.append(sample)
                if sample.outcome != "ok":
                    self._stop.wait(BACKOFF_S)  # a client backs off before it retries

    def __enter__(self) -> Load:
        for index in range(self.clients):
            thread = threading.Thread(target=self._client, name=f"load-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def window(samples: Sequence[Sample], start: float, end: float) -> dict[str, Any]:
    """Requests that ended in [start, end): rate, latency and outcomes."""
    inside = [s for s in samples if start <= s.ended < end]
    ok = sorted(s.seconds for s in inside if s.outcome == "ok")
    span = max(end - start, 1e-9)
    return {
        "seconds": round(span, 3),
        "requests": len(inside),
        "ok_per_second": round(len(ok) / span, 2),
        "p50_s": round(ok[len(ok) // 2], 4) if ok else None,
        "p99_s": round(ok[min(len(ok) - 1, int(0.99 * len(ok)))], 4) if ok else None,
        "aborted": sum(s.outcome == "aborted" for s in inside),
        "failed": sum(s.outcome == "failed" for s in inside),
    }


def unavailable_seconds(samples: Sequence[Sample], spans: Sequence[tuple[float, float]]) -> float:
    """Per update, from the first failed request's start to the last one's end (0 when
    none failed): how long clients saw no service."""
    total = 0.0
    for start, end in spans:
        failed = [s for s in samples if s.outcome == "failed" and start <= s.ended <= end + 1]
        if failed:
            total += max(s.ended for s in failed) - min(s.started for s in failed)
    return round(total, 3)


@dataclass(frozen=True)
class LoadConfig:
    hidden: int = 256
    layers: int = 2
    updates: int = 5
    clients: int = 4
    max_tokens: int = 16
    settle_s: float = 3.0
    modes: tuple[str, ...] = tuple(MODES)
    root: Path | None = None

    def __post_init__(self) -> None:
        unknown = set(self.modes) - set(MODES)
        if unknown or not self.modes:
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {self.modes}")
        if self.updates < 1 or self.clients < 1:
            raise ValueError("updates and clients must be positive")


@dataclass
class ModeRun:
    """What one mode's updates under load measured."""

    spans: list[tuple[float, float]] = field(default_factory=list)
    update_seconds: list[float] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)


class LoadWorld:
    """The transports bench's world (master, holder, two engines) plus a router in front."""

    def __init__(self, root: Path, config: LoadConfig, started: float) -> None:
        self.config = config
        self.started = started
        self.stack = contextlib.ExitStack()
        transports = TransportsConfig(
            hidden=config.hidden,
            layers=config.layers,
            intermediate=2 * config.hidden,
            repeats=config.updates,
            warmup=1,
            batch_bytes=8 << 20,
            root=root,
        )
        self.dirs, self.refs = checkpoints(root, transports, started)
        self.world = self.stack.enter_context(
            World(root, transports, checkpoint_bytes(self.dirs[0])[0])
        )
        self.world.start(self.dirs[0], started)
        self.published = 0

    def __enter__(self) -> LoadWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()

    def start_router(self) -> None:
        from mooncake_rl.coordinator import Coordinator
        from mooncake_rl.router import open_router
        from mooncake_rl.router.launch import RouterProcess

        process = self.stack.enter_context(RouterProcess("vllm", self.world.root / "logs"))
        self.router_url = process.url
        self.router = open_router(process.spec)
        self.stack.callback(self.router.close)
        for url in self.world.urls.values():
            self.router.add(url)
        self.coordinator = self.stack.enter_context(
            Coordinator(self.world.store, list(self.world.urls.values()))
        )
        log(self.started, f"vllm-router at {process.url} with both engines")

    def update(self, max_unavailable: int | None) -> tuple[float, float, int]:
        """Publish the next checkpoint and update through the router; check; return the
        update's start, end and generation."""
        self.published += 1
        index = self.published % len(self.dirs)
        generation = self.world.publish(self.dirs[index])
        start = time.monotonic()
        result = self.coordinator.update(MODEL, router=self.router, max_unavailable=max_unavailable)
        end = time.monotonic()
        problems = [] if result.generation == generation else [f"updated to {result.generation}"]
        problems += [f"{url}: {why}" for url, why in result.rotation.items() if why != "readmitted"]
        problems += self.world.check_serving(generation, self.refs[index])
        if problems:
            raise BenchInvalid(f"update to generation {generation}: " + "; ".join(problems))
        return start, end, generation


def mode_report(samples: Sequence[Sample], run: ModeRun, begun: float, ended: float) -> dict:
    first, last = run.spans[0][0], run.spans[-1][1]
    during = [s for s in samples if any(a <= s.ended < b for a, b in run.spans)]
    updating = max(sum(b - a for a, b in run.spans), 1e-9)
    seen = sorted({s.generation for s in samples if s.generation is not None})
    return {
        "before": window(samples, begun, first),
        "during": {
            **window(during, first, last),
            "seconds": round(updating, 3),
            "ok_per_second": round(sum(s.outcome == "ok" for s in during) / updating, 2),
        },
        "after": window(samples, last, ended),
        "requests": len(samples),
        "failed": sum(s.outcome == "failed" for s in samples),
        "aborted": sum(s.outcome == "aborted" for s in samples),
        "failures": sorted({s.error or str(s.status) for s in samples if s.outcome == "failed"})[
            :5
        ],
        "unavailable_seconds": unavailable_seconds(samples, run.spans),
        "update_seconds": {
            "median": round(statistics.median(run.update_seconds), 3),
            "max": round(max(run.update_seconds), 3),
        },
        "generations": run.generations,
        "generations_in_headers": seen,
    }


def run(config: LoadConfig) -> dict[str, Any]:
    from mooncake_rl.tiny_model import PROMPT

    started = time.monotonic()
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with contextlib.ExitStack() as stack:
        root = config.root or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        world = stack.enter_context(LoadWorld(root, config, started))
        world.start_router()
        model = httpx.get(f"{world.router_url}/v1/models", timeout=30).json()["data"][0]["id"]
        idle = []
        for _ in range(2):  # the first one warms up; the second is the idle figure
            start, end, _ = world.update(MODES["rolling"])
            idle.append(end - start)
        log(started, f"idle rolling update: {idle[-1]:.3f} s")
        modes: dict[str, Any] = {}
        samples_by_mode: dict[str, list[Sample]] = {}
        for name in config.modes:
            run_ = ModeRun()
            load = Load(
                world.router_url,
                model,
                PROMPT,
                clients=config.clients,
                max_tokens=config.max_tokens,
            )
            with load:
                begun = time.monotonic()
                time.sleep(config.settle_s)
                for _ in range(config.updates):
                    start, end, generation = world.update(MODES[name])
                    run_.spans.append((start, end))
                    run_.update_seconds.append(end - start)
                    run_.generations.append(generation)
                    log(started, f"{name}: generation {generation} in {end - start:.3f} s")
                    time.sleep(config.settle_s)
                ended = time.monotonic()
            modes[name] = mode_report(load.samples, run_, begun, ended)
            modes[name]["update_vs_idle"] = round(
                modes[name]["update_seconds"]["median"] / idle[-1], 2
            )
            samples_by_mode[name] = [
                Sample(s.started - begun, s.ended - begun, s.outcome) for s in load.samples
            ]
            modes[name]["spans"] = [
                [round(a - begun, 3), round(b - begun, 3)] for a, b in run_.spans
            ]
    return {
        "bench": "load",
        "date": date,
        "config": {**asdict(config), "root": str(config.root) if config.root else None},
        "machine": {"cpus": os.cpu_count(), "note": "one host, CPU only, TCP loopback"},
        "router": "vllm-router 0.1.17, round_robin",
        "idle_update_seconds": round(idle[-1], 3),
        "modes": modes,
        "wall_seconds": round(time.monotonic() - started, 1),
        "_samples": {k: [asdict(s) for s in v] for k, v in samples_by_mode.items()},
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-rl bench load", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--updates", type=int, default=5, help="updates per mode")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--out", type=Path, default=Path("out/bench-load.png"))
    parser.add_argument("--root", type=Path, help="keep checkpoints and logs here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from bench.plot import plot_load

    args = parser().parse_args(argv)
    config = LoadConfig(
        hidden=args.hidden,
        layers=args.layers,
        updates=args.updates,
        clients=args.clients,
        max_tokens=args.max_tokens,
        modes=tuple(args.modes),
        root=args.root,
    )
    try:
        with terminate_as_exit():
            result = run(config)
    except BenchInvalid as error:
        print(f"bench load: no figures: {error}", file=sys.stderr)
        return 1
    samples = result.pop("_samples")
    result["plot"] = str(plot_load(result, samples, args.out))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
