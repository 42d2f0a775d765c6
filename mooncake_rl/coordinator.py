"""Drive engines from one generation to the next over their ``/mooncake/*`` routes.

1. collect placements; 2. check every object the plan reads, plan and encode each engine's
prepare slices, before any engine drains or leaves a router's rotation (engines serve while
a cold plan runs and its slices are encoded: seconds each for a 1T MoE); 3. open one
update session on every engine (drain), renewed in the background; 4. prepare (re-planned
around engines that did not drain); 5. apply stage by stage (each stage is a barrier:
consumers are passive, so a worker's bytes have arrived once every worker returned);
6. commit, only after every apply succeeded.

Engines serve through steps 3-5: they stage beside their live weights and pause (the drain
mode: abort, wait or keep) only to land at commit, and a router takes them out of rotation
for that landing alone. Direct mode receiving in place is the exception: those engines
pause at prepare, and leave the rotation before the drain.

With ``transport`` other than ``store`` (:mod:`mooncake_rl.transport`), engines are
classified by GPU topology before step 3, and steps 4-5 deliver full tensors by broadcast
or CPU buckets (:mod:`mooncake_rl.transport.legs`); sessions, drain and commit are the same.

Failures never leave an engine half-updated or paused:

- Engines that fail to drain or prepare are released and reported; the update goes on with
  the rest while at least ``min_engines`` can end on the new generation, re-planned around
  the missing ones (a reader that died takes its pushes with it). A prepared engine that
  stops answering before apply is re-planned around the same way.
- An apply failure aborts every engine: an engine that staged every byte serves its old
  generation again; one that received into live parameters (direct mode, in place)
  rebuilds itself from the Store's active generation and is reported in ``rebuild``.
- Commit and abort are idempotent per session and retried when a response is lost.
- If this process dies, each engine's session lease expires and the engine goes back to
  serving by itself; a rival coordinator's calls carry another session and are refused.
  Drain takes the engines in URL order, first one alone, so two rivals meet on the first
  engine and the loser holds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import aiohttp.helpers
import httpx
from yarl import URL

from mooncake_rl.errors import ConfigurationError, InvariantViolation, MooncakeRLError
from mooncake_rl.generations.checksums import ChecksumTable
from mooncake_rl.generations.registry import (
    ActiveRecord,
    GenerationRegistry,
    payload_problems,
    require_active,
)
from mooncake_rl.plan.params import PULLS
from mooncake_rl.plan.planner import planning_mode
from mooncake_rl.plan.update import (
    RoutingCache,
    UpdatePlan,
    encode_workers,
    plan_update,
    require_staging,
)
from mooncake_rl.protocol import MAX_TTL_S
from mooncake_rl.router.adapters import Router
from mooncake_rl.router.probe import require_compatible, waves
from mooncake_rl.router.rotation import Rotation
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.legs import LegFailed, LegFigures, TransportLegs
from mooncake_rl.transport.modes import (
    TransportMode,
    parse_gpu_ids,
    require_store_path,
    resolve_mode,
)
from mooncake_rl.transport.sender import ChildLauncher, SenderLauncher
from mooncake_rl.transport.topology import (
    Classification,
    classify,
    require_mixed,
    require_mixed_ran,
)

P = TypeVar("P")
T = TypeVar("T")
RETRIES = 4
"""Attempts at an idempotent call (commit, abort, renew) whose response never came."""
RETRY_WAIT_S = 0.5
BARE_PLACEMENT = "placement?boxes=false"
"""Placements without boxes (``protocol.BOXES``): what an update reads first."""
ADVERTISED = ("worker_id", "node", "endpoint", "regions")
"""The fields of a prepare reply's worker that peers write by (the apply body's peers)."""


class EngineRequestFailed(MooncakeRLError):
    def __init__(self, url: str, path: str, status: int, body: Any) -> None:
        self.url, self.path, self.status, self.body = url, path, status, body
        code = body.get("error") if isinstance(body, dict) else None
        self.code = code
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
    # Of received_bytes (all engines): bytes received straight into live parameters, and
    # bytes received into staging and landed at commit (every byte in compat mode).
    in_place_bytes: int = 0
    staged_bytes: int = 0
    # Per engine, each worker's staging place as its prepare chose it
    # (``engine_ext.staging.StagingPlace``: device or host, and why).
    staging: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    node_nic_bytes: dict[str, int] = field(default_factory=dict)
    # The post-landing check per worker: {"checked", "unchecked", "mismatched", "seconds"}.
    verified: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)
    # Engines left out, and why; each serves its old generation (or rebuilds itself).
    failed: dict[str, str] = field(default_factory=dict)
    # The same engines' error codes: the engine's ``error``; ``unreachable`` when no reply
    # came, ``http_<status>`` for a reply without one, ``delivery_failed`` for a lost leg.
    failure_codes: dict[str, str] = field(default_factory=dict)
    # Engines that rebuild themselves from the Store's active generation: their commit
    # failed, or their update ended otherwise after receiving into live parameters.
    rebuild: list[str] = field(default_factory=list)
    session: str | None = None
    # The transport mode, and per engine its transport, the bytes its ranks received and
    # the seconds its delivery took.
    transport: str = TransportMode.STORE.value
    # How the Store was read: once for the fleet ("single") or once per rollout node
    # ("node": store_read_bytes is then unique_demand_bytes times the consuming nodes).
    pull: str = "single"
    # How the engines paused to land: "abort" in-flight requests, "wait" for them to end,
    # or "keep" them (frozen, then resumed on the new weights).
    drain_mode: str = "abort"
    # Per engine, its pause to land and the landing's parts (seconds): ``pause_s`` (the
    # drain mode's pause), ``land_and_check_s`` (of it, the slowest rank's ``land_s``, the
    # engine's reload, and ``check_s``, the post-landing check), ``reset_cache_s``,
    # ``weight_version_s``, ``resume_s``.
    landing: dict[str, dict[str, float]] = field(default_factory=dict)
    legs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # With a router: per engine taken out, "readmitted", "retired" (removed meanwhile, so
    # not re-added) or "failed: <why>" (still out of rotation).
    rotation: dict[str, str] = field(default_factory=dict)
    waves: int = 0
    # Engines whose boxes this update read (``GET /mooncake/placement`` in full): none when
    # the coordinator held the plan for what every worker reported without them.
    described: list[str] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def absorb(self, wave: UpdateResult) -> None:
        """Add one wave of a rolling update (same model and generation) to this result."""
        self.waves += 1
        for name, seconds in wave.phase_seconds.items():
            self.phase_seconds[name] = round(self.phase_seconds.get(name, 0.0) + seconds, 4)
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(wave, name))
        for name in _MERGED:
            getattr(self, name).update(getattr(wave, name))
        for name in ("skipped", "committed", "rebuild", "described"):
            getattr(self, name).extend(getattr(wave, name))
        self.session = wave.session or self.session
        self.error = wave.error or self.error


_SUMMED = (
    "store_read_bytes",
    "store_reread_bytes",
    "pushed_bytes",
    "planned_read_bytes",
    "planned_pushed_bytes",
    "unique_demand_bytes",
    "cross_node_pushed_bytes",
    "in_place_bytes",
    "staged_bytes",
)
_MERGED = (
    "received_bytes",
    "fallback_bytes",
    "node_nic_bytes",
    "verified",
    "failed",
    "failure_codes",
    "legs",
    "rotation",
    "landing",
    "staging",
)


@dataclass(frozen=True)
class _Options:
    """What every wave of one update shares."""

    mode: str
    drain_mode: str
    batch_bytes: int
    direct_fallback: str | None
    transport: TransportMode
    train_pool: Sequence[str] | None
    sender: SenderLauncher | None
    in_place: bool = True
    pull: str = "single"

    @property
    def pauses_at_prepare(self) -> bool:
        """Direct mode receiving in place: peers write live weights from the first stage,
        so engines pause at prepare, not just to land."""
        return self.mode == "direct" and self.in_place


Bracket = Callable[[Sequence[str], Callable[[], UpdateResult]], UpdateResult]
"""Runs a step with these engines out of a router's rotation (:meth:`Coordinator.bracketed`)."""


