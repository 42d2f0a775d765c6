"""A worker's side of a LoRA adapter generation, in the same session as weights.

    prepare {adapter: true, model: POLICY, generation: G} (the engine serves) --the record
        is exactly the Store's active one, leased--> the adapter read (every object checked),
        refused unless it binds the base this worker serves and fits the engine's LoRA
        config --> the engine's own adapter object, and the reference it must equal once
        resident (a second, fresh build)
    commit (the pause) --the engine's LoRA manager--> resident under G's id --the
        post-landing check: the resident adapter against the reference--> the update lease
        moves to the serving lease of G; a mismatch fails the commit

The base weights are never touched: a failed adapter commit costs the adapter, not the
base (the receiver evicts what it made resident and keeps serving). The engine's hooks
(:meth:`AdaptingWorker.build_adapter`, :meth:`AdaptingWorker.land_adapter`,
:meth:`AdaptingWorker.resident_adapter`) are what vLLM's or SGLang's worker supplies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_ext.admission import RequestRefused, check_generation, parsed
from engine_ext.loading import served_by
from engine_ext.served import ServedRecord
from engine_ext.update_state import UpdateState
from engine_ext.worker_base import LandingMismatch, WorkerBase
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations.registry import require_active
from mooncake_rl.protocol import PrepareRequest
from mooncake_rl.store import StoreClient


@dataclass(frozen=True)
class BuiltAdapter:
    """An adapter generation as the engine will hold it: ``adapter`` goes resident,
    ``digest`` is a fresh build's, which the resident one must equal."""

    generation: int
    adapter: Any
    digest: str
    nbytes: int


class AdaptingWorker(WorkerBase):
    """The worker's prepare and commit of an adapter generation, and its one-call load (at
    start, ``POST /mooncake/adapter``); engines with a LoRA manager supply the hooks."""

    # -- the engine's hooks -------------------------------------------------------------
    def build_adapter(
        self, store: StoreClient, model: str, generation: int, serves: tuple[str, int]
    ) -> BuiltAdapter:
        """Read and check generation ``generation`` of adapter ``model`` and build it for
        this engine, refused (``ConfigurationError``, naming why) unless it binds ``serves``
        (base name, generation) and fits the engine's LoRA config."""
        raise self._no_lora()

    def land_adapter(self, built: BuiltAdapter) -> None:
        """Make ``built`` resident in the engine's LoRA manager."""
        raise self._no_lora()

    def resident_adapter(self, generation: int) -> str | None:
        """The digest of the adapter resident under ``generation`` (None: none is)."""
        raise self._no_lora()

    def evict_adapter(self, generation: int) -> list[int]:
        """Drop the adapter resident under ``generation``; the generations left."""
        raise self._no_lora()

    def _no_lora(self) -> Exception:
        return RequestRefused(
            409,
            "lora_unsupported",
            f"{type(self).__name__} does not load LoRA adapters from the Store (vLLM's and "
            "SGLang's workers do, docs/lora.md)",
        )

    # -- the session's steps ------------------------------------------------------------
    def _prepare_adapter(self, engine_id: str, state: UpdateState, request: Any) -> dict[str, Any]:
        call = parsed(PrepareRequest, request)
        check_generation(state.apply.store, call)
        state.lease_update(engine_id, call)
        try:
            built, serves = self._built(state.apply.store, call.model, call.generation)
        except RequestRefused:
            state.end_lease()
            raise
        state.drop()
        state.adapter, state.mode = built, "adapter"
        state.generation = call.generation
        state.record = ServedRecord(call.generation, call.fence, call.incarnation)
        state.session, state.stages, state.ran = call.session, 0, 0
        return {
            "worker_id": state.apply.worker_id,
            "adapter_bytes": built.nbytes,
            "base": list(serves),
            "direct_bytes": 0,
            "fallback_bytes": 0,
            "in_place_bytes": 0,
            "staged_bytes": built.nbytes,
        }

    def _commit_adapter(self, engine_id: str, state: UpdateState) -> dict[str, Any]:
        """Land the prepared adapter and check it; the update lease becomes the serving
        lease of its generation."""
        built = state.adapter
        assert built is not None
        self._land_checked(built)
        state.drop()
        state.end_lease((engine_id, built.generation))
        return {"adapter_generation": built.generation, "verify": {"adapter": "resident"}}

    # -- one call ------------------------------------------------------------------------
    def _adapter(self, engine_id: str, model: str, generation: int | None) -> dict[str, Any]:
        """Make generation ``generation`` (None: the Store's active one) of adapter ``model``
        resident and check it, outside any session: an engine starting, or an operator."""
        store = self.store(engine_id)
        fence = 0
        if generation is None:
            try:
                active = require_active(store, model, "no adapter to load")
            except ConfigurationError as refused:
                raise RequestRefused(409, "adapter_refused", str(refused)) from refused
            generation, fence = active.generation, active.fence
        built, serves = self._built(store, model, generation)
        self._land_checked(built)
        return {
            "adapter": model,
            "generation": generation,
            "fence": fence,
            "base": list(serves),
            "adapter_bytes": built.nbytes,
        }

    def _evict_adapter(self, engine_id: str, generation: int) -> dict[str, Any]:
        return {"resident": self.evict_adapter(generation)}

    def _built(
        self, store: StoreClient, model: str, generation: int
    ) -> tuple[BuiltAdapter, tuple[str, int]]:
        """The adapter built, and the base it is bound to: the one this worker serves."""
        served, name = served_by(self.model())
        serves = (name or "", served.generation)
        try:
            return self.build_adapter(store, model, generation, serves), serves
        except ConfigurationError as refused:
            raise RequestRefused(409, "adapter_refused", str(refused)) from refused

    def _land_checked(self, built: BuiltAdapter) -> None:
        self.land_adapter(built)
        resident = self.resident_adapter(built.generation)
        if resident != built.digest:
            self.evict_adapter(built.generation)
            raise LandingMismatch(
                f"adapter generation {built.generation} is not resident as a fresh build of it "
                f"(digest {resident}, expected {built.digest}): evicted, never served"
            )
