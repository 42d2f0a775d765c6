"""``mooncake_rl.Ext``: the vLLM worker extension (``--worker-extension-cls mooncake_rl.Ext``).

vLLM mixes this class into each worker, so ``self`` is the vLLM Worker. Every method is
prefixed ``mooncake_`` (vLLM refuses names that clash with the Worker's) and returns a
JSON-able dict with ``ok`` instead of raising: at TP >= 2 a raising ``collective_rpc``
leaves other ranks' replies queued and wedges the engine, so the API side checks each rank.

Updates stage bytes in worker-owned regions (registered once, reused across generations)
and touch live parameters only at commit, through vLLM's own reload paths:
``reload_weights`` with full checkpoint tensors (compat) or the layerwise reload that re-runs
vLLM's post-load processing (direct; on CPU this repacks linear weights).
"""

from __future__ import annotations

import functools
import math
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine_ext.vllm.placement import RegionSpec, describe_shards
from mooncake_rl.apply.wire import WorkerSlice, decode_slice
from mooncake_rl.apply.worker import (
    ApplyWorker,
    allocate_arena,
    arena_views,
    peers_from,
    region_of,
)
from mooncake_rl.counters import COUNTERS
from mooncake_rl.plan.demand import STAGING_REGION
from mooncake_rl.settings import Settings

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _reply(method: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return {"ok": True, "rank": self.rank, **method(self, *args, **kwargs)}
        except Exception as error:  # reported to the API server, which checks every rank
            return {
                "ok": False,
                "rank": self.rank,
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc()[-3000:],
            }

    return wrapper


class _UpdateState:
    """One worker's pending update: its data-plane endpoint and staged regions."""

    def __init__(self, worker_id: str) -> None:
        self.apply = ApplyWorker(Settings().with_overrides(segment_bytes=0), worker_id)
        self.arena: torch.Tensor | None = None
        self.sizes: dict[str, int] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.slice: WorkerSlice | None = None
        self.mode: str | None = None
        self.layout: list[dict[str, Any]] = []
        self.generation: int | None = None


class MooncakeWorkerExtension:
    """Mixed into vLLM's Worker; see the module docstring."""

    # -- helpers --------------------------------------------------------------------
    def _mooncake_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def _mooncake_state(self, engine_id: str) -> _UpdateState:
        state = getattr(self, "_mooncake_update", None)
        if state is None:
            from vllm.distributed import get_tensor_model_parallel_rank

            state = _UpdateState(f"{engine_id}/tp{get_tensor_model_parallel_rank()}")
            self._mooncake_update = state
        return state

    def _mooncake_regions(self) -> tuple[list[RegionSpec], list[Any]]:
        model = self._mooncake_model()
        return describe_shards(model, dict(getattr(model, "packed_modules_mapping", {})))

    # -- protocol -------------------------------------------------------------------
    @_reply
    def mooncake_status(self) -> dict[str, Any]:
        model = self._mooncake_model()
        return {
            "generation": int(getattr(model, "_mooncake_generation", 0)),
            "model_name": getattr(model, "_mooncake_model_name", None),
        }

    @_reply
    def mooncake_describe(self, engine_id: str) -> dict[str, Any]:
        """Placement: who this worker is and which checkpoint boxes land where."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        state = self._mooncake_state(engine_id)
        regions, shards = self._mooncake_regions()
        return {
            "worker_id": state.apply.worker_id,
            "node": state.apply.settings.node,
            "tp_rank": get_tensor_model_parallel_rank(),
            "tp_size": get_tensor_model_parallel_world_size(),
            "regions": {
                r.name: {"bytes": r.nbytes, "dtype": str(r.dtype).removeprefix("torch.")}
                for r in regions
            },
            "shards": [s.to_json() for s in shards],
        }

    @_reply
    def mooncake_prepare(
        self, engine_id: str, mode: str, generation: int, workers: dict[str, Any]
    ) -> dict[str, Any]:
        """Allocate and register staging, validate the slice; live weights untouched."""
        state = self._mooncake_state(engine_id)
        raw = workers.get(state.apply.worker_id)
        if raw is None:
            raise ValueError(f"no routing slice for worker {state.apply.worker_id}")
        worker_slice = decode_slice(raw["slice"])
        if mode == "direct":
            specs = {r.name: r for r in self._mooncake_regions()[0]}
            # A reader that consumes none of a chunk holds it in the planner's staging region.
            unknown = sorted(set(worker_slice.regions) - set(specs) - {STAGING_REGION})
            if unknown:
                raise ValueError(f"slice names regions this worker does not have: {unknown[:3]}")
            for name, nbytes in worker_slice.regions.items():
                if name != STAGING_REGION and specs[name].nbytes != nbytes:
                    raise ValueError(
                        f"region {name} is {specs[name].nbytes} bytes, slice says {nbytes}"
                    )
            for name, stored in raw["region_dtypes"].items():
                if specs[name].dtype != DTYPES[stored]:
                    raise ValueError(
                        f"direct mode needs stored dtype {stored} to equal parameter dtype; "
                        f"{name} is {str(specs[name].dtype).removeprefix('torch.')}"
                    )
        sizes = dict(worker_slice.regions)
        if state.arena is None or state.sizes != sizes:
            arena, regions = allocate_arena(sizes)  # kept across generations while unchanged
        else:
            arena, regions = state.arena, state.apply.regions
        state.apply.prepare(region_of("arena", arena), regions, worker_slice.stages)
        state.arena, state.sizes = arena, sizes
        state.buffers = arena_views(arena, regions)
        state.slice, state.mode = worker_slice, mode
        state.layout = raw.get("layout", [])
        state.generation = generation
        return state.apply.describe()

    @_reply
    def mooncake_promote(self, engine_id: str) -> dict[str, Any]:
        self._mooncake_state(engine_id).apply.promote()
        return {}

    @_reply
    def mooncake_apply(
        self, engine_id: str, stage: int, peers: list[dict[str, Any]]
    ) -> dict[str, Any]:
        state = self._mooncake_state(engine_id)
        if state.slice is None:
            raise RuntimeError("apply before prepare")
        before = COUNTERS.snapshot()
        started = time.perf_counter()
        batches = state.slice.stages[stage] if stage < len(state.slice.stages) else ()
        result = state.apply.run_stage(batches, peers_from(peers))
        delta = COUNTERS.snapshot() - before
        return {
            "worker_id": state.apply.worker_id,
            "seconds": time.perf_counter() - started,
            "store_read_bytes": delta.store_read_bytes,
            "pushed_bytes": delta.te_pushed_bytes,
            "peak_staging_bytes": result.peak_staging_bytes,
        }

    @_reply
    def mooncake_commit(self, engine_id: str, generation: int) -> dict[str, Any]:
        """Swap the staged generation into the live model through vLLM's reload paths."""
        state = self._mooncake_state(engine_id)
        if state.generation != generation or state.slice is None:
            raise RuntimeError(f"commit of generation {generation}, prepared {state.generation}")
        started = time.perf_counter()
        model = self._mooncake_model()
        if state.mode == "compat":
            self.reload_weights(weights_iterator=_staged_tensors(state))
        else:
            self._mooncake_reload_direct(state)
        model._mooncake_generation = generation
        state.slice, state.generation = None, None
        return {"seconds": time.perf_counter() - started}

    @_reply
    def mooncake_abort(self, engine_id: str) -> dict[str, Any]:
        state = self._mooncake_state(engine_id)
        state.apply.rollback()
        state.slice, state.generation = None, None
        return {}

    # -- direct-mode commit ---------------------------------------------------------
    def _mooncake_reload_direct(self, state: _UpdateState) -> None:
        """Land model-format staged tensors through vLLM's layerwise reload machinery."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            _copy_and_restore_kernel_tensors,
        )
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        model = self._mooncake_model()
        specs = {r.name: r for r in self._mooncake_regions()[0]}
        missing = sorted(set(specs) - set(state.buffers))
        if missing:
            raise ValueError(f"direct commit lacks staged parameters: {missing[:3]}")
        by_layer: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}
        for module_name, module in model.named_modules():
            info = LAYERWISE_INFO.get(module)
            if info is None:
                continue
            for param_name in info.restore_metadata[0]:
                full = f"{module_name}.{param_name}" if module_name else param_name
                spec = specs[full]
                staged = state.buffers[full].view(spec.dtype).view(spec.shape)
                by_layer.setdefault(module, {})[param_name] = staged
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            for layer, tensors in by_layer.items():
                info = LAYERWISE_INFO[layer]
                materialize_layer(layer, info)
                for param_name, tensor in tensors.items():
                    getattr(layer, param_name).data.copy_(tensor)
                method = getattr(layer, "quant_method", None)
                if isinstance(method, QuantizeMethodBase):
                    if hasattr(layer, "_already_called_process_weights_after_loading"):
                        delattr(layer, "_already_called_process_weights_after_loading")
                    method.process_weights_after_loading(layer)
                if info.kernel_tensors is not None:
                    _copy_and_restore_kernel_tensors(layer, info)
                info.reset()
            finalize_layerwise_reload(model, self.model_config)


def _staged_tensors(state: _UpdateState) -> Iterator[tuple[str, torch.Tensor]]:
    """Compat mode: full checkpoint tensors as views into the staging region."""
    for entry in state.layout:
        buffer = state.buffers[entry["region"]]
        dtype = DTYPES[entry["dtype"]]
        nbytes = math.prod(entry["shape"]) * dtype.itemsize
        raw = buffer[entry["offset"] : entry["offset"] + nbytes]
        yield entry["name"], raw.view(dtype).view(entry["shape"])


__all__ = ["MooncakeWorkerExtension"]
