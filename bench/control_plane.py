"""The coordinator's control plane against many fake engines on loopback; ONE JSON object.

    python -m bench.control_plane --engines 1000 [--tp 1 --engines-per-node 8 --mode direct]

What runs for real: a Store (embedded master, one segment holder) with a published synthetic
generation; the unmodified :class:`mooncake_rl.coordinator.Coordinator` (placement, payload
check, drain, plan, prepare, renew, apply stages, commit); and on the engine side the
real ``/mooncake/*`` routes (``engine_ext.routes``: every body parsed by the protocol
models) over the real :class:`engine_ext.receiver.Receiver` (sessions, leases, fences, the
state machine) and :class:`engine_ext.backend.WorkerBackend` (rank replies checked and
sequenced). Only the ranks below are fake (:class:`FakeRanks`): they answer with what
``engine_ext.worker.UpdateWorker`` answers, decode their routing slices and count the bytes
a stage would move, but hold no model and move no byte. So the figures are the control
plane's alone: HTTP round trips, body encoding and validation, planning, the Store checks.

All fake engines live in one child process (one event loop, one core: the load on this
shared machine is bounded by it), each on its own loopback port, as a fleet of engines each
with its own URL. The coordinator keeps at most ``--max-connections`` calls in flight at
once, each on its own connection (the ``Coordinator``'s ``max_connections``; default 100,
httpx's default pool; ``0``: unbounded, the ``Coordinator``'s default: every call of a
phase at once). Phase seconds are the coordinator's ``UpdateResult.phase_seconds``;
``request_bytes`` counts what the engines received per route, the measure of where the
control plane stops scaling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.common import specs_of, store_services, synthetic_model
from engine_ext.backend import WorkerBackend
from engine_ext.receiver import Receiver
from engine_ext.served import ServedRecord
from mooncake_rl.apply.wire import WorkerSlice, decode_slice
from mooncake_rl.plan.synthetic import simulated_engines
from mooncake_rl.protocol import DrainRequest, reported_placement, without_boxes

MODEL = "control-plane"
MODES = ("direct", "compat")


@dataclass(frozen=True)
class Config:
    """The fleet and the generation. ``max_connections`` 0: no bound on calls in flight."""

    engines: int = 1000
    tp: int = 1
    engines_per_node: int = 8
    mode: str = "direct"
    model_bytes: int = 8 << 20
    tensors: int = 32
    batch_bytes: int = 64 << 20
    max_connections: int = 100
    session_ttl_s: float = 30.0  # the coordinator renews every engine's lease every third

    def __post_init__(self) -> None:
        for name in ("engines", "tp", "engines_per_node", "model_bytes", "tensors", "batch_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if type(self.max_connections) is not int or self.max_connections < 0:
            raise ValueError("max_connections must be an int >= 0")
        if not 1 <= self.session_ttl_s <= 3600:
            raise ValueError("session_ttl_s must lie in 1..3600 (engines refuse others)")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")

    def workers(self) -> dict[str, list[dict[str, Any]]]:
        """Every engine's ``GET /mooncake/placement`` workers, by engine index (as str)."""
        specs = specs_of(synthetic_model(self.model_bytes, self.tensors))
        shape = [(f"node{i // self.engines_per_node:04d}", self.tp) for i in range(self.engines)]
        described = simulated_engines(specs, shape, self.mode)
        watermark = {"staging_watermark_bytes": 2 * self.batch_bytes, "gpu": None}
        return {
            url.removeprefix("http://engine"): [{**reported_placement(w), **watermark} for w in ws]
            for url, ws in described.items()
        }


