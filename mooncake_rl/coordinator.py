"""Drive engines from one generation to the next over their ``/mooncake/*`` routes.

1. collect placements from every engine; 2. plan once (cached); 3. drain and prepare all;
4. apply all, stage by stage (each stage is a barrier: consumers are passive, so a worker's
bytes have arrived once every worker returned); 5. commit all — only after every apply
succeeded. A prepare failure aborts and resumes every engine on its old generation. A
failure once apply started leaves the engines drained and reports them for rebuild from the
Store; nothing is ever served half-updated.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from mooncake_rl.errors import MooncakeRLError
from mooncake_rl.generations.registry import (
    ActiveRecord,
    GenerationRegistry,
    payload_problems,
    require_active,
)
from mooncake_rl.plan.update import RoutingCache, UpdatePlan, plan_update
from mooncake_rl.store import StoreClient


class EngineRequestFailed(MooncakeRLError):
    def __init__(self, url: str, path: str, status: int, body: Any) -> None:
        self.url, self.path, self.status, self.body = url, path, status, body
        code = body.get("error") if isinstance(body, dict) else None
        detail = body.get("detail") if isinstance(body, dict) else body
        super().__init__(f"{url}{path}: {status} {code}: {detail}")


@dataclass
class UpdateResult:
    model: str
    generation: int
    mode: str
    engines: list[str]
    phase_seconds: dict[str, float] = field(default_factory=dict)
    store_read_bytes: int = 0
    store_reread_bytes: int = 0  # repeated after LEASE_EXPIRED (see StoreClient.read_ranges)
    pushed_bytes: int = 0
    planned_read_bytes: int = 0
    planned_pushed_bytes: int = 0
    unique_demand_bytes: int = 0
    cross_node_pushed_bytes: int = 0
    received_bytes: dict[str, int] = field(default_factory=dict)
    # Of received_bytes, what each worker lands through load_weights (direct mode's fallback)
    fallback_bytes: dict[str, int] = field(default_factory=dict)
    node_nic_bytes: dict[str, int] = field(default_factory=dict)
    # The post-landing check per worker: {"checked", "unchecked", "mismatched", "seconds"}.
    verified: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    rebuild: list[str] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def serves(placement: Mapping[str, Any], record: ActiveRecord) -> bool:
    """The engine already serves exactly this record's generation: the only skip."""
    return (
        placement.get("model") == record.model
        and placement.get("generation") == record.generation
        and placement.get("incarnation") == record.incarnation
    )


def refusal(url: str, placement: Mapping[str, Any], record: ActiveRecord) -> str | None:
    """Why an engine cannot be brought to ``record`` (other model, or ahead of the Store)."""
    if placement.get("model") != record.model:
        return f"{url} serves {placement.get('model')!r}, not {record.model!r}"
    same_store = placement.get("incarnation") == record.incarnation
    if same_store and int(placement.get("fence") or 0) > record.fence:
        return (
            f"{url} serves generation {placement.get('generation')} under active record "
            f"{placement.get('fence')}, newer than the Store's record {record.fence} (generation "
            f"{record.generation}): another coordinator or publish moved on; retry the update"
        )
    return None


class UpdateFailed(MooncakeRLError):
    def __init__(self, result: UpdateResult) -> None:
        self.result = result
        super().__init__(result.error or "update failed")


