"""SGLang glue for the shared worker protocol (:class:`engine_ext.worker.UpdateWorker`).

Shards are described from SGLang's own parameter attributes: the layer's
``tp_group``/``kv_tp_group`` (rank) and ``num_kv_head_replicas``, the parameter's
``output_dim``/``input_dim``, the layer's partition sizes, and the model's packed modules
(``packed_modules_mapping``, or the ``stacked_params_mapping`` its ``load_weights`` uses).
Commit lands bytes the way SGLang's own ``update_weights_from_tensor`` does: full tensors
through ``model.load_weights`` (compat) or per-rank parameters through
``default_weight_loader`` (its ``direct`` load format).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine_ext.placement import ParamRow, RegionSpec, describe_shards
from engine_ext.sglang.ipc import MooncakeRLReqInput, MooncakeRLReqOutput
from engine_ext.shards import ShardSpec
from engine_ext.worker import UpdateWorker
from engine_ext.worker_base import DirectLanding, live_receivers
from mooncake_rl.apply.landing import Landing

QKV_ORDER = {"q": 0, "k": 1, "v": 2}


def packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """Fused module leaf -> checkpoint sub-module leaves, in the fused layout's order."""
    mapping = getattr(model, "packed_modules_mapping", None)
    if mapping:
        return {fused: list(subs) for fused, subs in mapping.items()}
    ordered: dict[str, list[tuple[int, str]]] = {}
    for fused, sub, shard_id, *_ in getattr(model, "stacked_params_mapping", ()):
        position = QKV_ORDER.get(shard_id, shard_id)
        ordered.setdefault(fused.strip("."), []).append((int(position), sub.strip(".")))
    return {fused: [sub for _, sub in sorted(subs)] for fused, subs in ordered.items()}


def parameter_rows(model: torch.nn.Module) -> Iterator[ParamRow]:
    """Every live parameter (SGLang keeps checkpoint layout) with its owning layer."""
    for full, parameter in model.named_parameters():
        module_name, _, param_name = full.rpartition(".")
        yield full, model.get_submodule(module_name), param_name, parameter


def rank_of(layer: torch.nn.Module, sub: int) -> int:
    """This rank's box index: query heads follow ``tp_group``, key/value ``kv_tp_group``."""
    from sglang.srt.distributed.utils import get_group_rank_size

    rank, _ = get_group_rank_size(getattr(layer, "tp_group", None))
    if sub == 0 or not hasattr(layer, "kv_tp_group"):
        return rank
    kv_rank, _ = get_group_rank_size(layer.kv_tp_group)
    return kv_rank // int(getattr(layer, "num_kv_head_replicas", 1) or 1)


class SglangUpdateWorker(UpdateWorker):
    """The shared worker protocol bound to one SGLang TP rank's model."""

    def __init__(self, model: Callable[[], torch.nn.Module]) -> None:
        self._model = model

    def model(self) -> torch.nn.Module:
        return self._model()

    def tp(self) -> tuple[int, int]:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return int(parallel.tp_rank), int(parallel.tp_size)

    def describe_regions(self) -> tuple[list[RegionSpec], list[ShardSpec]]:
        model = self.model()
        return describe_shards(parameter_rows(model), packed_modules(model), rank_of)

    def land_compat(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.model().load_weights(tensors)

    def in_place_parameters(self) -> dict[str, torch.Tensor]:
        """SGLang serves checkpoint layout, except layers it repacked for Intel AMX."""
        model = self.model()
        repacked = {
            f"{name}.{param}"
            for name, layer in model.named_modules()
            if getattr(layer, "use_intel_amx_backend", False)
            for param in layer._parameters
        }
        return live_receivers(model, self.regions()[0], self.device(), repacked)

    def land_direct(self, landing: DirectLanding) -> None:
        """What SGLang's ``direct`` load format does (a plain copy per parameter, no
        post-load processing), as one batched landing: a MoE rank stages thousands of
        parameters, and a copy call per parameter costs more than its bytes. The landing is
        planned (and every pair checked) before the fallback touches the live model; the
        fallback goes through ``load_weights``."""
        params = dict(self.model().named_parameters())
        planned = Landing.of((params[n], tensor) for n, tensor in landing.staged.items())
        self.model().load_weights(landing.fallback)
        planned.run()


def handle_request(scheduler: Any, request: MooncakeRLReqInput) -> MooncakeRLReqOutput:
    """Scheduler-side handler: every TP rank runs the call; rank order replies go back.

    SGLang hands control requests to every TP rank of the scheduler, but only the entry
    rank answers the API process, so replies are gathered over the TP CPU group.
    """
    worker = getattr(scheduler, "_mooncake_worker", None)
    if worker is None:
        worker = scheduler._mooncake_worker = SglangUpdateWorker(
            lambda: scheduler.tp_worker.model_runner.model
        )
    reply = worker.call(request.engine_id, request.method, *json.loads(request.args))
    tp_size = worker.tp()[1]
    replies: list[Any] = [reply]
    if tp_size > 1:
        replies = [None] * tp_size
        torch.distributed.all_gather_object(replies, reply, group=scheduler.tp_cpu_group)
    return MooncakeRLReqOutput(replies=json.dumps(replies))
