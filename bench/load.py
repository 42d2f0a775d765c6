"""Updates under live streaming traffic through a real router (``mooncake-rl bench load``).

Starts a real ``mooncake_master``, a segment holder, two real vLLM CPU engines and a real
``vllm-router`` in front of them. Clients stream greedy completions through the router
without pause (each client sends the next request when the last one ended) while updates
run, for every rotation mode and every drain mode asked for:

- rotation ``rolling``: ``max_unavailable=1``; one engine leaves the rotation at a time, so
  the router always has a worker; ``all_at_once``: both engines leave at once, so the router
  has no worker while they land;
- drain ``abort``, ``wait`` or ``keep`` (``Coordinator.update(drain_mode=...)``): how an
  engine pauses to land at commit. Engines serve while the bytes move (prepare, apply); a
  router takes an engine out of rotation only around its landing.

Every update is checked (both engines serve the new generation and their greedy completions
equal transformers' for that checkpoint). Per rotation and drain mode the JSON gives, per
update and summarised: the pause, the landing, the update's seconds, requests aborted, failed
and kept; and requests per second and p50/p99 latency before, during and after the updates.

Definitions (the pure functions below compute them; ``tests/test_bench_load.py`` checks them):

- **request events**: a streaming request's events are the instant it was sent, the arrival
  of each streamed chunk that carries a choice (vLLM streams one per decode step: one output
  token), and the instant its stream ended.
- **pause** of an update that ran over ``[U0, U1]`` (``Coordinator.update`` called and
  returned): over every request that streamed at least one token (ok or aborted), each gap
  ``[a, b]`` between two consecutive events of the request that touches the window
  (``a < U1`` and ``b > U0``) counts ``b - max(a, U0)``: a stall that began before the update
  counts from the update's start, one that lasted past its end counts in full (the token the
  landing held back arrives after the coordinator returned). The update's pause is the
  longest such stall (0 when no request touched the window); failed requests (no token) are
  counted under ``failed``, not here.
- **landing** of an update: per engine, the parts its commit reported
  (``UpdateResult.landing``: ``pause_s`` + ``land_and_check_s`` + ``reset_cache_s`` +
  ``weight_version_s`` + ``resume_s``), the maximum over engines; beside it the
  coordinator's commit phase (``phase_seconds["commit"]``: both waves of a rolling update,
  the router's bracket included).
- **kept**: a request in flight when its engine paused that finished normally afterwards.
  The bench records when each engine left the router's rotation (``out``) and when it was
  re-admitted (``in``); its landing ran between the two. A request is kept when it finished
  ok, was served by that engine (``x-mooncake-engine``), was sent before ``out``, and ended
  after the middle of the engine's landing proper, estimated back from ``in``: ``in -
  resume_s - (land_and_check_s + reset_cache_s + weight_version_s) / 2`` (the estimate is
  late by the commit reply's trip and the re-admission's start, milliseconds). ``abort``
  ends such requests as aborted; ``wait`` finishes them before the landing (not kept);
  ``keep`` freezes them and resumes them on the new weights (kept).
- **aborted**: finished with ``finish_reason == "abort"`` (a drain cut it; the client
  retries, as documented in ``docs/router.md``); **failed**: a non-200 reply, a timeout, a
  connection error, or a stream that ended without a finish reason.

Baselines from the same run: an idle update (no traffic) per rotation mode, and the longest
gap wholly inside the settle window before each run's first update (no update running).
``goals`` checks the issue's target for ``keep``: every update's pause at most its landing
+ 0.2 s, no aborted and no failed request; ``premise`` says whether prepare + apply took a
measurable share (at least 25 %) of the update, which a big enough model (``--hidden``,
``--layers``) ensures.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import cpu_model
from bench.transports import (
    MODEL,
    BenchInvalid,
    TransportsConfig,
    World,
    checkpoint_bytes,
    checkpoints,
    landing_seconds,
    log,
    terminate_as_exit,
)

BACKOFF_S = 0.05
MODES = {"rolling": 1, "all_at_once": None}
"""Rotation mode name -> ``max_unavailable``."""
DRAINS = ("abort", "wait", "keep")
PAUSE_SLACK_S = 0.2
"""The issue's goal: under ``keep`` the pause is at most the landing + this."""
MEASURABLE_SHARE = 0.25
"""Prepare + apply at least this share of the update: the transfer is measurable."""