class Refused(Exception):
    """A rank refuses a call and changes nothing (the worker's ``RequestRefused``)."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


class FakeRanks(WorkerBackend):
    """One engine's TP ranks, replying as ``UpdateWorker.call`` does; nothing is stored."""

    def __init__(self, engine_id: str, workers: Sequence[Mapping[str, Any]], port: int) -> None:
        self.engine_id = engine_id
        self.workers = [dict(w) for w in workers]
        self.port = port
        self.is_paused = False
        self.slices: dict[str, WorkerSlice] = {}
        self.stage_replies: dict[str, dict[str, Any]] = {}  # what ``collect`` answers
        self.rpc_timeout_s = 60.0

    async def paused(self) -> bool:
        return self.is_paused

    async def pause(self, request: DrainRequest) -> None:
        self.is_paused = True

    async def unpause(self) -> None:
        self.is_paused = False

    async def reset_cache(self) -> None:
        return None

    async def set_weight_version(self, version: str) -> None:
        return None

    async def call_workers(self, method: str, *args: Any) -> list[dict[str, Any]]:
        replies = []
        for rank, worker in enumerate(self.workers):
            try:
                replies.append({"ok": True, "rank": rank, **self._reply(worker, method, *args)})
            except Refused as refused:
                status = {"status": refused.status, "code": refused.code}
                replies.append(
                    {"ok": False, "rank": rank, "refused": status, "error": refused.detail}
                )
        return replies

    def _reply(self, worker: Mapping[str, Any], method: str, *args: Any) -> dict[str, Any]:
        worker_id = worker["worker_id"]
        if method == "describe":  # args: (boxes,)
            return dict(worker) if not args or args[0] else without_boxes(worker)
        if method == "prepare":
            request = args[0]
            self.slices[worker_id] = decode_slice(request["workers"][worker_id]["slice"])
            regions, base = {}, 0
            for name, size in self.slices[worker_id].regions.items():
                regions[name] = {"base": base, "size": size}
                base += size
            return {
                "worker_id": worker_id,
                "node": worker["node"],
                "endpoint": f"127.0.0.1:{self.port}",
                "regions": regions,
                "direct_bytes": base,
                "fallback_bytes": 0,
                "in_place_bytes": 0,
                "staged_bytes": base,
            }
        if method == "apply":
            stages = self.slices[worker_id].stages
            stage = args[0]["stage"]
            batches = stages[stage] if stage < len(stages) else ()
            for op in (p for b in batches for p in b.pushes):
                if op.peer not in args[0]["peers"]:  # as the worker's PeerBook refuses
                    raise Refused(
                        422,
                        "untrusted_peer",
                        f"the stage pushes to {op.peer}, which the apply body's peers do not name",
                    )
            self.stage_replies[worker_id] = {
                "worker_id": worker_id,
                "seconds": 0.0,
                "store_read_bytes": sum(r.length for b in batches for r in b.reads),
                "store_reread_bytes": 0,
                "pushed_bytes": sum(p.length for b in batches for p in b.pushes),
            }
            return {"started": stage}
        if method == "expect":  # nothing landed to check here
            self.stage_replies[worker_id] = {"worker_id": worker_id, "seconds": 0.0}
            return {"started": "expect"}
        if method == "collect":  # the stage ended as it started: nothing moves here
            return self.stage_replies[worker_id]
        if method == "commit":
            self.slices.pop(worker_id, None)
            return {"seconds": 0.0, "land_seconds": 0.0, "verify": {}}
        if method in ("promote", "abort"):
            return {}
        raise ValueError(f"the fake ranks do not serve {method!r}")


