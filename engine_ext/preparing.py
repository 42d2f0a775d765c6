"""A worker's prepare: the request checked, its generation leased, staging made ready.

The request is checked first (its routing slice decoded and, in direct mode, matched with
this worker's placement; its generation and every read it plans checked against the
Store, :mod:`engine_ext.admission`), with the update lease written between the two, so
that a refusal leaves nothing behind. Then staging is placed (device or pinned host,
:mod:`engine_ext.staging`), allocated or reused, registered beside any live parameters
that receive in place, filled with the session's canary (:mod:`engine_ext.written`) and
advertised for the session's peers; once every rank prepared, ``promote`` keeps its
registrations for later updates. A broadcast or CPU-serialized delivery gets a reception
buffer instead: nothing registered, nothing advertised. Live weights are never touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from engine_ext.adapting import AdaptingWorker
from engine_ext.admission import (
    PeerBook,
    RequestRefused,
    advertise,
    check_generation,
    check_reads,
    parsed,
    prepare_request,
)
from engine_ext.delta import DeltaWorker
from engine_ext.served import ServedRecord
from engine_ext.staging import choose_staging, free_device_bytes
from engine_ext.transport import RECEIVED_REGION, prepare_reception
from engine_ext.update_state import UpdateState
from engine_ext.written import fill_canary, session_canary
from mooncake_rl.apply.wire import WorkerSlice, decode_slice
from mooncake_rl.apply.worker import (
    allocate_arena,
    arena_views,
    copied_into_order,
    covering_spans,
    region_of,
)
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import ROLLOUT_DTYPES
from mooncake_rl.plan.demand import COMPAT_REGION, FALLBACK_REGION, STAGING_REGION
from mooncake_rl.protocol import PLACEMENT_DIGEST, PrepareRequest


class PreparingWorker(DeltaWorker, AdaptingWorker):
    """The worker's ``prepare`` and, once every rank prepared, ``promote``."""

    def _prepare(self, engine_id: str, request: dict[str, Any]) -> dict[str, Any]:
        """Check the request against the Store, then allocate and register staging and
        advertise it for the session; live weights untouched.

        Everything that can refuse runs before the first allocation or registration.
        """
        state = self._state(engine_id)
        if isinstance(request, Mapping) and request.get("receive") is not None:
            return self._prepare_reception(engine_id, state, parsed(PrepareRequest, request))
        if isinstance(request, Mapping) and request.get("delta") is not None:
            return self._prepare_delta(engine_id, state, request)
        if isinstance(request, Mapping) and request.get("adapter"):
            return self._prepare_adapter(engine_id, state, request)
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
        order = copied_into_order(worker_slice.stages, state.apply.worker_id)
        if (
            state.arena is None
            or (state.sizes, state.order) != (sizes, order)
            or state.arena.device != arena_device
        ):
            arena, regions = allocate_arena(
                sizes, reuse=state.arena, device=arena_device, pin=place.pinned, order=order
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
        state.arena, state.sizes, state.order = arena, sizes, order
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

    def _promote(self, engine_id: str) -> dict[str, Any]:
        """Every rank prepared: this prepare's registrations are kept across updates."""
        self._state(engine_id).apply.promote()
        return {}

    def _prepare_reception(
        self, engine_id: str, state: UpdateState, call: PrepareRequest
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