def _unbracketed(engines: Sequence[str], step: Callable[[], UpdateResult]) -> UpdateResult:
    return step()


class _Phases:
    """Seconds per update phase, into ``result.phase_seconds``. A phase met twice adds up:
    the plan is made before the drain and bound again (or re-planned) after it."""

    def __init__(self, result: UpdateResult, progress: Callable[[str], None]) -> None:
        self.result, self.progress = result, progress
        self.clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        seconds = self.result.phase_seconds.get(name, 0.0) + now - self.clock
        self.result.phase_seconds[name] = round(seconds, 4)
        self.clock = now
        self.progress(name)

    def restart(self) -> None:
        self.clock = time.perf_counter()


@dataclass
class _Survey:
    """What one wave learnt before touching any engine (:meth:`Coordinator._survey`)."""

    result: UpdateResult
    phase: _Phases
    checksums: ChecksumTable
    placements: dict[str, dict[str, Any]]
    targets: list[str]
    classification: Classification
    mixed: bool
    # The Store transport: its planner for a set of engines, and the plan for every target.
    plan_for: Callable[[Sequence[str]], UpdatePlan] | None = None
    planned: UpdatePlan | None = None
    # Each target's prepare-body ``workers`` under ``planned``, encoded before the drain.
    encoded: dict[str, bytes] = field(default_factory=dict)

    def plan(self, urls: Sequence[str]) -> UpdatePlan:
        """The plan for ``urls``: the one made before the drain when every target drained,
        else a new one (a miss: the topology changed)."""
        assert self.plan_for is not None and self.planned is not None
        return self.planned if list(urls) == self.targets else self.plan_for(urls)

    def workers(self, url: str, plan: UpdatePlan) -> bytes:
        """``url``'s prepare-body ``workers`` under ``plan``: encoded before the drain when
        ``plan`` is the one made then, else now (a re-plan after an engine failed)."""
        if plan is self.planned and url in self.encoded:
            return self.encoded[url]
        return encode_workers(plan.engine_workers(url, self.checksums.objects))


def serves(placement: Mapping[str, Any], record: ActiveRecord) -> bool:
    """The engine already serves exactly this record's generation: the only skip."""
    return (
        placement.get("model") == record.model
        and placement.get("generation") == record.generation
        and placement.get("incarnation") == record.incarnation
    )


def target_of(record: ActiveRecord) -> dict[str, Any]:
    """The record an update brings, as its drains and prepares name it."""
    return {
        "model": record.model,
        "generation": record.generation,
        "fence": record.fence,
        "incarnation": record.incarnation,
    }


def refusal(
    url: str, placement: Mapping[str, Any], record: ActiveRecord, drain_mode: str
) -> str | None:
    """Why an engine cannot be brought to ``record`` (other model, ahead of the Store, or
    no such pause mode)."""
    modes = placement.get("pause_modes", ("abort", "wait"))  # plugins before keep mode
    if drain_mode not in modes:
        return (
            f"{url} runs {placement.get('engine_version', 'an engine')}, which pauses only "
            f"with {', '.join(modes)}, not {drain_mode!r}: use --drain abort or wait, or "
            "upgrade the engine"
        )
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