class Counted:
    """Pure ASGI: request body bytes per route, served at ``GET /fake/stats``."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/fake/stats":
            body = json.dumps({"request_bytes": self.bytes, "calls": self.calls}).encode()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] == "http":
            route = scope["path"].rsplit("/", 1)[-1]
            length = dict(scope["headers"]).get(b"content-length", b"0")
            self.bytes[route] += int(length)
            self.calls[route] += 1
        await self.app(scope, receive, send)


def serve(config: Config) -> None:
    """The child: every fake engine on its own loopback port; prints the ports, serves."""
    import uvicorn
    from fastapi import FastAPI, Request

    from engine_ext.routes import build_router

    described = config.workers()
    sockets = [socket.create_server(("127.0.0.1", 0), backlog=4096) for _ in described]
    ports = [s.getsockname()[1] for s in sockets]
    receivers = {
        port: Receiver(FakeRanks(f"fake{index}", described[index], port), MODEL, ServedRecord())
        for index, port in zip(described, ports, strict=True)
    }

    async def receiver_of(request: Request) -> Receiver:
        return receivers[request.scope["server"][1]]

    app = FastAPI()
    app.include_router(build_router(receiver_of, None, max_body_bytes=1 << 30))
    server = uvicorn.Server(
        uvicorn.Config(Counted(app), log_level="warning", access_log=False, lifespan="off")
    )
    print(json.dumps({"ports": ports}), flush=True)
    asyncio.run(server.serve(sockets=sockets))


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(x for x in status if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/PID/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(config: Config) -> dict[str, Any]:
    """Publish, start the fleet, run one update through the real Coordinator."""
    import httpx

    from mooncake_rl.coordinator import Coordinator, UpdateFailed
    from mooncake_rl.generations.publisher import publish_local
    from mooncake_rl.store import StoreClient

    started = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.control_plane", "--serve", json.dumps(asdict(config))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with store_services(256 << 20) as (_, _, settings), StoreClient(settings) as store:
            model = synthetic_model(config.model_bytes, config.tensors)
            publish_local(store, MODEL, model, dtype="bfloat16")
            assert child.stdout is not None
            ports = json.loads(child.stdout.readline())["ports"]
            setup = time.perf_counter() - started
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            with Coordinator(
                store,
                urls,
                holder="bench.control_plane",
                session_ttl_s=config.session_ttl_s,
                max_connections=config.max_connections or None,
            ) as coordinator:
                t0 = time.perf_counter()
                coordinator.status()  # the floor: one GET on every engine, nothing else
                status_round = time.perf_counter() - t0
                t0, c0, e0 = time.perf_counter(), time.process_time(), _cpu_seconds(child.pid)
                try:
                    result = coordinator.update(
                        MODEL, mode=config.mode, batch_bytes=config.batch_bytes
                    )
                except UpdateFailed as failed:  # reported, with the phases that ran
                    result = failed.result
                seconds = time.perf_counter() - t0
                cpu, engines_cpu = time.process_time() - c0, _cpu_seconds(child.pid) - e0
                statuses = coordinator.status()
            stats = httpx.get(f"{urls[0]}/fake/stats").json()
        server_rss = _peak_rss_bytes(child.pid)
    finally:
        child.terminate()
        child.wait(timeout=30)
    phases = result.phase_seconds
    return {
        "bench": "control_plane",
        "config": asdict(config),
        "workers": config.engines * config.tp,
        "nodes": -(-config.engines // config.engines_per_node),
        "update_seconds": round(seconds, 3),
        "phase_seconds": phases,
        "control_seconds": round(sum(v for k, v in phases.items() if k != "plan"), 3),
        "status_round_seconds": round(status_round, 3),
        "committed": len(result.committed),
        "failed": len(result.failed),
        "error": result.error and result.error[:500],
        "failure_codes": Counter(result.failure_codes.values()),
        "serving_generation": Counter(s.get("generation") for s in statuses.values()),
        "store_read_bytes": result.store_read_bytes,
        "planned_read_bytes": result.planned_read_bytes,
        "pushed_bytes": result.pushed_bytes,
        "planned_pushed_bytes": result.planned_pushed_bytes,
        "request_bytes": stats["request_bytes"],
        "calls": stats["calls"],
        "setup_seconds": round(setup, 2),
        "coordinator_cpu_seconds": round(cpu, 2),
        "engines_cpu_seconds": round(engines_cpu, 2),
        "coordinator_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "engines_peak_rss_bytes": server_rss,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=d.engines)
    p.add_argument("--tp", type=int, default=d.tp, help="ranks (workers) per engine")
    p.add_argument("--engines-per-node", type=int, default=d.engines_per_node)
    p.add_argument("--mode", choices=MODES, default=d.mode)
    p.add_argument("--model-bytes", type=int, default=d.model_bytes)
    p.add_argument("--tensors", type=int, default=d.tensors)
    p.add_argument("--batch-bytes", type=int, default=d.batch_bytes)
    p.add_argument("--max-connections", type=int, default=d.max_connections)
    p.add_argument("--session-ttl", type=float, default=d.session_ttl_s)
    p.add_argument("--serve", help=argparse.SUPPRESS)  # the child: the fake engines
    args = p.parse_args(argv)
    if args.serve:
        serve(Config(**json.loads(args.serve)))
        return 0
    config = Config(
        engines=args.engines,
        tp=args.tp,
        engines_per_node=args.engines_per_node,
        mode=args.mode,
        model_bytes=args.model_bytes,
        tensors=args.tensors,
        batch_bytes=args.batch_bytes,
        max_connections=args.max_connections,
        session_ttl_s=args.session_ttl,
    )
    print(json.dumps(run(config)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
