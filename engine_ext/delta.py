"""A worker's side of a delta taken in place: prepare plans, apply fetches, commit scatters.

    prepare {delta: {base}, workers: {id: slice}} --refused unless this worker serves exactly
        ``base`` (same Store incarnation), every box is a live, checksummed unit
        (:func:`delta_reads`) and the slice fills exactly its entry buffer
        (:mod:`mooncake_rl.plan.delta`)--> the buffer allocated, registered, advertised
    apply (one stage, while the engine serves) --the slice: entries read from the Store once
        for every engine, pushed between workers--> every worker's entry buffer
    expect (still serving) --decode, each entry hash-checked--> the changes
    commit (the pause) --scatter--> live parameters --check--> each box against the
        generation's own checksum: the region holds N, exactly; a mismatch fails the commit
        and the engine rebuilds from the Store

Why the pause is only the scatter and its check: nothing before commit touches a live
parameter, so the engine serves the base while the entries travel and decode, as it does
while a full update stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine_ext.admission import (
    PeerBook,
    RequestRefused,
    advertise,
    check_generation,
    prepare_request,
)
from engine_ext.loading import served_by
from engine_ext.served import ServedRecord
from engine_ext.update_state import UpdateState
from engine_ext.worker_base import WorkerBase
from mooncake_rl.apply.delta import (
    DeltaChanges,
    DeltaRead,
    DeltaUnavailable,
    decode,
    land,
)
from mooncake_rl.apply.delta import delta_reads as plan_reads
from mooncake_rl.apply.wire import WorkerSlice, decode_slice
from mooncake_rl.apply.worker import region_of
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.chain import CorruptDelta, DeltaTable, load_delta_table
from mooncake_rl.generations.checksums import ObjectChecksum
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.plan.delta import DELTA_REGION, EntryBlock, entry_blocks, entry_offsets
from mooncake_rl.protocol import PrepareRequest


@dataclass(frozen=True)
class DeltaReception:
    """A prepared delta: the boxes it rewrites, the entry buffer and its layout, the table
    and checksums that prove the result, and (once decoded, before the pause) the changes."""

    reads: tuple[DeltaRead, ...]
    blocks: tuple[EntryBlock, ...]
    entries: torch.Tensor
    table: DeltaTable
    checksums: Mapping[str, ObjectChecksum]
    changes: DeltaChanges | None = None


class DeltaWorker(WorkerBase):
    """The worker's prepare, decode and landing of a delta generation taken in place."""

    def _prepare_delta(self, engine_id: str, state: UpdateState, request: Any) -> dict[str, Any]:
        call, raw = prepare_request(request, state.apply.worker_id)
        assert call.delta is not None
        served, _ = served_by(self.model())
        if (served.generation, served.incarnation) != (call.delta.base, call.incarnation):
            raise RequestRefused(
                409,
                "delta_base_mismatch",
                f"a delta against generation {call.delta.base} (incarnation "
                f"{call.incarnation}), but this worker serves generation {served.generation} "
                f"(incarnation {served.incarnation}): update it with the full path",
            )
        try:
            worker_slice = decode_slice(raw["slice"])
        except (InvariantViolation, KeyError, TypeError) as error:
            raise RequestRefused(422, "malformed_slice", str(error)) from error
        record = check_generation(state.apply.store, call)
        state.lease_update(engine_id, call)
        try:
            reads, table, checksums = self._delta_reads(state, call, record)
            blocks = entry_blocks(table, [(r.key, r.offset, r.length) for r in reads])
            _require_fills(worker_slice, blocks)
        except (DeltaUnavailable, CorruptDelta) as error:
            state.end_lease()
            raise RequestRefused(409, "delta_unavailable", str(error)) from error
        except RequestRefused:
            state.end_lease()
            raise
        state.drop()
        state.arena = None  # its regions are replaced: a later full update lays one out anew
        entries = torch.empty(worker_slice.regions[DELTA_REGION], dtype=torch.uint8)
        region = region_of(DELTA_REGION, entries)
        state.apply.prepare(region, {DELTA_REGION: region}, worker_slice.stages)
        live = self.in_place_parameters()
        state.delta = DeltaReception(tuple(reads), blocks, entries, table, checksums)
        state.slice, state.in_place = worker_slice, live
        state.buffers = {n: t.view(-1).view(torch.uint8) for n, t in live.items()}
        state.mode, state.layout, state.fallback, state.canary = "direct", [], [], None
        state.generation = call.generation
        state.record = ServedRecord(call.generation, call.fence, call.incarnation)
        state.session, state.stages, state.ran = call.session, call.stages, 0
        state.peers = PeerBook(state.apply.store, call.session)
        described = state.apply.describe()
        advertise(state.apply.store, call.session, described)
        return {
            **described,
            "delta_bytes": entry_offsets(blocks)[-1],
            "direct_bytes": sum(r.length for r in reads),
            "fallback_bytes": 0,
            # Nothing live is written before commit: the engine serves until it lands.
            "in_place_bytes": 0,
            "staged_bytes": entries.numel(),
        }

    def _delta_reads(
        self, state: UpdateState, call: PrepareRequest, record: Any
    ) -> tuple[list[DeltaRead], DeltaTable, Mapping[str, ObjectChecksum]]:
        store = state.apply.store
        table = load_delta_table(store, call.model, call.generation)
        if table is None or call.delta is None or table.base != call.delta.base:
            raise DeltaUnavailable(
                f"generation {call.generation} of {call.model} is not a delta against "
                f"generation {call.delta.base if call.delta else '?'}"
            )
        registry = GenerationRegistry(store, call.model)
        manifest = registry.load_manifest(call.generation, call.manifest_digest)
        digest = record.checksums_digest if record is not None else None
        if digest is None:
            raise DeltaUnavailable("a delta is taken only against a named active record (fence)")
        checksums = registry.load_checksums(call.generation, digest).objects
        boxes = self.regions()[1]
        reads = plan_reads(manifest, checksums, table, boxes, set(self.in_place_parameters()))
        return reads, table, checksums

    def _decode_delta(self, state: UpdateState) -> None:
        """Every stage ran (the engine still serves): decode the entry buffer, each entry
        hash-checked; one that was never delivered or arrived corrupt refuses the landing,
        and nothing live was touched."""
        delta = state.delta
        assert delta is not None
        try:
            changes = decode(delta.entries.numpy(), delta.blocks, delta.table, delta.reads)
        except CorruptDelta as error:
            raise RequestRefused(409, "corrupt_delta", str(error)) from error
        state.delta = replace(delta, changes=changes)

    def _land_delta(self, state: UpdateState) -> dict[str, Any]:
        """The landing of a delta (the engine paused): scatter the changes into the live
        parameters, then check every box against the generation's checksum; a mismatch
        fails the commit and the engine rebuilds from the Store."""
        delta = state.delta
        assert delta is not None and delta.changes is not None
        return land(delta.changes, delta.reads, state.buffers, delta.checksums)


def _require_fills(worker_slice: WorkerSlice, blocks: tuple[EntryBlock, ...]) -> None:
    """The slice must fill exactly this worker's entry buffer: planned for its boxes."""
    size = max(entry_offsets(blocks)[-1], 1)
    if dict(worker_slice.regions) != {DELTA_REGION: size} or len(worker_slice.stages) != 1:
        raise RequestRefused(
            409,
            "placement_mismatch",
            f"the delta slice fills {dict(worker_slice.regions)} in "
            f"{len(worker_slice.stages)} stages, but this worker's boxes need {size} bytes of "
            f"entries in {DELTA_REGION} in one stage; re-read /mooncake/placement and plan again",
        )
