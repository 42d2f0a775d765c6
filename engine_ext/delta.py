"""A worker's side of a delta taken in place: prepare fetches, apply scatters and checks.

    prepare {delta: {base}} --refused unless this worker serves exactly ``base`` (same Store
        incarnation) and every box is a live, checksummed unit (:func:`delta_reads`)-->
        the blocks' entries read and decoded while the engine serves (:func:`fetch`)
    apply (stage 0, the engine paused: live parameters are written) --scatter--> live
        parameters --check--> each box against the generation's own checksum
    commit: the usual landing, every parameter received in place

Why the engine pauses at prepare's end, as for in-place receive: the scatter writes live
weights, and a failure after it leaves the engine broken, rebuilt from the Store, never
serving a mix. The fetch before the pause is what keeps the pause to the scatter.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine_ext.admission import RequestRefused, check_generation, parsed
from engine_ext.loading import served_by
from engine_ext.served import ServedRecord
from engine_ext.update_state import UpdateState
from engine_ext.worker_base import WorkerBase
from mooncake_rl.apply.delta import DeltaChanges, DeltaRead, DeltaUnavailable, check, fetch, scatter
from mooncake_rl.apply.delta import delta_reads as plan_reads
from mooncake_rl.generations.chain import CorruptDelta, load_delta_table
from mooncake_rl.generations.checksums import ObjectChecksum
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.protocol import PrepareRequest


@dataclass(frozen=True)
class DeltaReception:
    """A prepared delta: the boxes it rewrites, the changes fetched, the checksums that
    prove the result."""

    reads: tuple[DeltaRead, ...]
    changes: DeltaChanges
    checksums: Mapping[str, ObjectChecksum]


class DeltaWorker(WorkerBase):
    """The worker's prepare and apply of a delta generation taken in place."""

    def _prepare_delta(self, engine_id: str, state: UpdateState, request: Any) -> dict[str, Any]:
        call = parsed(PrepareRequest, request)
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
        record = check_generation(state.apply.store, call)
        state.lease_update(engine_id, call)
        try:
            changes, reads, checksums = self._fetch_delta(state, call, record)
        except (DeltaUnavailable, CorruptDelta) as error:
            state.end_lease()
            code = "corrupt_delta" if isinstance(error, CorruptDelta) else "delta_unavailable"
            raise RequestRefused(409, code, str(error)) from error
        state.drop()
        live = self.in_place_parameters()
        state.delta = DeltaReception(tuple(reads), changes, checksums)
        state.in_place = live
        state.buffers = {n: t.view(-1).view(torch.uint8) for n, t in live.items()}
        state.mode, state.layout, state.fallback, state.canary = "direct", [], [], None
        state.generation = call.generation
        state.record = ServedRecord(call.generation, call.fence, call.incarnation)
        state.session, state.stages, state.ran = call.session, call.stages, 0
        return {
            "worker_id": state.apply.worker_id,
            "delta_bytes": changes.entry_bytes,
            "changed_bytes": changes.changed_bytes,
            "direct_bytes": sum(r.length for r in reads),
            "fallback_bytes": 0,
            "in_place_bytes": sum(t.nbytes for t in live.values()),
            "staged_bytes": 0,
        }

    def _fetch_delta(
        self, state: UpdateState, call: PrepareRequest, record: Any
    ) -> tuple[DeltaChanges, list[DeltaRead], Mapping[str, ObjectChecksum]]:
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
        return fetch(store, table, reads), reads, checksums

    def _apply_delta(self, state: UpdateState) -> dict[str, Any]:
        """Stage 0 of a delta (on the stage thread, the engine paused): scatter, then check
        every box against the generation's checksum; a mismatch fails the stage."""
        delta = state.delta
        assert delta is not None
        started = time.perf_counter()
        written = scatter(delta.changes, state.buffers)
        if state.buffers and next(iter(state.buffers.values())).is_cuda:
            torch.cuda.synchronize()
        scattered = time.perf_counter()
        checked = check(delta.reads, state.buffers, delta.checksums)
        state.ran += 1
        return {
            "worker_id": state.apply.worker_id,
            "seconds": time.perf_counter() - started,
            "scatter_seconds": scattered - started,
            "store_read_bytes": delta.changes.entry_bytes,
            "pushed_bytes": 0,
            "written_bytes": written,
            "verified_bytes": checked,
            "unverified_bytes": 0,
        }