class ReadmitFailed(MooncakeRLError):
    """The engines synced, but some could not be put back in the router's rotation: they
    serve the new generation and receive no traffic until re-added (``mooncake-rl router
    add``)."""

    def __init__(self, result: UpdateResult, stuck: Mapping[str, str]) -> None:
        self.result = result
        self.stuck = dict(stuck)
        result.error = "synced but out of rotation: " + "; ".join(
            f"{url}: {why}" for url, why in sorted(stuck.items())
        )
        super().__init__(result.error)


class Coordinator:
    """An HTTP client over a set of engines, used by the CLI and the VeRL bridge.

    Its methods are synchronous; every HTTP call runs on one event loop of its own (a
    daemon thread) through aiohttp, so a phase has all its calls in flight at once without
    a thread per call. At 1,000 engines the calls' client CPU is the control plane's cost:
    aiohttp spends less per call than httpx's clients, sync (a thread per call, all queued
    on its pool's lock) or async (its pool rescans every connection on each request).
    """

    def __init__(
        self,
        store: StoreClient,
        engines: Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = 600.0,
        session_ttl_s: float = 30.0,
        holder: str | None = None,
        progress: Callable[[str], None] | None = None,
        max_connections: int | None = None,
    ) -> None:
        """``session_ttl_s``: how long engines stay held if this process stops renewing;
        ``holder``: the name engines report for this coordinator (default host:pid);
        ``max_connections``: at most this many calls of a phase in flight at once, the
        rest wait their turn (default: all); lease renewals have a bound of their own."""
        if not engines:
            raise MooncakeRLError("at least one engine URL is needed")
        if not 1 <= session_ttl_s <= MAX_TTL_S:
            raise MooncakeRLError(
                f"the session TTL must lie in 1..{MAX_TTL_S:g} s (engines refuse others), "
                f"got {session_ttl_s}"
            )
        if max_connections is not None and max_connections < 1:
            raise MooncakeRLError(f"max_connections must be >= 1, got {max_connections}")
        self.store = store
        self.engines = [url.rstrip("/") for url in engines]
        self._calls = _Bound(max_connections)
        self._renewals = _Bound(max_connections)
        self._loop = _Loop(f"coordinator-{os.getpid()}")
        self._session = self._loop.run(
            _open_session({"authorization": f"Bearer {token}"} if token else {}, timeout_s)
        )
        self._proxies: dict[str, dict[str, Any]] = {}
        self._progress = progress or (lambda message: None)
        # Routing tables also go to the Store: the next process (CLI, restarted bridge) loads them.
        self.cache = RoutingCache(store)
        self.session_ttl_s = session_ttl_s
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"

    def close(self) -> None:
        if not self._loop.closed:
            self._loop.run(self._session.close())
            self._loop.close()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- HTTP ------------------------------------------------------------------------
    def _proxy(self, url: str) -> dict[str, Any]:
        """The environment's proxy for ``url`` (``HTTP(S)_PROXY``, ``NO_PROXY``), looked up
        once per engine: aiohttp's own lookup (``trust_env``) costs two thread hops a call."""
        if url not in self._proxies:
            try:
                proxy, auth = aiohttp.helpers.get_env_proxy_for_url(URL(url))
                self._proxies[url] = {"proxy": proxy, "proxy_auth": auth}
            except LookupError:
                self._proxies[url] = {}
        return self._proxies[url]

    def call(self, url: str, path: str, body: Any) -> dict[str, Any]:
        return self._loop.run(self._request(url, "POST", path, _encoded(body), self._calls))

    def upload(self, url: str, params: Mapping[str, Any], data: bytes) -> dict[str, Any]:
        """A CPU-serialized bucket as the body of ``POST /mooncake/bucket``."""

        async def post() -> dict[str, Any]:
            async with (
                self._calls.slot(),
                self._session.post(
                    f"{url}/mooncake/bucket",
                    params=dict(params),
                    data=data,
                    headers={"content-type": "application/octet-stream"},
                    **self._proxy(url),
                ) as response,
            ):
                return _checked(url, "bucket", response.status, await response.read())

        return self._loop.run(post())

    async def _request(
        self, url: str, method: str, path: str, content: bytes | None, bound: _Bound
    ) -> dict[str, Any]:
        async with (
            bound.slot(),
            self._session.request(
                method,
                f"{url}/mooncake/{path}",
                data=content,
                headers=None if content is None else JSON,
                **self._proxy(url),
            ) as response,
        ):
            return _checked(url, path, response.status, await response.read())

    async def _retrying(
        self, url: str, path: str, content: bytes | None, bound: _Bound
    ) -> dict[str, Any]:
        """An idempotent call, repeated while no response arrives (lost, reset, timed out)."""
        for attempt in range(RETRIES):
            try:
                return await self._request(url, "POST", path, content, bound)
            except TRANSPORT_ERRORS:
                if attempt == RETRIES - 1:
                    raise
                await asyncio.sleep(RETRY_WAIT_S * 2**attempt)
        raise AssertionError("unreachable")

    async def _fan_out(
        self,
        urls: Sequence[str],
        method: str,
        path: str,
        contents: Mapping[str, bytes | None],
        *,
        retry: bool = False,
        bound: _Bound | None = None,
    ) -> dict[str, dict[str, Any] | EngineRequestFailed]:
        """Every engine's call at once on this loop; each engine's reply or failure."""
        kind = bound or self._calls

        async def one(url: str) -> dict[str, Any] | EngineRequestFailed:
            try:
                if retry:
                    return await self._retrying(url, path, contents[url], kind)
                return await self._request(url, method, path, contents[url], kind)
            except EngineRequestFailed as error:
                return error
            except REQUEST_ERRORS as error:
                why = str(error) or type(error).__name__
                return EngineRequestFailed(url, f"/mooncake/{path}", 0, why)

        replies = await asyncio.gather(*(one(url) for url in urls))
        return dict(zip(urls, replies, strict=True))

    def _all(
        self,
        urls: Sequence[str],
        method: str,
        path: str,
        bodies: Mapping[str, Any] | None = None,
        *,
        retry: bool = False,
    ) -> tuple[dict[str, dict[str, Any]], dict[str, EngineRequestFailed]]:
        """The same call on every engine, concurrently; successes and failures by URL.
        Bodies are encoded here, on the caller's thread, so the loop only moves bytes."""
        if not urls:
            return {}, {}
        results = self._loop.run(
            self._fan_out(urls, method, path, _contents(urls, bodies), retry=retry)
        )
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
        batch_bytes: int | None = None,
        direct_fallback: str | None = None,
        min_engines: int | None = None,
        transport: str | None = None,
        train_gpus: str | Sequence[str] | None = None,
        sender: SenderLauncher | None = None,
        router: Router | None = None,
        max_unavailable: int | None = None,
        in_place: bool = True,
        pull: str = "single",
    ) -> UpdateResult:
        """``direct_fallback``: regex of parameter names direct mode lands through each
        engine's ``load_weights`` (full tensors) instead of its shard discovery.
        ``min_engines``: how many engines must end on the new generation (already serving
        it counts); default all. ``transport``: store (default: ``MOONCAKE_RL_TRANSPORT``),
        broadcast, cpu_serialize or auto; the non-Store ones need ``train_gpus`` (default
        ``MOONCAKE_RL_TRAIN_GPUS``) and deliver full tensors in buckets of ``batch_bytes``;
        ``sender``: where a broadcast's sender runs (default: a child of this process).
        ``batch_bytes``: the plan's pipeline batch (default: ``MOONCAKE_RL_BATCH_BYTES`` of
        this Store client's settings); every engine worker's staging watermark must hold two.

        ``router``: the request router in front of the engines. Before anything is touched
        the router, the engines' plugin versions and the topology are probed; then each
        engine is taken out of rotation before it drains and re-admitted (if still wanted)
        once its sync ended, whatever the outcome. ``max_unavailable``: update that many
        engines at a time (a rolling update), all pinned to the same generation; default
        all at once. :class:`ReadmitFailed` means the sync succeeded but engines stayed out
        of rotation; a failed sync raises its own error even when re-admission failed too.

        ``in_place``: direct mode receives into live parameters that need no post-load
        processing (no staging memory, no landing copy). An update that then fails after
        prepare leaves those engines rebuilding from the Store (``result.rebuild``) instead
        of serving their old generation; ``False`` stages every byte.

        ``pull``: ``single`` reads each published byte from the Store once for the whole
        fleet; ``node`` once per rollout node, so that a node fans its own reads out over
        NVLink as they land instead of after the barrier (compat mode's full tensors: about
        1.8x -> 1.0x its NIC bound in ``bench simulate``). The Store then serves the model
        once per node: use it where the trainers' NICs have that headroom.
        """
        if pull not in PULLS:
            raise ConfigurationError(
                f"pull must be one of {', '.join(PULLS)}, got {pull!r}: single reads each "
                "byte once for the fleet, node once per rollout node"
            )
        needed = len(self.engines) if min_engines is None else min_engines
        if not 1 <= needed <= len(self.engines):
            raise MooncakeRLError(
                f"min_engines must lie in 1..{len(self.engines)} (the engines given), got {needed}"
            )
        groups = waves(self.engines, max_unavailable)
        chosen = resolve_mode(transport)
        require_store_path(chosen, mode, pull)
        train_pool = parse_gpu_ids(
            train_gpus if train_gpus is not None else self.store.settings.train_gpus,
            "the train pool's GPU ids (--train-gpus / MOONCAKE_RL_TRAIN_GPUS)",
        )
        rotation = None
        if router is not None:
            self._probe(router, chosen, train_pool)
            rotation = Rotation(router, self.store, holder=self.holder)
        record = require_active(self.store, model, "cannot update engines")
        batch = self.store.settings.batch_bytes if batch_bytes is None else batch_bytes
        options = _Options(
            mode, drain_mode, batch, direct_fallback, chosen, train_pool, sender, in_place, pull
        )
        tag = uuid.uuid4().hex
        total = UpdateResult(model, record.generation, mode, list(self.engines))
        total.transport, total.pull, total.drain_mode = chosen.value, pull, drain_mode
        spare = len(self.engines) - needed
        for group in groups:
            needed_now = max(1, len(group) - spare)
            bracket = functools.partial(
                self.bracketed, rotation, tag, leave_last=drain_mode == "keep"
            )
            try:
                survey = self._survey(model, group, record, needed_now, options)
                if options.pauses_at_prepare:  # out of rotation for the whole sync
                    sync = functools.partial(self._sync, survey, record, needed_now, options)
                    result = bracket(group, functools.partial(sync, _unbracketed))
                else:  # out of rotation for the landing alone
                    result = self._sync(survey, record, needed_now, options, bracket)
            except (UpdateFailed, ReadmitFailed) as error:
                total.absorb(error.result)
                error.result = total
                raise
            total.absorb(result)
            spare -= len(group) - len(result.committed) - len(result.skipped)
        return total

    def _probe(
        self, router: Router, chosen: TransportMode, train_pool: Sequence[str] | None
    ) -> None:
        """Router API, plugin versions and topology, before any engine leaves rotation."""
        router.probe()
        statuses, failed = self._all(self.engines, "GET", "status")
        require_compatible({**statuses, **{u: None for u, e in failed.items() if e.status == 404}})
        placements, _ = self._all(self.engines, "GET", BARE_PLACEMENT)
        urls = sorted(placements)
        classify(chosen, urls, engine_gpus(placements, urls), train_pool)

    def bracketed(
        self,
        rotation: Rotation | None,
        tag: str,
        engines: Sequence[str],
        sync: Callable[[], UpdateResult],
        *,
        leave_last: bool = False,
    ) -> UpdateResult:
        """Take ``engines`` out of rotation, sync, and re-admit in the ``finally``
        (``leave_last``: :meth:`Rotation.take_out`'s, for keep mode).

        Only engines still held out for this update (``tag``) come back: one retired
        meanwhile stays out. The sync's error wins over a failed re-admission; after a
        successful sync, a failed re-admission raises :class:`ReadmitFailed`.
        """
        if rotation is None:
            return sync()
        taken: list[str] = []
        outcome: dict[str, str] = {}
        try:
            rotation.take_out(engines, tag, taken, leave_last=leave_last)
            result = sync()
        except UpdateFailed as failed:
            failed.result.rotation = outcome  # filled in by the finally below
            raise
        finally:
            outcome.update(rotation.readmit(taken, tag))
        result.rotation = outcome
        stuck = {url: why for url, why in outcome.items() if why.startswith("failed")}
        if stuck:
            raise ReadmitFailed(result, stuck)
        return result

    def _survey(
        self,
        model: str,
        engines: Sequence[str],
        record: ActiveRecord,
        needed: int,
        options: _Options,
    ) -> _Survey:
        """Steps 1-2 and, for the Store transport, the plan: all before any engine leaves
        rotation or drains, so engines serve while a cold plan runs (seconds for a 1T MoE),
        and a placement the planner refuses changes nothing. The plan after the drain is
        then the cache's hit, unless an engine failed to drain."""
        mode, chosen, train_pool = options.mode, options.transport, options.train_pool
        registry = GenerationRegistry(self.store, model)
        manifest = registry.load_manifest(record.generation, record.manifest_digest)
        # One table load per update; each worker gets the rows of the objects it reads.
        checksums = registry.load_checksums(record.generation, record.checksums_digest)
        segments = registry.segment_hints(record)  # locality: reads stay on a segment's node
        result = UpdateResult(model, record.generation, mode, list(engines))
        result.transport, result.pull = chosen.value, options.pull
        result.drain_mode = options.drain_mode
        phase = _Phases(result, self._progress)

        placements, failed = self._all(engines, "GET", BARE_PLACEMENT)
        require_compatible(placements)  # a reply carries its engine's status
        _left_out(result, failed)
        result.skipped = [u for u in engines if u in placements and serves(placements[u], record)]
        targets = [u for u in engines if u in placements and u not in result.skipped]
        for url in targets:
            problem = refusal(url, placements[url], record, options.drain_mode)
            if problem:
                result.error = problem
                raise UpdateFailed(result)
        _require_enough(result, targets, needed, "placement")
        # Before any drain: a topology the transport cannot serve changes nothing.
        classification = classify(chosen, targets, engine_gpus(placements, targets), train_pool)
        mixed = chosen is TransportMode.AUTO and self.store.settings.assert_mixed_transport
        if mixed:
            require_mixed(classification)
        if chosen is TransportMode.STORE:
            require_staging({u: placements[u]["workers"] for u in targets}, options.batch_bytes)
            wanted = self.cache.boxes_wanted(
                manifest,
                {u: placements[u]["workers"] for u in targets},
                mode,
                options.batch_bytes,
                record.layout_digest,
                options.direct_fallback,
                segments,
                pull=options.pull,
            )
            # A 1T MoE engine's boxes: 50 MB of JSON, some 200k dicts. Parsed with the
            # collector running, they set off passes over this process's whole heap (1.8 s
            # instead of 0.4 s for one reply beside a plan's caches).
            with planning_mode():
                described, failed = self._all(wanted, "GET", "placement")
            _left_out(result, failed)
            placements.update(described)
            result.described = sorted(described)
            targets = [u for u in targets if u not in failed]
            _require_enough(result, targets, needed, "placement")
        phase("placement")
        survey = _Survey(result, phase, checksums, placements, targets, classification, mixed)
        if not targets:
            return survey
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
        if chosen is not TransportMode.STORE:
            return survey

        def describe(urls: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
            """Boxes a re-plan reads after the drain (the first plan's were read before)."""
            described, failed = self._all(urls, "GET", "placement")
            if failed:
                _left_out(result, failed)
                result.error = "placement failed while re-planning: " + "; ".join(
                    str(e) for e in failed.values()
                )
                raise UpdateFailed(result)
            placements.update(described)
            result.described = sorted({*result.described, *described})
            return {u: described[u]["workers"] for u in urls}

        def plan_for(urls: Sequence[str]) -> UpdatePlan:
            return plan_update(
                manifest,
                {u: placements[u]["workers"] for u in urls},
                mode,
                options.batch_bytes,
                self.cache,
                record.layout_digest,
                options.direct_fallback,
                segments,
                describe,
                pull=options.pull,
            )

        survey.plan_for, survey.planned = plan_for, plan_for(targets)
        phase("plan")
        # The engines' slices, encoded while they serve: about 10 s of coordinator CPU per
        # update for a 1T MoE on 16 engines, which engines would otherwise wait out drained.
        survey.encoded = {url: survey.workers(url, survey.planned) for url in targets}
        phase("bodies")
        return survey

    def _sync(
        self,
        survey: _Survey,
        record: ActiveRecord,
        needed: int,
        options: _Options,
        landing: Bracket,
    ) -> UpdateResult:
        """Steps 3-6 for the engines ``survey`` found (see the module doc); ``landing``
        brackets the commit (out of a router's rotation and back)."""
        result, phase, members = survey.result, survey.phase, survey.targets
        phase.restart()  # leaving rotation is not a phase of the sync
        if not members:
            return result
        session = SessionLease(self, self.session_ttl_s)
        result.session = session.id

        def base_body(url: str) -> dict[str, Any]:
            return {
                "session": session.id,
                **target_of(record),
                "manifest_digest": record.manifest_digest,
                "mode": options.mode,
                "in_place": options.in_place,
            }

        try:
            members = self._drain(
                session, members, options.drain_mode, needed, result, target_of(record)
            )
            phase("drain")
            if survey.planned is not None:
                members, plan, prepared = self._prepare(
                    session,
                    members,
                    survey.plan,
                    lambda url, plan: _Body(
                        {**base_body(url), "stages": plan.stages},
                        {"workers": survey.workers(url, plan)},
                    ),
                    needed,
                    result,
                    phase,
                )
                survey.encoded.clear()  # sent: up to tens of MB per engine
                _planned(result, plan)
                for url, reply in prepared.items():
                    result.in_place_bytes += reply.get("in_place_bytes", 0)
                    result.staged_bytes += reply.get("staged_bytes", 0)
                    result.staging[url] = [w["staging"] for w in reply["workers"] if "staging" in w]
                self._apply(session, members, plan, advertised_peers(prepared), record, result)
            else:
                members = self._deliver(
                    session,
                    members,
                    survey.classification,
                    survey.placements,
                    options.sender or ChildLauncher(self.store.settings, options.train_pool),
                    record,
                    options.batch_bytes,
                    needed,
                    result,
                    phase,
                    base_body,
                )
            phase("apply")

            def land() -> UpdateResult:
                self._commit(session, members, record, needed, result)
                return result

            landing(members, land)
            phase("commit")
        except BaseException:
            session.release(sorted(session.held))
            raise
        finally:
            session.stop()
            result.rebuild = sorted({*result.rebuild, *session.rebuilding})
        if survey.mixed:
            require_mixed_ran(
                {TransportMode(result.legs[u]["transport"]) for u in result.committed}
            )
        return result

    def _deliver(
        self,
        session: SessionLease,
        members: list[str],
        classification: Classification,
        placements: Mapping[str, dict[str, Any]],
        launcher: SenderLauncher,
        record: ActiveRecord,
        bucket_bytes: int,
        needed: int,
        result: UpdateResult,
        phase: Callable[[str], None],
        base_body: Callable[[str], dict[str, Any]],
    ) -> list[str]:
        """Prepare and apply the broadcast and CPU legs (:mod:`mooncake_rl.transport.legs`)."""
        legs = TransportLegs(
            self,
            self.store,
            self.store.settings,
            record,
            classification,
            placements,
            launcher,
            session=session.id,
            holder=f"{self.holder}/{session.id}",
            bucket_bytes=bucket_bytes,
        )
        try:
            members, plan, _ = self._prepare(
                session,
                members,
                legs.plan_for,
                lambda url, plan: legs.body_for(url, plan, base_body(url)),
                needed,
                result,
                phase,
            )
            legs.apply(plan)
        except LegFailed as error:
            # Apply writes staging only: released engines serve their old generation.
            session.release(sorted(session.held))
            result.failed.update(error.failed)
            result.failure_codes.update(dict.fromkeys(error.failed, "delivery_failed"))
            result.error = f"{classification.mode.value} delivery failed: {error}"
            raise UpdateFailed(result) from error
        finally:
            legs.close()
            result.legs.update(legs.figures.rows)
            result.store_read_bytes = legs.store_read_bytes
        return members

    def _drain(
        self,
        session: SessionLease,
        targets: Sequence[str],
        drain_mode: str,
        needed: int,
        result: UpdateResult,
        target: dict[str, Any],
    ) -> list[str]:
        """Open the session on every target; the first (in URL order) alone, so that a
        rival coordinator that got there first stops this one before it holds anything.
        Each drain names ``target``: an engine a rival brought to it since the survey
        refuses, still serving (``stale_generation``)."""
        body = {
            "session": session.id,
            "holder": self.holder,
            "ttl_s": self.session_ttl_s,
            "mode": drain_mode,
            "target": target,
        }
        ordered = sorted(targets)
        drained: list[str] = []
        for group, untried in ((ordered[:1], ordered[1:]), (ordered[1:], [])):
            ok, failed = self._all(group, "POST", "drain", {u: body for u in group})
            session.held.update(ok)
            drained += ok
            _left_out(result, failed)
            self._enough_or_release(session, result, [*drained, *untried], needed, "drain")
        return [u for u in targets if u in drained]

    def _prepare(
        self,
        session: SessionLease,
        members: list[str],
        plan_for: Callable[[Sequence[str]], P],
        body_for: Callable[[str, P], dict[str, Any]],
        needed: int,
        result: UpdateResult,
        phase: Callable[[str], None],
    ) -> tuple[list[str], P, dict[str, dict[str, Any]]]:
        """Plan and prepare; engines that fail or stop answering are released and the rest
        re-planned without them (their pushes would never come) until all that remain are
        prepared and alive."""
        planned = False
        while True:
            plan = plan_for(members)
            if not planned:
                phase("plan")
                planned = True
            bodies = {u: body_for(u, plan) for u in members}
            prepared, failed = self._all(members, "POST", "prepare", bodies)
            if not failed:
                phase("prepare")
                # Just before apply: every member still answers in this session.
                _, failed = self._all(
                    members, "POST", "renew", {u: {"session": session.id} for u in members}
                )
            if not failed:
                return members, plan, prepared
            session.release(sorted(failed))
            _left_out(result, failed)
            members = [u for u in members if u not in failed]
            self._enough_or_release(session, result, members, needed, "prepare")

    def _apply(
        self,
        session: SessionLease,
        members: list[str],
        plan: UpdatePlan,
        peers: dict[str, dict[str, Any]],
        record: ActiveRecord,
        result: UpdateResult,
    ) -> None:
        figures = LegFigures()
        received = plan.routing.received_bytes()
        for stage in range(plan.stages):
            bodies = {
                url: {
                    "session": session.id,
                    "generation": record.generation,
                    "stage": stage,
                    "peers": stage_peers(plan, url, stage, peers),
                }
                for url in members
            }
            applied, failed = self._all(members, "POST", "apply", bodies)
            for url, reply in applied.items():
                for worker in reply["workers"]:
                    result.store_read_bytes += worker["store_read_bytes"]
                    result.store_reread_bytes += worker.get("store_reread_bytes", 0)
                    result.pushed_bytes += worker["pushed_bytes"]
                figures.add(
                    url,
                    TransportMode.STORE.value,
                    sum(received.get(w["worker_id"], 0) for w in reply["workers"] if not stage),
                    max((w["seconds"] for w in reply["workers"]), default=0.0),
                )
            result.legs.update(figures.rows)
            if failed:
                # Released engines serve their old generation, or rebuild where they
                # received in place (result.rebuild).
                session.release(sorted(session.held))
                _left_out(result, failed)
                result.error = f"apply stage {stage} failed: " + "; ".join(
                    str(e) for e in failed.values()
                )
                raise UpdateFailed(result)
            self._progress(f"stage {stage}")

    def _commit(
        self,
        session: SessionLease,
        members: list[str],
        record: ActiveRecord,
        needed: int,
        result: UpdateResult,
    ) -> None:
        body = {"session": session.id, "generation": record.generation}
        committed, failed = self._all(
            members, "POST", "commit", {u: body for u in members}, retry=True
        )
        session.held.difference_update(members)
        result.committed = [u for u in members if u in committed]
        for url, reply in committed.items():
            result.landing[url] = reply.get("landing", {})
            for rank, worker in enumerate(reply.get("workers", [])):
                result.verified[f"{url}/tp{rank}"] = worker.get("verify", {})
        _left_out(result, failed)
        result.rebuild = sorted(u for u, e in failed.items() if e.code == "commit_failed")
        if len(result.committed) + len(result.skipped) < needed:
            result.error = "commit failed: " + "; ".join(str(e) for e in failed.values())
            raise UpdateFailed(result)

    def _enough_or_release(
        self,
        session: SessionLease,
        result: UpdateResult,
        members: Sequence[str],
        needed: int,
        step: str,
    ) -> None:
        try:
            _require_enough(result, members, needed, step)
        except UpdateFailed:
            session.release(sorted(session.held))
            raise


class SessionLease:
    """One update session: its id, the engines it holds, and their lease renewal.

    Renewal runs every third of the TTL as a task on the coordinator's loop, so a long
    apply or commit never lets the lease lapse; its calls have their own bound on calls in
    flight, so a phase's fan-out never holds them back. When this process dies, renewal
    stops and the engines free themselves.
    """

    def __init__(self, coordinator: Coordinator, ttl_s: float) -> None:
        self.id = uuid.uuid4().hex
        self.held: set[str] = set()
        self.rebuilding: set[str] = set()
        self._coordinator = coordinator
        self._ttl_s = ttl_s
        self._renewal = coordinator._loop.submit(self._renew())

    async def _renew(self) -> None:
        body = _encoded({"session": self.id})
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            urls = sorted(self.held)
            await self._coordinator._fan_out(
                urls, "POST", "renew", dict.fromkeys(urls, body), bound=self._coordinator._renewals
            )

    def release(self, urls: Sequence[str]) -> None:
        """Abort the session on ``urls``: each drops what it staged and serves again, or
        (live parameters received in place) rebuilds itself; those are kept in
        ``rebuilding``."""
        body = {"session": self.id}
        aborted, _ = self._coordinator._all(
            urls, "POST", "abort", {u: body for u in urls}, retry=True
        )
        self.rebuilding.update(
            u for u, reply in aborted.items() if reply.get("state") in ("broken", "rebuilding")
        )
        self.held.difference_update(urls)

    def stop(self) -> None:
        """No renewal from now on (one in flight is cancelled)."""
        self._renewal.cancel()


class _Loop:
    """An event loop on a daemon thread; synchronous code runs coroutines on it."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """``coroutine``'s result, waited for; an interrupt of the waiting thread cancels it."""
        future = self.submit(coroutine)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    @property
    def closed(self) -> bool:
        return self._loop.is_closed()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class _Bound:
    """At most ``limit`` calls in flight, the others queued in order (``None``: no bound)."""

    def __init__(self, limit: int | None) -> None:
        self._semaphore = None if limit is None else asyncio.Semaphore(limit)

    def slot(self) -> AbstractAsyncContextManager[Any]:
        return self._semaphore or contextlib.nullcontext()


JSON = {"content-type": "application/json"}
TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)
"""No whole reply came (refused, reset, cut short, timed out): what a retry can mend."""
REQUEST_ERRORS = (aiohttp.ClientError, TimeoutError)
"""A call that failed without a reply: its engine is reported with status 0 (unreachable)."""