@dataclass(frozen=True)
class Sample:
    """One client request: when, how it ended, who served it, when its tokens arrived."""

    started: float
    ended: float
    outcome: str  # ok | aborted | failed
    status: int | None = None
    generation: int | None = None
    engine: str | None = None
    error: str | None = None
    tokens: tuple[float, ...] = ()

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    def events(self) -> list[float]:
        """Sent, each token's arrival, stream end."""
        return [self.started, *self.tokens, self.ended]

    def shifted(self, origin: float) -> Sample:
        return Sample(
            self.started - origin,
            self.ended - origin,
            self.outcome,
            self.status,
            self.generation,
            self.engine,
            self.error,
            tuple(t - origin for t in self.tokens),
        )


def outcome_of(status: int | None, finish_reason: str | None, error: str | None) -> str:
    """ok, aborted (a drain cut it: retryable) or failed."""
    if status != 200 or error is not None or finish_reason is None:
        return "failed"
    return "aborted" if finish_reason == "abort" else "ok"


def chunk_of(line: str) -> dict[str, Any] | None:
    """The JSON of one ``data:`` line of a server-sent event stream; ``None`` for anything
    else (blank lines, comments, ``[DONE]``)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    chunk = json.loads(data)
    return chunk if isinstance(chunk, dict) else None


class Load:
    """``clients`` threads streaming completions from ``url`` until the block ends."""

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
        self.body |= {"temperature": 0, "ignore_eos": True, "stream": True}
        self.clients = clients
        self.timeout_s = timeout_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def request(self, client: httpx.Client) -> Sample:
        """Stream one completion; every token's arrival time."""
        started = time.monotonic()
        tokens: list[float] = []
        reason: str | None = None
        status = generation = engine = error = None
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=self.body) as reply:
                status = reply.status_code
                header = reply.headers.get("x-mooncake-generation")
                generation = int(header) if header else None
                engine = reply.headers.get("x-mooncake-engine")
                if status != 200:
                    error = reply.read().decode(errors="replace")[:200]
                else:
                    for line in reply.iter_lines():
                        chunk = chunk_of(line)
                        if chunk is None:
                            continue
                        if "error" in chunk:
                            error = str(chunk["error"])[:200]
                            break
                        choices = chunk.get("choices") or []
                        if choices:
                            tokens.append(time.monotonic())
                            reason = choices[0].get("finish_reason") or reason
        except (httpx.HTTPError, ValueError) as failure:
            error = repr(failure)[:200]
        return Sample(
            started,
            time.monotonic(),
            outcome_of(status, reason, error),
            status,
            generation,
            engine,
            error,
            tuple(tokens),
        )

    def _client(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                sample = self.request(client)
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


# -- pure parts (tests/test_bench_load.py) ----------------------------------------------------
def longest_stall(samples: Iterable[Sample], start: float, end: float) -> float:
    """The pause of an update over ``[start, end]`` (see the module doc): the longest gap
    between consecutive events of a request that streamed a token, the part before
    ``start`` left out; 0 when no such gap touches the window."""
    longest = 0.0
    for sample in samples:
        if not sample.tokens:
            continue
        events = sample.events()
        for a, b in itertools.pairwise(events):
            if a < end and b > start:
                longest = max(longest, b - max(a, start))
    return longest


def longest_gap_within(samples: Iterable[Sample], start: float, end: float) -> float:
    """The longest gap between consecutive events of a request that streamed a token, the
    gap wholly inside ``[start, end]``: the stall clients see with no update running."""
    return max(
        (
            b - a
            for s in samples
            if s.tokens
            for a, b in itertools.pairwise(s.events())
            if start <= a and b <= end
        ),
        default=0.0,
    )


def landing_mark(readmitted: float, parts: Mapping[str, float]) -> float:
    """The middle of an engine's landing proper (landed, checked, caches dropped, version
    tagged), estimated back from its re-admission to the router."""
    proper = sum(
        parts.get(p, 0.0) for p in ("land_and_check_s", "reset_cache_s", "weight_version_s")
    )
    return readmitted - parts.get("resume_s", 0.0) - proper / 2


@dataclass(frozen=True)
class EngineLanding:
    """One engine's landing in one update, as the router and its commit saw it."""

    engine: str  # engine_id, as ``x-mooncake-engine`` names it
    out: float  # left the rotation
    mark: float  # the middle of its landing proper (landing_mark)


def kept(samples: Iterable[Sample], landings: Sequence[EngineLanding]) -> int:
    """Requests that finished ok, were sent before their engine left rotation and ended
    after the middle of its landing: in flight when it paused, resumed afterwards."""
    return sum(
        any(
            s.outcome == "ok"
            and s.engine == w.engine
            and s.started < w.out
            and s.ended > max(w.out, w.mark)
            for w in landings
        )
        for s in samples
    )


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


def summary(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None}
    return {"median": round(statistics.median(values), 4), "max": round(max(values), 4)}


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return round(value / base, 3)


def keep_goals(run: Mapping[str, Any]) -> dict[str, Any]:
    """The issue's checks on one ``keep`` run's report."""
    over = [u["pause_s"] - u["landing_s"] for u in run["per_update"]]
    shares = [u["prepare_apply_share"] for u in run["per_update"]]
    checks = {
        "pause_within_landing_plus_0_2_s": all(x <= PAUSE_SLACK_S for x in over),
        "no_aborted": run["aborted"] == 0,
        "no_failed": run["failed"] == 0,
    }
    return {
        **checks,
        "met": all(checks.values()),
        "max_pause_minus_landing_s": round(max(over), 4) if over else None,
        "aborted": run["aborted"],
        "failed": run["failed"],
        "premise": {
            "prepare_apply_share_median": round(statistics.median(shares), 3) if shares else None,
            "transfer_measurable": bool(shares) and statistics.median(shares) >= MEASURABLE_SHARE,
        },
    }


# -- the run ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadConfig:
    hidden: int = 256
    layers: int = 2
    updates: int = 5
    clients: int = 4
    max_tokens: int = 64
    settle_s: float = 3.0
    modes: tuple[str, ...] = tuple(MODES)
    drains: tuple[str, ...] = DRAINS
    root: Path | None = None

    def __post_init__(self) -> None:
        unknown = set(self.modes) - set(MODES)
        if unknown or not self.modes:
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {self.modes}")
        if set(self.drains) - set(DRAINS) or not self.drains:
            raise ValueError(f"drains must be among {', '.join(DRAINS)}, got {self.drains}")
        if self.updates < 1 or self.clients < 1:
            raise ValueError("updates and clients must be positive")


class RecordingRouter:
    """The router, with when each engine left the rotation and came back."""

    def __init__(self, router: Any) -> None:
        self._router = router
        self.out: dict[str, list[float]] = {}
        self.back: dict[str, list[float]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._router, name)

    def remove(self, engine: str) -> None:
        from mooncake_rl.router.adapters import engine_url

        self._router.remove(engine)
        self.out.setdefault(engine_url(engine), []).append(time.monotonic())

    def add(self, engine: str) -> None:
        from mooncake_rl.router.adapters import engine_url

        self.back.setdefault(engine_url(engine), []).append(time.monotonic())
        self._router.add(engine)


@dataclass
class Update:
    """One checked update under load."""

    generation: int
    start: float
    end: float
    result: Any  # UpdateResult
    landings: list[EngineLanding] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.end - self.start


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
        self.model_bytes = checkpoint_bytes(self.dirs[0])[0]
        self.world = self.stack.enter_context(World(root, transports, self.model_bytes))
        self.world.start(self.dirs[0], started)
        self.published = 0
        self.engine_ids = {
            url: engine.mooncake("GET", "status").json()["engine_id"]
            for url, engine in ((e.url, e) for e in self.world.engines.values())
        }

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
        router = open_router(process.spec)
        self.stack.callback(router.close)
        for url in self.world.urls.values():
            router.add(url)
        self.router = RecordingRouter(router)
        self.coordinator = self.stack.enter_context(
            Coordinator(self.world.store, list(self.world.urls.values()))
        )
        log(self.started, f"vllm-router at {process.url} with both engines")

    def update(self, max_unavailable: int | None, drain: str) -> Update:
        """Publish the next checkpoint and update through the router; check; return it."""
        from mooncake_rl.router.adapters import engine_url

        self.published += 1
        index = self.published % len(self.dirs)
        generation = self.world.publish(self.dirs[index])
        start = time.monotonic()
        result = self.coordinator.update(
            MODEL, router=self.router, max_unavailable=max_unavailable, drain_mode=drain
        )
        end = time.monotonic()
        problems = [] if result.generation == generation else [f"updated to {result.generation}"]
        problems += [f"{url}: {why}" for url, why in result.rotation.items() if why != "readmitted"]
        problems += self.world.check_serving(generation, self.refs[index])
        if problems:
            raise BenchInvalid(f"update to generation {generation}: " + "; ".join(problems))
        update = Update(generation, start, end, result)
        for url, parts in result.landing.items():
            key = engine_url(url)
            outs = [t for t in self.router.out.get(key, []) if start <= t <= end]
            backs = [t for t in self.router.back.get(key, []) if start <= t <= end]
            if outs and backs:
                update.landings.append(
                    EngineLanding(self.engine_ids[url], outs[-1], landing_mark(backs[-1], parts))
                )
        return update


def update_row(update: Update, samples: Sequence[Sample], origin: float) -> dict[str, Any]:
    """One update's figures (times relative to ``origin``, the load's start)."""
    result = update.result
    phases = result.phase_seconds
    moving = phases.get("prepare", 0.0) + phases.get("apply", 0.0)
    return {
        "generation": update.generation,
        "span": [round(update.start - origin, 3), round(update.end - origin, 3)],
        "update_s": round(update.seconds, 4),
        "pause_s": round(longest_stall(samples, update.start, update.end), 4),
        "landing_s": round(landing_seconds(result.landing), 4),
        "commit_phase_s": round(phases.get("commit", 0.0), 4),
        "prepare_apply_s": round(moving, 4),
        "prepare_apply_share": round(moving / max(update.seconds, 1e-9), 3),
        "phase_seconds": dict(phases),
        "landing": {
            url: {p: round(v, 4) for p, v in parts.items()} for url, parts in result.landing.items()
        },
        "kept": kept(samples, update.landings),
        "store_read_bytes": int(result.store_read_bytes),
        "received_bytes": int(sum(result.received_bytes.values())),
        "staged_bytes": int(result.staged_bytes),
    }


def run_report(
    samples: Sequence[Sample],
    updates: Sequence[Update],
    begun: float,
    ended: float,
    idle: Mapping[str, Any],
) -> dict[str, Any]:
    """One rotation and drain mode's figures."""
    spans = [(u.start, u.end) for u in updates]
    first, last = spans[0][0], spans[-1][1]
    during = [s for s in samples if any(a <= s.ended < b for a, b in spans)]
    updating = max(sum(b - a for a, b in spans), 1e-9)
    seen = sorted({s.generation for s in samples if s.generation is not None})
    rows = [update_row(u, samples, begun) for u in updates]
    steady = longest_gap_within(samples, begun, first)
    report = {
        "before": window(samples, begun, first),
        "during": {
            **window(during, first, last),
            "seconds": round(updating, 3),
            "ok_per_second": round(sum(s.outcome == "ok" for s in during) / updating, 2),
        },
        "after": window(samples, last, ended),
        "requests": len(samples),
        "streamed_tokens": sum(len(s.tokens) for s in samples),
        "failed": sum(s.outcome == "failed" for s in samples),
        "aborted": sum(s.outcome == "aborted" for s in samples),
        "kept": sum(r["kept"] for r in rows),
        "failures": sorted({s.error or str(s.status) for s in samples if s.outcome == "failed"})[
            :5
        ],
        "unavailable_seconds": unavailable_seconds(samples, spans),
        "pause_s": summary([r["pause_s"] for r in rows]),
        "landing_s": summary([r["landing_s"] for r in rows]),
        "commit_phase_s": summary([r["commit_phase_s"] for r in rows]),
        "update_seconds": summary([r["update_s"] for r in rows]),
        "steady_stall_s": round(steady, 4),
        "bytes": {
            "store_read_bytes": int(statistics.median(r["store_read_bytes"] for r in rows)),
            "received_bytes": int(statistics.median(r["received_bytes"] for r in rows)),
        },
        "per_update": rows,
        "generations": [u.generation for u in updates],
        "generations_in_headers": seen,
        "spans": [r["span"] for r in rows],
    }
    report["vs_idle"] = {
        "update_seconds": ratio(report["update_seconds"]["median"], idle["update_s"]),
        "landing_s": ratio(report["landing_s"]["median"], idle["landing_s"]),
        "pause_over_landing": ratio(report["pause_s"]["median"], report["landing_s"]["median"]),
        "pause_over_steady_stall": ratio(report["pause_s"]["median"], steady or None),
    }
    return report


def run(config: LoadConfig) -> dict[str, Any]:
    from mooncake_rl.tiny_model import PROMPT

    started = time.monotonic()
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with contextlib.ExitStack() as stack:
        root = config.root or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        world = stack.enter_context(LoadWorld(root, config, started))
        world.start_router()
        model = httpx.get(f"{world.router_url}/v1/models", timeout=30).json()["data"][0]["id"]
        world.update(MODES["rolling"], config.drains[0])  # warms up plans and caches
        idle: dict[str, dict[str, Any]] = {}
        for mode in config.modes:
            update = world.update(MODES[mode], config.drains[0])
            idle[mode] = {
                "update_s": round(update.seconds, 4),
                "landing_s": round(landing_seconds(update.result.landing), 4),
                "commit_phase_s": round(update.result.phase_seconds.get("commit", 0.0), 4),
                "phase_seconds": dict(update.result.phase_seconds),
                "store_read_bytes": int(update.result.store_read_bytes),
                "received_bytes": int(sum(update.result.received_bytes.values())),
            }
            log(started, f"idle {mode} update: {update.seconds:.3f} s")
        modes: dict[str, dict[str, Any]] = {}
        samples_by_run: dict[str, list[Sample]] = {}
        for mode in config.modes:
            for drain in config.drains:
                updates: list[Update] = []
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
                        update = world.update(MODES[mode], drain)
                        updates.append(update)
                        log(
                            started,
                            f"{mode}/{drain}: generation {update.generation} in "
                            f"{update.seconds:.3f} s",
                        )
                        time.sleep(config.settle_s)
                    ended = time.monotonic()
                report = run_report(load.samples, updates, begun, ended, idle[mode])
                modes.setdefault(mode, {})[drain] = {"drain": drain, **report}
                samples_by_run[f"{mode}/{drain}"] = [s.shifted(begun) for s in load.samples]
    goals = {mode: keep_goals(runs["keep"]) for mode, runs in modes.items() if "keep" in runs}
    return {
        "bench": "load",
        "date": date,
        "config": {**asdict(config), "root": str(config.root) if config.root else None},
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "note": "one host, CPU only, TCP loopback",
        },
        "router": "vllm-router 0.1.17, round_robin",
        "model_bytes": world.model_bytes,
        "idle": idle,
        "idle_update_seconds": idle[config.modes[0]]["update_s"],
        "modes": modes,
        "goals": {
            **goals,
            "met": bool(goals) and all(g["met"] for g in goals.values()),
            "definition": f"keep: every update's pause_s <= landing_s + {PAUSE_SLACK_S}, 0 "
            "aborted, 0 failed (pause and landing as in bench/load.py's docstring)",
        },
        "wall_seconds": round(time.monotonic() - started, 1),
        "_samples": {k: [asdict(s) for s in v] for k, v in samples_by_run.items()},
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mooncake-rl bench load", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--updates", type=int, default=5, help="updates per mode and drain")
    parser.add_argument("--clients", type=int, default=4, help="concurrent streaming clients")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between updates")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--drain", nargs="+", choices=list(DRAINS), default=list(DRAINS))
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
        settle_s=args.settle,
        modes=tuple(args.modes),
        drains=tuple(args.drain),
        root=args.root,
    )
    try:
        with terminate_as_exit():
            result = run(config)
    except BenchInvalid as error:
        print(f"bench load: no figures: {error}", file=sys.stderr)
        return 1
    samples = result.pop("_samples")
    try:
        result["plot"] = str(plot_load(result, samples, args.out))
    except ValueError as error:  # a bad --out must not cost the run's figures
        result["plot"] = f"not drawn: {error}"
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
