"""``--load-format mooncake``: start a vLLM engine from the Store's active generation.

Only the config and tokenizer come from the local model directory; every weight is read
from the Store (``--model-loader-extra-config '{"name": "<model name>"}'``), so a restarted
or newly added engine serves the current policy without any republish. Each TP rank reads
the full tensors and lets vLLM's weight loaders cut its shards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from engine_ext.loading import (
    LOAD_FORMAT,
    mark_served,
    model_name_from,
    served_record,
    store_weights,
)
from mooncake_rl.errors import ConfigurationError

logger = logging.getLogger(__name__)


def register() -> None:
    """``vllm.general_plugins`` entry point: runs in every vLLM process."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    class MooncakeModelLoader(BaseModelLoader):
        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.model_name = model_name_from(load_config.model_loader_extra_config)

        def download_model(self, model_config: Any) -> None:
            """Nothing to download: weights live in the Store."""

        def get_all_weights(
            self, model_config: Any, model: torch.nn.Module
        ) -> Iterator[tuple[str, torch.Tensor]]:
            with store_weights(self.model_name) as (_, tensors):
                yield from tensors

        def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
            with store_weights(self.model_name) as (record, tensors):
                loaded = model.load_weights(tensors)
            generation = record.generation
            if loaded is not None:
                _require_every_weight(model, set(loaded), model_config, generation)
            mark_served(model, served_record(record), self.model_name)
            logger.info(
                "mooncake: loaded %s generation %d from the Store", self.model_name, generation
            )

    register_model_loader(LOAD_FORMAT)(MooncakeModelLoader)


def _require_every_weight(
    model: torch.nn.Module, loaded: set[str], model_config: Any, generation: int
) -> None:
    """Refuse a generation that leaves a parameter unfilled.

    Unquantized: every parameter. Quantized: vLLM's own check for quantized checkpoints,
    which spares what a checkpoint cannot carry (KV-cache scales such as an fp8
    attention's ``k_scale``, which fall back to defaults, and online quantization)."""
    if model_config.quantization is None:
        missing = {name for name, _ in model.named_parameters()} - loaded
        if missing:
            raise ConfigurationError(
                f"generation {generation} lacks weights for {sorted(missing)[:5]}"
            )
        return
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    try:
        DefaultModelLoader(LoadConfig()).track_weights_loading(model, loaded, quantized=True)
    except ValueError as error:
        raise ConfigurationError(f"generation {generation} lacks weights: {error}") from error