async def _open_session(headers: Mapping[str, str], timeout_s: float) -> aiohttp.ClientSession:
    """The coordinator's HTTP session, opened on its loop (aiohttp binds to the running one).

    A fresh connection per call (``force_close``): an engine's server closes idle keep-alive
    connections on its own clock (uvicorn: 5 s), and a request sent as it closes one is
    reset. No connection bound here: ``_Bound`` bounds calls, per kind, so renewals never
    queue behind a phase's calls. ``timeout_s`` bounds connecting and each wait for bytes.
    TLS trusts httpx's CA set (certifi, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``) as the rest
    of this package's HTTP clients do; proxies come from ``Coordinator._proxy``.
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True, ssl=httpx.create_ssl_context()),
        headers=dict(headers),
        timeout=aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s),
    )


@dataclass(frozen=True)
class _Body:
    """A JSON object body, some of whose members are already encoded: a prepare body's
    ``workers`` is encoded before the drain, its session only exists after it."""

    members: Mapping[str, Any]
    encoded: Mapping[str, bytes]

    def __post_init__(self) -> None:
        both = set(self.members) & set(self.encoded)
        if both:
            raise InvariantViolation(f"body members given twice: {sorted(both)}")

    def encode(self) -> bytes:
        pairs = [_json(dict(self.members))[1:-1]]
        pairs += [_json(name) + b":" + value for name, value in self.encoded.items()]
        return b"{" + b",".join(pair for pair in pairs if pair) + b"}"


def _json(value: Any) -> bytes:
    """``value`` as httpx's ``json=`` encodes it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _encoded(body: Any) -> bytes | None:
    """A request's body: ``None`` sends none."""
    if body is None:
        return None
    return body.encode() if isinstance(body, _Body) else _json(body)


