"""One engine worker's side of the update protocol, shared by the vLLM and SGLang adapters.

A worker describes its shards and receives the bytes its routing slice assigns it. In
direct mode, a parameter whose live layout is its stored layout (the engine runs no
post-load processing on it: :meth:`UpdateWorker.in_place_parameters`) is its own receive
region, so its bytes land in live storage with no copy; every other byte is staged in a
worker-owned arena on the parameters' device (registered once, reused across generations
and modes while the layout fits) and landed at commit through the engine's own loading
paths (the subclass's :meth:`UpdateWorker.land_compat` / :meth:`UpdateWorker.land_direct`).
Prepare decides the split and reports it (``in_place_bytes``, ``staged_bytes``); once a
prepare received in place, live weights are exposed, and any end but commit makes the
receiver rebuild the engine from the Store. Every call returns a JSON-able reply with ``ok`` instead
of raising: at TP >= 2 a rank that raises leaves the other ranks' replies (and collectives)
hanging, so the API side checks every rank. A call the worker refuses
(:class:`RequestRefused`: a malformed request, or one the Store contradicts, see
:mod:`engine_ext.admission`) changes nothing and says so in its reply, apart from failures.
"""

from __future__ import annotations

import functools
import math
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from engine_ext.admission import (
    PeerBook,
    RequestRefused,
    advertise,
    apply_request,
    check_generation,
    check_reads,
    parsed,
    prepare_request,
    withdraw,
)
from engine_ext.leases import lease_id, update_lease_id
from engine_ext.loading import mark_served, served_by, served_record, store_weights
from engine_ext.placement import RegionSpec, assemble_regions
from engine_ext.receiver import ServedRecord
from engine_ext.shards import ShardSpec
from engine_ext.staging import choose_staging, free_device_bytes
from engine_ext.transport import (
    PROCESS,
    RECEIVED_REGION,
    Membership,
    Reception,
    prepare_reception,
    receive_broadcast,
    receive_bucket,
)
from engine_ext.written import fill_canary, session_canary, unwritten
from mooncake_rl.apply.executor import Batch, Peer
from mooncake_rl.apply.wire import WorkerSlice, decode_slice
from mooncake_rl.apply.worker import (
    ApplyWorker,
    allocate_arena,
    arena_views,
    covering_spans,
    region_of,
)
from mooncake_rl.counters import COUNTERS
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import ROLLOUT_DTYPES
from mooncake_rl.generations.leases import LeaseBook, lease_book
from mooncake_rl.plan.demand import COMPAT_REGION, FALLBACK_REGION, STAGING_REGION
from mooncake_rl.protocol import (
    PLACEMENT_DIGEST,
    BucketWire,
    PrepareRequest,
    reported_placement,
    stage_refusal,
    without_boxes,
)
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.buckets import this_host_id
from mooncake_rl.transport.group import gpu_uuid
from mooncake_rl.transport.modes import parse_gpu_ids

METHODS = (
    "status",
    "describe",
    "prepare",
    "promote",
    "apply",
    "collect",
    "expect",
    "commit",
    "abort",
    "rebuild",
)


