"""``mooncake_rl.Ext``: the vLLM worker extension (``--worker-extension-cls mooncake_rl.Ext``).

vLLM mixes this class into each worker, so ``self`` is the vLLM Worker. Its one method,
``mooncake_call`` (vLLM refuses names that clash with the Worker's), runs the shared
:class:`engine_ext.worker.UpdateWorker` protocol. Live parameters change only at commit,
through vLLM's own reload paths: ``reload_weights`` with full checkpoint tensors (compat) or
the layerwise reload that re-runs vLLM's post-load processing (direct; on CPU this repacks
linear weights).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from engine_ext.placement import RegionSpec
from engine_ext.shards import ShardSpec
from engine_ext.vllm.placement import describe_vllm_shards
from engine_ext.worker import UpdateWorker


class VllmUpdateWorker(UpdateWorker):
    """The shared worker protocol bound to one vLLM Worker."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def model(self) -> torch.nn.Module:
        return self.worker.model_runner.get_model()

    def tp(self) -> tuple[int, int]:
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def regions(self) -> tuple[list[RegionSpec], list[ShardSpec]]:
        return describe_vllm_shards(self.model())

    def land_compat(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.worker.reload_weights(weights_iterator=tensors)

    def land_direct(self, staged: Mapping[str, torch.Tensor]) -> None:
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

        model = self.model()
        by_layer: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}
        for module_name, module in model.named_modules():
            info = LAYERWISE_INFO.get(module)
            if info is None:
                continue
            for param_name in info.restore_metadata[0]:
                full = f"{module_name}.{param_name}" if module_name else param_name
                by_layer.setdefault(module, {})[param_name] = staged[full]
        with set_current_vllm_config(self.worker.vllm_config), torch.no_grad():
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
            finalize_layerwise_reload(model, self.worker.model_config)


class MooncakeWorkerExtension:
    """Mixed into vLLM's Worker; see the module docstring."""

    def mooncake_call(self, engine_id: str, method: str, *args: Any) -> dict[str, Any]:
        updater = getattr(self, "_mooncake_updater", None)
        if updater is None:
            updater = self._mooncake_updater = VllmUpdateWorker(self)
        return updater.call(engine_id, method, *args)


__all__ = ["MooncakeWorkerExtension"]