def _contents(urls: Sequence[str], bodies: Mapping[str, Any] | None) -> dict[str, bytes | None]:
    """Each engine's encoded body; one body object shared by many engines is encoded once."""
    if bodies is None:
        return dict.fromkeys(urls)
    encoded: dict[int, bytes | None] = {}
    contents = {}
    for url in urls:
        body = bodies[url]
        if id(body) not in encoded:
            encoded[id(body)] = _encoded(body)
        contents[url] = encoded[id(body)]
    return contents


def advertised_peers(prepared: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Where each prepared worker takes pushes: the apply body's ``peers`` (prepare replies
    by engine, each with its ``workers``)."""
    return {
        w["worker_id"]: {k: w[k] for k in ADVERTISED}
        for reply in prepared.values()
        for w in reply["workers"]
    }


def stage_peers(
    plan: UpdatePlan, url: str, stage: int, peers: Mapping[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The advertised peers that ``url``'s workers push to in ``stage``: all an apply body
    needs. Naming every prepared worker instead makes each body grow with the fleet, and a
    stage's bytes with its square (1,000 engines: gigabytes of JSON per stage)."""
    return {worker: peers[worker] for worker in sorted(plan.push_peers(url, stage))}


def engine_gpus(
    placements: Mapping[str, Mapping[str, Any]], urls: Sequence[str]
) -> dict[str, list[str] | None]:
    """Each engine's physical GPU ids in rank order; ``None`` where a rank reports none."""
    found: dict[str, list[str] | None] = {}
    for url in urls:
        gpus = [w.get("gpu") for w in placements[url].get("workers", [])]
        found[url] = [g for g in gpus if g] if gpus and all(gpus) else None
    return found


