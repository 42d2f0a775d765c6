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

Here: the one entry point (:meth:`UpdateWorker.call`), status, placement and abort. The
steps live beside it, each a :class:`~engine_ext.worker_base.WorkerBase` subclass that
:class:`UpdateWorker` combines: :mod:`engine_ext.preparing`, :mod:`engine_ext.applying`,
:mod:`engine_ext.landing`; the pending update they share is
:class:`~engine_ext.update_state.UpdateState`.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from engine_ext.admission import RequestRefused
from engine_ext.applying import ApplyingWorker
from engine_ext.landing import LandingWorker
from engine_ext.loading import served_by
from engine_ext.preparing import PreparingWorker
from engine_ext.transport import PROCESS
from engine_ext.worker_base import DirectLanding
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.protocol import without_boxes
from mooncake_rl.settings import Settings
from mooncake_rl.transport.buckets import this_host_id
from mooncake_rl.transport.group import gpu_uuid
from mooncake_rl.transport.modes import parse_gpu_ids

__all__ = ["METHODS", "DirectLanding", "UpdateWorker"]

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
    "adapter",
    "evict_adapter",
)


class UpdateWorker(PreparingWorker, ApplyingWorker, LandingWorker):
    """Engine-neutral worker logic; subclasses supply the model, ranks and landing paths."""

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

    def run_stage_now(self, engine_id: str, request: dict[str, Any]) -> dict[str, Any]:
        """``apply`` and its ``collect`` in one reply, for a caller already off the engine's
        step loop (vLLM's native backend, inside the ``update_weights`` vLLM runs)."""
        started = self.call(engine_id, "apply", request)
        if not started.get("ok"):
            return started
        self._state(engine_id).settle(keep=True)
        return self.call(engine_id, "collect")

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
            # Whether a delta can be taken in place here: every region a live receiver.
            "in_place_all": {r.name for r in self.regions()[0]} <= set(self.in_place_parameters()),
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

    def _abort(self, engine_id: str) -> dict[str, Any]:
        if self._update is not None:
            self._update.drop()
            self._update.end_lease()
        return {}