class _UpdateState:
    """One worker's pending update: its data-plane endpoint, staged regions, and how far
    the update's session got (``stages`` declared at prepare, ``ran`` of them in order)."""

    def __init__(self, worker_id: str) -> None:
        self.apply = ApplyWorker(Settings().with_overrides(segment_bytes=0), worker_id)
        self.arena: torch.Tensor | None = None
        self.sizes: dict[str, int] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.slice: WorkerSlice | None = None
        # Live parameters received in place (direct mode), by region name.
        self.in_place: dict[str, torch.Tensor] = {}
        self.mode: str | None = None
        self.layout: list[dict[str, Any]] = []
        self.fallback: list[dict[str, Any]] = []
        self.generation: int | None = None
        self.record = ServedRecord()
        self.session: str | None = None
        self.stages = 0
        self.ran = 0
        self.peers: PeerBook | None = None
        # The post-landing check's reference, built once every stage ran (``expect``).
        self.check: LandingCheck | None = None
        # The Store path's staging canary (``engine_ext.written``): what unwritten bytes hold.
        self.canary: int | None = None
        # A broadcast or CPU-serialized delivery (instead of a routing slice); its buffer is
        # kept for the next one while the size fits.
        self.reception: Reception | None = None
        self.received: torch.Tensor | None = None
        self.membership = Membership()
        # The last apply stage started, moving bytes on its own thread; ``collect`` answers
        # with its reply (again, until the next stage: TP ranks end at different polls).
        self.stage_runner = ThreadPoolExecutor(1, thread_name_prefix=f"mooncake-{worker_id}")
        self.running: Future[dict[str, Any]] | None = None
        # The update lease this worker wrote at prepare (``engine_ext.leases``): its book
        # and holder, until commit or abort releases it.
        self.lease: tuple[LeaseBook, str] | None = None

    def lease_update(self, engine_id: str, call: PrepareRequest) -> None:
        """Lease the generation this update brings, before anything reads it."""
        book = lease_book(self.apply.store, call.model)
        holder = update_lease_id(engine_id)
        book.renew(holder, call.generation, self.apply.settings.lease_ttl_s)
        self.lease = (book, holder)

    def end_lease(self, serving: tuple[str, int] | None = None) -> None:
        """Release the update lease; ``serving``: (engine id, generation) commit landed, onto
        which the serving lease moves first, so the generation is never unleased."""
        if self.lease is None:
            return
        book, holder = self.lease
        if serving is not None:
            engine_id, generation = serving
            book.renew(lease_id(engine_id), generation, self.apply.settings.lease_ttl_s)
        book.release(holder)
        self.lease = None

    @property
    def pending(self) -> bool:
        return self.slice is not None or self.reception is not None

    def settle(self, keep: bool = False) -> None:
        """Wait out a running stage: nothing may deregister or reuse staging while a stage
        still writes it. Its reply is forgotten (the session is ending) unless ``keep``."""
        if self.running is not None:
            wait([self.running])
            if not keep:
                self.running = None

    def drop(self) -> None:
        """Forget the pending update: registrations rolled back, advertisement withdrawn."""
        self.settle()
        self.apply.rollback()
        if self.session is not None and self.slice is not None:  # a Store-path advert
            withdraw(self.apply.store, self.session, self.apply.worker_id)
        self.slice = self.generation = self.session = self.peers = self.reception = None
        self.check = self.canary = None
        self.stages = self.ran = 0
        self.in_place = {}


class _Description:
    """A worker's regions and boxes as its describer found them, kept while the parameters
    are the same tensors of the same shapes and dtypes (``fingerprint``), and their served
    form with its placement digest, made once."""

    def __init__(self, fingerprint: tuple, specs: tuple[list[RegionSpec], list[ShardSpec]]) -> None:
        self.fingerprint = fingerprint
        self.specs = specs
        self._served: dict[str, Any] | None = None

    def served(self, tp_rank: int, tp_size: int) -> dict[str, Any]:
        """The planned fields (``protocol.PLANNED_FIELDS``) and their ``placement_digest``."""
        if self._served is None or (self._served["tp_rank"], self._served["tp_size"]) != (
            tp_rank,
            tp_size,
        ):
            regions, shards = self.specs
            self._served = reported_placement(
                {
                    "tp_rank": tp_rank,
                    "tp_size": tp_size,
                    "regions": {
                        r.name: {"bytes": r.nbytes, "dtype": str(r.dtype).removeprefix("torch.")}
                        for r in regions
                    },
                    "shards": [s.to_json() for s in shards],
                }
            )
        return self._served


def parameter_fingerprint(model: torch.nn.Module) -> tuple:
    """Which tensors the model's parameters are, with their shapes and dtypes: an entry per
    parameter (a fused 1T MoE has about a thousand), not per box (it describes ~140k)."""
    return tuple((n, id(p), p.shape, p.dtype) for n, p in model.named_parameters())