def _checked(url: str, path: str, status: int, data: bytes) -> dict[str, Any]:
    """The reply's JSON; anything but 200 raises with the reply (JSON, else its text)."""
    try:
        payload = json.loads(data)
    except ValueError:
        payload = data.decode("utf-8", errors="replace")
    if status != 200:
        raise EngineRequestFailed(url, f"/mooncake/{path}", status, payload)
    return payload


def _left_out(result: UpdateResult, failed: Mapping[str, EngineRequestFailed]) -> None:
    result.failed.update({url: str(error) for url, error in failed.items()})
    result.failure_codes.update(
        {
            url: error.code or ("unreachable" if error.status == 0 else f"http_{error.status}")
            for url, error in failed.items()
        }
    )


def _require_enough(result: UpdateResult, members: Sequence[str], needed: int, step: str) -> None:
    """Raise unless ``members`` plus the engines already serving reach ``needed``."""
    if len(members) + len(result.skipped) >= needed:
        return
    result.error = (
        f"{step}: only {len(members) + len(result.skipped)} of {len(result.engines)} engines "
        f"can serve generation {result.generation}, {needed} needed (--min-engines); "
        + "; ".join(result.failed.values())
    )
    raise UpdateFailed(result)


def _planned(result: UpdateResult, plan: UpdatePlan) -> None:
    result.planned_read_bytes = plan.store_read_bytes
    result.planned_pushed_bytes = plan.pushed_bytes
    result.unique_demand_bytes = plan.unique_demand_bytes
    result.cross_node_pushed_bytes = plan.routing.cross_node_pushed_bytes
    result.received_bytes = plan.routing.received_bytes()
    result.fallback_bytes = plan.routing.fallback_bytes()
    result.node_nic_bytes = dict(plan.routing.node_nic_bytes)
