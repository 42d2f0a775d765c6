"""A worker's apply stages: each checked, started on the stage thread, collected when done.

``apply`` checks one stage against the prepared update (its session, its generation, the
stage order) and starts it on the worker's stage thread, then returns at once, so the
engine keeps stepping (and serving) while the stage moves bytes; ``collect`` answers with
the stage's reply once it ended. A stage of a routing slice reads the Store and pushes to
the peers that advertised themselves for the session (:class:`~engine_ext.admission.PeerBook`);
a stage of a broadcast or CPU-serialized delivery receives into the reception buffer
(:mod:`engine_ext.transport`). Stages write only staging, or live parameters of an engine
its session paused.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine_ext.admission import RequestRefused, apply_request
from engine_ext.transport import receive_broadcast, receive_bucket
from engine_ext.update_state import UpdateState
from engine_ext.worker_base import WorkerBase
from mooncake_rl.apply.executor import Batch, Peer
from mooncake_rl.counters import COUNTERS
from mooncake_rl.protocol import BucketWire, stage_refusal


class ApplyingWorker(WorkerBase):
    """The worker's ``apply`` and ``collect``, and the stages they run."""

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
                self._run_stage,
                state,
                batches,
                state.peers.trusted(batches, given, state.apply.worker_id),
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

    def _run_stage(
        self, state: UpdateState, batches: Sequence[Batch], peers: Mapping[str, Peer]
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

    def _receive(self, state: UpdateState, stage: int, bucket: BucketWire | None) -> dict[str, Any]:
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