class UpdateWorker(ABC):
    """Engine-neutral worker logic; subclasses supply the model, ranks and landing paths."""

    _update: _UpdateState | None = None
    _description: _Description | None = None

    # -- engine glue ------------------------------------------------------------------
    @abstractmethod
    def model(self) -> torch.nn.Module: ...

    @abstractmethod
    def tp(self) -> tuple[int, int]:
        """(tensor-parallel rank, tensor-parallel size) of this worker."""

    @abstractmethod
    def describe_regions(self) -> tuple[list[RegionSpec], list[ShardSpec]]:
        """The engine's describer: receive regions and the checkpoint boxes landing in them."""

    def regions(self) -> tuple[list[RegionSpec], list[ShardSpec]]:
        """``describe_regions``, kept while the parameters stay the same tensors of the same
        shapes and dtypes. Every update asks several times (placement, prepare, the landing
        check), each call runs in the engine's own loop (on vLLM, between the steps of every
        request), and a 1T MoE's rank describes some 140k boxes."""
        return self._described().specs

    def _described(self) -> _Description:
        fingerprint = parameter_fingerprint(self.model())
        if self._description is None or self._description.fingerprint != fingerprint:
            self._description = _Description(fingerprint, self.describe_regions())
        return self._description

    @abstractmethod
    def land_compat(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Load full checkpoint tensors into the live model (the engine's ``load_weights``)."""

    @abstractmethod
    def land_direct(self, landing: DirectLanding) -> None:
        """Load ``landing`` into the live model (see :class:`DirectLanding`)."""

    def in_place_parameters(self) -> dict[str, torch.Tensor]:
        """Live parameters that can be their own receive regions, by region name.

        The default takes every parameter whose live tensor has its stored shape and dtype
        (:func:`live_receivers`); engines exclude those their post-load processing changes.
        """
        return live_receivers(self.model(), self.regions()[0], self.device())

    def expect_live(
        self, expected: Mapping[str, torch.Tensor], received: Collection[str] = ()
    ) -> Any:
        """The reference :meth:`compare_live` takes: what the live model must hold once
        ``expected`` (model format, staged) landed; ``received``: parameters received in
        place, already checked against the generation's checksums as they were read.
        Built before the pause, while the engine serves, so the pause holds only the
        comparison. Engines that keep checkpoint layout live (SGLang) compare bytes: the
        reference is ``expected`` itself; engines that repack into kernel layouts override
        both with a fresh-load comparison."""
        return expected

    def compare_live(self, reference: Any) -> Comparison:
        """Which live parameters differ from the reference, and which it could not compare."""
        live = dict(self.model().named_parameters())
        return Comparison(
            [n for n, t in reference.items() if n in live and not same_bytes(live[n], t)],
            [n for n in reference if n not in live],
        )

    # -- the one entry point ----------------------------------------------------------
    def call(self, engine_id: str, method: str, *args: Any) -> dict[str, Any]:
        """Run ``method`` and wrap its result (or error) in a reply; never raises.

        A refusal (nothing changed) replies ``refused: {status, code}`` beside ``error``, so
        the API side can answer 4xx and keep the engine's state; anything else is a failure.
        """
        rank = self.tp()[0]
        try:
            if method not in METHODS:
                raise InvariantViolation(f"unknown worker method {method!r}")
            action: Callable[..., dict[str, Any]] = getattr(self, f"_{method}")
            return {"ok": True, "rank": rank, **action(engine_id, *args)}
        except RequestRefused as refused:
            return {
                "ok": False,
                "rank": rank,
                "refused": {"status": refused.status, "code": refused.code},
                "error": refused.detail,
            }
        except Exception as error:  # reported to the API server, which checks every rank
            return {
                "ok": False,
                "rank": rank,
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc()[-3000:],
            }

    def _state(self, engine_id: str) -> _UpdateState:
        if self._update is None:
            self._update = _UpdateState(f"{engine_id}/tp{self.tp()[0]}")
        return self._update

    def store(self, engine_id: str) -> StoreClient:
        """This worker's Store client (opened on first use), for callers that check the
        Store before they build a request, without a second client per worker."""
        return self._state(engine_id).apply.store

    def close(self) -> None:
        """Drop any pending update and close this worker's Store and Transfer Engine
        clients; the next call opens new ones."""
        if self._update is not None:
            self._update.drop()
            self._update.end_lease()
            self._update.apply.close()
            self._update.stage_runner.shutdown()
            self._update = None

    # -- protocol -----------------------------------------------------------------------
    def _status(self, engine_id: str) -> dict[str, Any]:
        served, name = served_by(self.model())
        return {
            "generation": served.generation,
            "fence": served.fence,
            "incarnation": served.incarnation,
            "model_name": name,
        }

    def _describe(self, engine_id: str, boxes: bool = True) -> dict[str, Any]:
        """Placement: who this worker is and which checkpoint boxes land where (``boxes``:
        with the boxes; without, the digest still names them)."""
        state = self._state(engine_id)
        described = {
            "worker_id": state.apply.worker_id,
            "node": state.apply.settings.node,
            "segment": state.apply.store.local_segment,  # locality hints: the node's segment
            "gpu": self.gpu_id(),
            "device": str(self.device()),
            "host_id": this_host_id(),
            # A broadcast group outlives no process: a new one here means a new group.
            "process": PROCESS,
            # The coordinator refuses plans whose batches this cannot hold twice.
            "staging_watermark_bytes": state.apply.settings.staging_watermark_bytes,
            **self._described().served(*self.tp()),
        }
        return described if boxes else without_boxes(described)

    def gpu_id(self) -> str | None:
        """The physical GPU this rank runs on: its CUDA UUID, else the declared id
        (``MOONCAKE_RL_GPU_IDS``, one per rank), else ``None`` (topology unknown)."""
        found = gpu_uuid(self.device())
        if found is not None:
            return found
        declared = parse_gpu_ids(Settings().gpu_ids, "MOONCAKE_RL_GPU_IDS")
        rank = self.tp()[0]
        return declared[rank] if rank < len(declared) else None

    def device(self) -> torch.device:
        return next(self.model().parameters()).device

    def _prepare(self, engine_id: str, request: dict[str, Any]) -> dict[str, Any]:
        """Check the request against the Store, then allocate and register staging and
        advertise it for the session; live weights untouched.

        Everything that can refuse runs before the first allocation or registration.
        """
        state = self._state(engine_id)
        if isinstance(request, Mapping) and request.get("receive") is not None:
            return self._prepare_reception(engine_id, state, parsed(PrepareRequest, request))
        call, raw = prepare_request(request, state.apply.worker_id)
        try:
            worker_slice = decode_slice(raw["slice"])
        except (InvariantViolation, KeyError, TypeError) as error:
            raise RequestRefused(422, "malformed_slice", str(error)) from error
        if len(worker_slice.stages) > call.stages:
            raise RequestRefused(
                422,
                "too_many_stages",
                f"the routing slice has {len(worker_slice.stages)} stages, the update declares "
                f"{call.stages}: its last stages would never be applied",
            )
        in_place: dict[str, torch.Tensor] = {}
        if call.mode == "direct":
            self._check_direct(worker_slice, raw.get("placement_digest"))
            if call.in_place:
                live = self.in_place_parameters()
                in_place = {n: live[n] for n in worker_slice.regions if n in live}
        check_generation(state.apply.store, call)
        state.lease_update(engine_id, call)  # then check that what it protects is whole
        try:
            check_reads(state.apply.store, call.model, call.generation, worker_slice)
        except RequestRefused:
            state.end_lease()
            raise
        state.drop()  # this update replaces any pending one

        sizes = {n: b for n, b in worker_slice.regions.items() if n not in in_place}
        device = self.device()
        place = choose_staging(
            sum(sizes.values()),
            max((b.staging_bytes for s in worker_slice.stages for b in s), default=0),
            device,
            state.apply.settings.staging_budget_bytes,
            free_device_bytes(device),
        )
        arena_device = torch.device(place.device)
        if state.arena is None or state.sizes != sizes or state.arena.device != arena_device:
            arena, regions = allocate_arena(
                sizes, reuse=state.arena, device=arena_device, pin=place.pinned
            )
        else:
            arena, regions = state.arena, {n: state.apply.regions[n] for n in sizes}
        live_bytes = {n: t.view(-1).view(torch.uint8) for n, t in in_place.items()}
        live_regions = {n: region_of(n, flat) for n, flat in live_bytes.items()}
        # One covering for the arena and live parameters: on CUDA they may share segments.
        spans = covering_spans([region_of("arena", arena), *live_regions.values()])
        state.apply.prepare(
            spans, regions | live_regions, worker_slice.stages, worker_slice.checksums
        )
        state.arena, state.sizes = arena, sizes
        state.buffers = arena_views(arena, regions)
        state.canary = session_canary(call.session, call.generation)
        fill_canary(state.buffers.values(), state.canary)  # before peers learn of it
        state.buffers |= live_bytes
        state.in_place = in_place
        state.slice, state.mode = worker_slice, call.mode
        state.layout = raw.get("layout", [])
        state.fallback = raw.get("fallback", [])
        state.generation = call.generation
        state.record = ServedRecord(call.generation, call.fence, call.incarnation)
        state.session, state.stages, state.ran = call.session, call.stages, 0
        state.peers = PeerBook(state.apply.store, call.session)
        described = state.apply.describe()
        advertise(state.apply.store, call.session, described)
        fallback_bytes = sum(row["nbytes"] for row in state.fallback)
        planner = (STAGING_REGION, FALLBACK_REGION, COMPAT_REGION)
        direct_bytes = sum(n for r, n in worker_slice.regions.items() if r not in planner)
        in_place_bytes = sum(t.nbytes for t in in_place.values())
        return {
            **described,
            "direct_bytes": direct_bytes,
            "fallback_bytes": fallback_bytes,
            "in_place_bytes": in_place_bytes,
            "staged_bytes": sum(worker_slice.regions.values()) - in_place_bytes,
            "staging": place.to_json(),
        }

    def _prepare_reception(
        self, engine_id: str, state: _UpdateState, call: PrepareRequest
    ) -> dict[str, Any]:
        """A broadcast or CPU-serialized delivery: checked against the generation and
        leased, its buffer allocated; no Store or Transfer Engine registration, no
        advertisement."""
        assert call.receive is not None
        check_generation(state.apply.store, call)
        state.lease_update(engine_id, call)
        group = call.receive.group
        device = self.device() if group is not None and group.backend == "nccl" else None
        reception = prepare_reception(
            state.apply.store,
            call,
            self.tp()[0],
            state.received,
            device or torch.device("cpu"),
        )
        state.drop()
        state.reception, state.received = reception, reception.buffer
        state.mode, state.layout, state.fallback = "compat", reception.rows(), []
        state.buffers = {RECEIVED_REGION: reception.buffer}
        state.generation = call.generation
        state.record = ServedRecord(call.generation, call.fence, call.incarnation)
        state.session, state.stages, state.ran = call.session, call.stages, 0
        return {
            "worker_id": state.apply.worker_id,
            "transport": call.receive.transport,
            "rank": reception.rank,
            "received_bytes": reception.layout.total_bytes,
            "direct_bytes": 0,
            "fallback_bytes": 0,
            "in_place_bytes": 0,
            "staged_bytes": reception.layout.total_bytes,
        }

    def _check_direct(
        self,
        worker_slice: WorkerSlice,
        planned_for: str | None,
    ) -> None:
        """Direct mode lands bytes as they arrive: the slice must be planned for this
        worker's placement (``planned_for``: the digest the coordinator planned it for, which
        it may not have checked against the boxes), and every region must be this worker's,
        at its size and its parameter's dtype."""
        own = self._described().served(*self.tp())[PLACEMENT_DIGEST]
        if planned_for is not None and planned_for != own:
            raise RequestRefused(
                409,
                "placement_mismatch",
                f"the slice was planned for placement digest {planned_for}, but this worker's "
                f"placement hashes to {own}; re-read /mooncake/placement and plan again",
            )
        specs = {r.name: r for r in self.regions()[0]}
        # A reader that consumes none of a chunk holds it in the planner's staging region;
        # full tensors for the per-parameter fallback arrive in the fallback region.
        planner_regions = {STAGING_REGION, FALLBACK_REGION}
        unknown = sorted(set(worker_slice.regions) - set(specs) - planner_regions)
        if unknown:
            raise RequestRefused(
                409,
                "placement_mismatch",
                f"slice names regions this worker does not have: {unknown[:3]}; re-read "
                "/mooncake/placement and plan again",
            )
        for name, nbytes in worker_slice.regions.items():
            if name not in planner_regions and specs[name].nbytes != nbytes:
                raise RequestRefused(
                    409,
                    "placement_mismatch",
                    f"region {name} is {specs[name].nbytes} bytes, slice says {nbytes}",
                )
        for name, stored in worker_slice.region_dtypes.items():
            if name not in specs:
                raise RequestRefused(
                    409, "placement_mismatch", f"slice gives a dtype for {name}, no region here"
                )
            if stored not in ROLLOUT_DTYPES:
                raise RequestRefused(
                    422,
                    "unsupported_dtype",
                    f"{name} is stored as {stored}; direct mode lands only "
                    + ", ".join(ROLLOUT_DTYPES),
                )
            if specs[name].dtype != ROLLOUT_DTYPES[stored]:
                raise RequestRefused(
                    409,
                    "dtype_mismatch",
                    f"direct mode needs stored dtype {stored} to equal parameter dtype; "
                    f"{name} is {str(specs[name].dtype).removeprefix('torch.')}",
                )

    def _promote(self, engine_id: str) -> dict[str, Any]:
        self._state(engine_id).apply.promote()
        return {}

    def _apply(self, engine_id: str, request: dict[str, Any]) -> dict[str, Any]:
        """Check one stage and start it on the stage thread; ``collect`` takes its reply.

        The engine keeps stepping meanwhile (this call returns at once), which is what lets
        it serve while it stages: the stage writes only staging, or live parameters of an
        engine its session paused."""
        state = self._state(engine_id)
        call = apply_request(request)
        if state.running is not None and not state.running.done():
            raise RequestRefused(
                409, "stage_running", "the previous apply stage still runs; collect it first"
            )
        if not state.pending:
            raise RequestRefused(409, "not_prepared", "apply before prepare: nothing is staged")
        if (call.session, call.generation) != (state.session, state.generation):
            raise RequestRefused(
                409,
                "generation_mismatch",
                f"apply of generation {call.generation} in session {call.session}; prepared "
                f"generation {state.generation} in session {state.session}",
            )
        refusal = stage_refusal(call.stage, state.stages, state.ran)
        if refusal is not None:
            raise RequestRefused(*refusal)
        if state.reception is not None:
            run = functools.partial(self._receive, state, call.stage, call.bucket)
        else:
            assert state.slice is not None and state.peers is not None
            stages = state.slice.stages
            batches = stages[call.stage] if call.stage < len(stages) else ()
            given = {w: p.model_dump() for w, p in call.peers.items()}
            run = functools.partial(
                self._run_stage, state, batches, state.peers.trusted(batches, given)
            )
        state.running = state.stage_runner.submit(run)
        return {"started": call.stage}

    def _collect(self, engine_id: str) -> dict[str, Any]:
        """The last stage's reply once it ended (``running`` until then)."""
        state = self._state(engine_id)
        if state.running is None:
            raise RequestRefused(409, "not_running", "no apply stage runs: apply starts one")
        if not state.running.done():
            return {"running": True}
        return state.running.result()

    def run_stage_now(self, engine_id: str, request: dict[str, Any]) -> dict[str, Any]:
        """``apply`` and its ``collect`` in one reply, for a caller already off the engine's
        step loop (vLLM's native backend, inside the ``update_weights`` vLLM runs)."""
        started = self.call(engine_id, "apply", request)
        if not started.get("ok"):
            return started
        self._state(engine_id).settle(keep=True)
        return self.call(engine_id, "collect")

    def _run_stage(
        self, state: _UpdateState, batches: Sequence[Batch], peers: Mapping[str, Peer]
    ) -> dict[str, Any]:
        """One stage of the routing slice, in order (on the stage thread)."""
        before = COUNTERS.snapshot()
        started = time.perf_counter()
        result = state.apply.run_stage(batches, peers)
        state.ran += 1
        delta = COUNTERS.snapshot() - before
        return {
            "worker_id": state.apply.worker_id,
            "seconds": time.perf_counter() - started,
            "store_read_bytes": delta.store_read_bytes,
            "store_reread_bytes": delta.store_reread_bytes,
            "pushed_bytes": delta.te_pushed_bytes,
            "peak_staging_bytes": result.peak_staging_bytes,
            "verified_bytes": result.verified_bytes,
            "unverified_bytes": result.unverified_bytes,
            "verify_seconds": result.verify_seconds,
        }

    def _receive(
        self, state: _UpdateState, stage: int, bucket: BucketWire | None
    ) -> dict[str, Any]:
        """One stage of a broadcast (everything) or CPU-serialized (one bucket) delivery."""
        reception = state.reception
        assert reception is not None
        started = time.perf_counter()
        if reception.wire.transport == "broadcast":
            received = receive_broadcast(reception, state.apply.settings.hostname, state.membership)
        else:
            received = receive_bucket(reception, stage, bucket)
        state.ran += 1
        return {
            "worker_id": state.apply.worker_id,
            "transport": reception.wire.transport,
            "seconds": time.perf_counter() - started,
            "store_read_bytes": 0,
            "pushed_bytes": 0,
            **received,
        }

    def _require_landable(self, state: _UpdateState, generation: int) -> None:
        """Refuse a check or commit of anything but the prepared generation, fully applied."""
        if state.generation != generation or not state.pending:
            raise RequestRefused(
                409,
                "generation_mismatch",
                f"commit of generation {generation}, prepared {state.generation}",
            )
        if state.ran != state.stages:
            raise RequestRefused(
                409,
                "stages_incomplete",
                f"{state.ran} of {state.stages} stages ran; apply the rest first",
            )

    def _expect(self, engine_id: str, generation: int) -> dict[str, Any]:
        """Start building the post-landing check's reference on the stage thread, while the
        engine serves; ``collect`` takes its reply. Commit then pauses only to land and
        compare. Only after every engine's last stage (the coordinator commits then) is
        staging final: peers push into it until their own last stage ends."""
        state = self._state(engine_id)
        self._require_landable(state, generation)
        if state.running is not None and not state.running.done():
            raise RequestRefused(
                409, "stage_running", "an apply stage still runs; collect it first"
            )
        state.running = state.stage_runner.submit(self._build_check, state)
        return {"started": "expect"}

    def _build_check(self, state: _UpdateState) -> dict[str, Any]:
        state.check = self._landing_check(state)
        return {"worker_id": state.apply.worker_id, "seconds": state.check.seconds}

    def _commit(self, engine_id: str, generation: int) -> dict[str, Any]:
        """Swap the staged generation into the live model through the engine's own paths,
        then compare the live model with the check's reference (built now if ``expect``
        did not run)."""
        state = self._state(engine_id)
        self._require_landable(state, generation)
        state.settle(keep=True)
        # The reference and the comparison run on one thread (the stage thread): the check
        # compares GEMM outputs bit for bit, so nothing but the weights may differ.
        check = state.check or state.stage_runner.submit(self._landing_check, state).result()
        started = time.perf_counter()
        if state.mode == "compat":
            self.land_compat(staged_tensors(state.layout, state.buffers))
        else:
            staged = self.staged_parameters()
            self.land_direct(
                DirectLanding(
                    {n: t for n, t in staged.items() if n not in state.in_place},
                    staged_tensors(state.fallback, state.buffers),
                    frozenset(state.in_place),
                )
            )
        landed = time.perf_counter()
        compared = state.stage_runner.submit(self._compare, check).result()
        if compared["mismatched"]:
            raise LandingMismatch(
                f"generation {generation} did not land intact; the live model differs from a "
                f"fresh load in {compared['mismatched'][:5]}: never served, rebuild from the Store"
            )
        # What a receiver rebuilt on this engine (and its status) starts from.
        mark_served(self.model(), state.record)
        state.drop()
        state.end_lease((engine_id, generation))
        return {
            "seconds": time.perf_counter() - started,
            "land_seconds": landed - started,
            "verify": compared,
        }

    def _landing_check(self, state: _UpdateState) -> LandingCheck:
        """What every live parameter must hold once the staged generation landed; refused
        unless every staged byte that lands was written in the session."""
        if state.mode == "direct":
            # Bytes received in place were checked against the generation's checksums as
            # they were read; no landing step ran on them to compare.
            expected = {
                n: t for n, t in self.staged_parameters().items() if n not in state.in_place
            }
            uncovered = sorted(
                r.name
                for r in self.regions()[0]
                if r.name not in expected and r.name not in state.in_place
            )
            self._require_written(state)
            return self._reference(expected, uncovered, set(state.in_place))
        self._require_written(state)
        regions, shards = self.regions()
        full = dict(staged_tensors(state.layout, state.buffers))
        return self._reference(*assemble_regions(regions, shards, full))

    def _require_written(self, state: _UpdateState) -> None:
        """Refuse to land staging unless every byte that lands was written in the session
        (:mod:`engine_ext.written`)."""
        if state.canary is not None:
            left = unwritten(self._landed_spans(state), state.canary)
            if left:
                raise RequestRefused(
                    409,
                    "unwritten_staging",
                    f"{len(left)} staged tensors of generation {state.generation} hold bytes "
                    f"no read or push of session {state.session} wrote (e.g. {left[:3]}): the "
                    "plan does not deliver them; nothing landed, abort and update again with "
                    "a plan made by the coordinator",
                )

    def _landed_spans(self, state: _UpdateState) -> dict[str, torch.Tensor]:
        """The staged bytes commit lands: each direct box in its parameter's region (not
        the padding no box covers, nor parameters received in place), each full tensor of
        the compat or fallback layout."""
        rows = [*state.layout, *state.fallback]
        spans = {
            f"{row['region']}:{name}": tensor
            for row, (name, tensor) in zip(rows, staged_tensors(rows, state.buffers), strict=True)
        }
        if state.mode == "direct":
            regions, boxes = self.regions()
            itemsize = {r.name: r.dtype.itemsize for r in regions}
            for box in boxes:
                region = state.buffers.get(box.region)
                if region is None or box.region in state.in_place:
                    continue
                end = box.region_offset + math.prod(box.local_shape) * itemsize[box.region]
                spans[f"{box.region}@{box.region_offset}"] = region[box.region_offset : end]
        return spans

    def _reference(
        self,
        expected: Mapping[str, torch.Tensor],
        uncovered: Sequence[str],
        in_place: Collection[str] | None = None,
    ) -> LandingCheck:
        started = time.perf_counter()
        reference = self.expect_live(expected, in_place or ())
        return LandingCheck(
            reference,
            frozenset(expected),
            tuple(uncovered),
            None if in_place is None else len(in_place),
            time.perf_counter() - started,
        )

    def _compare(self, check: LandingCheck) -> dict[str, Any]:
        """The live model against ``check``; ``reference_seconds`` went to building it."""
        started = time.perf_counter()
        compared = self.compare_live(check.reference)
        result = {
            # Of the expected tensors; a parameter with none is unchecked beside them.
            "checked": len(check.expected - set(compared.unchecked)),
            "unchecked": sorted({*check.uncovered, *compared.unchecked}),
            "mismatched": compared.mismatched,
            "seconds": time.perf_counter() - started,
            "reference_seconds": check.seconds,
        }
        return result if check.in_place is None else {**result, "in_place": check.in_place}

    def _abort(self, engine_id: str) -> dict[str, Any]:
        if self._update is not None:
            self._update.drop()
            self._update.end_lease()
        return {}

    def _rebuild(self, engine_id: str, model_name: str) -> dict[str, Any]:
        """Reload the Store's active generation into the live model, as a fresh engine
        loads it (``--load-format mooncake``): leased first, every byte checked against the
        generation's checksums, landed through the engine's own loading path.

        Drops any pending update first. Each TP rank reads the full tensors and the model's
        ``load_weights`` cuts its shards, as the loader does; the landing is then checked
        like a commit's (the tensors are kept until then: one model's worth of host memory,
        on a path taken only to recover). Raises if loading or the check fails: the engine
        stays broken and the receiver tries again.
        """
        started = time.perf_counter()
        if self._update is not None:
            self._update.drop()
            self._update.end_lease()
        full: dict[str, torch.Tensor] = {}
        with store_weights(model_name, engine_id) as (record, tensors):
            self.land_compat(_kept(tensors, full))
        regions, shards = self.regions()
        check = self._compare(self._reference(*assemble_regions(regions, shards, full)))
        if check["mismatched"]:
            raise LandingMismatch(
                f"the rebuild of generation {record.generation} did not land intact; the live "
                f"model differs from a fresh load in {check['mismatched'][:5]}"
            )
        served = served_record(record)
        mark_served(self.model(), served, model_name)
        return {
            "generation": served.generation,
            "fence": served.fence,
            "incarnation": served.incarnation,
            "model_name": model_name,
            "seconds": time.perf_counter() - started,
            "verify": check,
        }

    # -- staged views ---------------------------------------------------------------------
    def staged_parameters(self) -> dict[str, torch.Tensor]:
        """Direct mode: every directly received parameter's bytes, as its dtype and shape.

        Raises before anything is landed if a parameter was neither staged nor left to the
        fallback (the plan sends full tensors only to workers it leaves parameters to).
        """
        assert self._update is not None
        buffers = self._update.buffers
        specs = {r.name: r for r in self.regions()[0]}
        missing = sorted(set(specs) - set(buffers))
        if missing and not self._update.fallback:
            raise ValueError(f"direct commit lacks staged parameters: {missing[:3]}")
        return {n: buffers[n].view(s.dtype).view(s.shape) for n, s in specs.items() if n in buffers}


def live_receivers(
    model: torch.nn.Module,
    regions: Sequence[RegionSpec],
    device: torch.device,
    excluded: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Live parameters laid out exactly as their regions (stored shape and dtype, dense,
    on ``device``, sharing no bytes with another region), by region name."""
    live = dict(model.named_parameters())
    found: dict[str, torch.Tensor] = {}
    taken: set[int] = set()
    for region in regions:
        tensor = live.get(region.name)
        if (
            region.name in excluded
            or tensor is None
            or tuple(tensor.shape) != region.shape
            or tensor.dtype != region.dtype
            or tensor.device != device
            or not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() in taken
        ):
            continue
        taken.add(tensor.untyped_storage().data_ptr())
        found[region.name] = tensor.data
    return found


@dataclass(frozen=True)
class DirectLanding:
    """What a direct-mode commit lands: the staged parameters (model format, by parameter
    name), the full checkpoint tensors of the parameters discovery could not describe (the
    fallback), and the parameters received in place, which already hold their new bytes
    and are left as they are."""

    staged: Mapping[str, torch.Tensor]
    fallback: Iterator[tuple[str, torch.Tensor]]
    in_place: frozenset[str]


@dataclass(frozen=True)
class LandingCheck:
    """The post-landing check's reference (:meth:`UpdateWorker.expect_live`), made from
    staging; ``seconds`` went to making it."""

    reference: Any
    expected: frozenset[str]
    uncovered: tuple[str, ...]
    in_place: int | None
    seconds: float


@dataclass(frozen=True)
class Comparison:
    """The live model against the generation: names that differ, names not comparable."""

    mismatched: list[str]
    unchecked: list[str]


class LandingMismatch(RuntimeError):
    """The live model does not hold the generation that commit landed."""


def same_bytes(live: torch.Tensor, expected: torch.Tensor) -> bool:
    """Exact equality in the live tensor's dtype (loaders cast the same way)."""
    return live.shape == expected.shape and torch.equal(live, expected.to(live.device, live.dtype))


def _kept(
    tensors: Iterator[tuple[str, torch.Tensor]], into: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors``, each also kept in ``into`` (for the check after landing)."""
    for name, tensor in tensors:
        into[name] = tensor
        yield name, tensor


def staged_tensors(
    layout: list[dict[str, Any]], buffers: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Compat mode: full checkpoint tensors as views into the staging region."""
    for entry in layout:
        buffer = buffers[entry["region"]]
        dtype = ROLLOUT_DTYPES[entry["dtype"]]
        nbytes = math.prod(entry["shape"]) * dtype.itemsize
        raw = buffer[entry["offset"] : entry["offset"] + nbytes]
        yield entry["name"], raw.view(dtype).view(entry["shape"])