class Coordinator:
    """An HTTP client over a set of engines, used by the CLI and the VeRL bridge."""

    def __init__(
        self,
        store: StoreClient,
        engines: Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = 600.0,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if not engines:
            raise MooncakeRLError("at least one engine URL is needed")
        self.store = store
        self.engines = [url.rstrip("/") for url in engines]
        # No idle connection is reused: an engine's server closes idle keep-alive connections
        # on its own clock (uvicorn: 5 s), and a request sent as it closes one is reset.
        self._client = httpx.Client(
            timeout=timeout_s,
            headers={"authorization": f"Bearer {token}"} if token else {},
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self._progress = progress or (lambda message: None)
        self.cache = RoutingCache()

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- HTTP ------------------------------------------------------------------------
    def _call(self, url: str, method: str, path: str, body: Any = None) -> dict[str, Any]:
        response = self._client.request(method, f"{url}/mooncake/{path}", json=body)
        try:
            payload = response.json()
        except ValueError:
            payload = response.text
        if response.status_code != 200:
            raise EngineRequestFailed(url, f"/mooncake/{path}", response.status_code, payload)
        return payload

    def _all(
        self, urls: Sequence[str], method: str, path: str, bodies: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, dict[str, Any]], dict[str, EngineRequestFailed]]:
        """The same call on every engine, concurrently; successes and failures by URL."""

        def one(url: str) -> tuple[str, Any]:
            try:
                return url, self._call(url, method, path, None if bodies is None else bodies[url])
            except EngineRequestFailed as error:
                return url, error
            except httpx.HTTPError as error:
                return url, EngineRequestFailed(url, f"/mooncake/{path}", 0, str(error))

        with ThreadPoolExecutor(max_workers=max(1, len(urls))) as pool:
            results = dict(pool.map(one, urls))
        ok = {u: r for u, r in results.items() if not isinstance(r, EngineRequestFailed)}
        failed = {u: r for u, r in results.items() if isinstance(r, EngineRequestFailed)}
        return ok, failed

    def status(self) -> dict[str, dict[str, Any]]:
        ok, failed = self._all(self.engines, "GET", "status")
        return {**ok, **{u: {"error": str(e)} for u, e in failed.items()}}

    # -- the update ------------------------------------------------------------------
    def update(
        self,
        model: str,
        *,
        mode: str = "compat",
        drain_mode: str = "abort",
        batch_bytes: int = 64 << 20,
        direct_fallback: str | None = None,
    ) -> UpdateResult:
        """``direct_fallback``: regex of parameter names direct mode lands through each
        engine's ``load_weights`` (full tensors) instead of its shard discovery."""
        registry = GenerationRegistry(self.store, model)
        record = require_active(self.store, model, "cannot update engines")
        manifest = registry.load_manifest(record.generation, record.manifest_digest)
        # One table load per update; each worker gets the rows of the objects it reads.
        checksums = registry.load_checksums(record.generation, record.checksums_digest)
        result = UpdateResult(model, record.generation, mode, list(self.engines))
        clock = time.perf_counter()

        def phase(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            result.phase_seconds[name] = round(now - clock, 4)
            clock = now
            self._progress(name)

        placements, failed = self._all(self.engines, "GET", "placement")
        if failed:
            result.error = "; ".join(str(e) for e in failed.values())
            raise UpdateFailed(result)
        result.skipped = [u for u in self.engines if serves(placements[u], record)]
        targets = [u for u in self.engines if u not in result.skipped]
        for url in targets:
            problem = refusal(url, placements[url], record)
            if problem:
                result.error = problem
                raise UpdateFailed(result)
        phase("placement")
        if not targets:
            return result
        unreadable = payload_problems(self.store, manifest)
        if unreadable:
            result.error = (
                f"generation {record.generation} of {model} is not fully readable "
                f"({len(unreadable)} object(s): {', '.join(unreadable[:5])}); no engine was "
                "drained. A segment holder was lost: `mooncake-rl status` lists readable "
                "generations, `mooncake-rl activate --generation K` makes one active, or republish"
            )
            raise UpdateFailed(result)
        phase("check")

        engines = {u: placements[u]["workers"] for u in targets}
        plan: UpdatePlan = plan_update(
            manifest, engines, mode, batch_bytes, self.cache, record.layout_digest, direct_fallback
        )
        result.planned_read_bytes = plan.store_read_bytes
        result.planned_pushed_bytes = plan.pushed_bytes
        result.unique_demand_bytes = plan.unique_demand_bytes
        result.cross_node_pushed_bytes = plan.routing.cross_node_pushed_bytes
        result.received_bytes = plan.routing.received_bytes()
        result.fallback_bytes = plan.routing.fallback_bytes()
        result.node_nic_bytes = dict(plan.routing.node_nic_bytes)
        phase("plan")

        _, failed = self._all(targets, "POST", "drain", {u: {"mode": drain_mode} for u in targets})
        if failed:
            self._resume(targets)
            result.error = "drain failed: " + "; ".join(str(e) for e in failed.values())
            raise UpdateFailed(result)
        phase("drain")

        bodies = {
            url: {
                "model": model,
                "generation": record.generation,
                "manifest_digest": record.manifest_digest,
                "fence": record.fence,
                "incarnation": record.incarnation,
                "mode": mode,
                "workers": plan.engine_workers(url, checksums.objects),
            }
            for url in targets
        }
        prepared, failed = self._all(targets, "POST", "prepare", bodies)
        if failed:
            self._all(targets, "POST", "abort")
            self._resume(targets)
            result.error = "prepare failed: " + "; ".join(str(e) for e in failed.values())
            raise UpdateFailed(result)
        peers = {w["worker_id"]: w for p in prepared.values() for w in p["workers"]}
        phase("prepare")

        for stage in range(plan.stages):
            body = {"generation": record.generation, "stage": stage, "peers": peers}
            applied, failed = self._all(targets, "POST", "apply", {u: body for u in targets})
            for reply in applied.values():
                for worker in reply["workers"]:
                    result.store_read_bytes += worker["store_read_bytes"]
                    result.store_reread_bytes += worker.get("store_reread_bytes", 0)
                    result.pushed_bytes += worker["pushed_bytes"]
            if failed:
                self._all(targets, "POST", "abort")
                result.rebuild = list(targets)
                result.error = f"apply stage {stage} failed: " + "; ".join(
                    str(e) for e in failed.values()
                )
                raise UpdateFailed(result)
        phase("apply")

        committed, failed = self._all(
            targets, "POST", "commit", {u: {"generation": record.generation} for u in targets}
        )
        for url, reply in committed.items():
            for rank, worker in enumerate(reply.get("workers", [])):
                result.verified[f"{url}/tp{rank}"] = worker.get("verify", {})
        if failed:
            result.rebuild = sorted(failed)
            result.error = "commit failed: " + "; ".join(str(e) for e in failed.values())
            raise UpdateFailed(result)
        phase("commit")
        return result

    def _resume(self, urls: Sequence[str]) -> None:
        self._all(urls, "POST", "resume")
