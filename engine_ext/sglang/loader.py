"""``--load-format mooncake`` for SGLang: start from the Store's active generation.

Only the config and tokenizer come from ``--model-path``; every weight is read from the Store
(``--model-loader-extra-config '{"name": "<model name>"}'``). The loader is SGLang's own
``DefaultModelLoader`` with the weight source replaced, so model construction, the model's
``load_weights`` (each TP rank cuts its shards) and post-load processing stay SGLang's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from sglang.srt.model_loader.loader import BaseModelLoader, DefaultModelLoader

from engine_ext.loading import mark_served, model_name_from, served_record, store_weights
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations.registry import ActiveRecord

logger = logging.getLogger(__name__)


class MooncakeModelLoader(DefaultModelLoader):
    def __init__(self, load_config: Any) -> None:
        # DefaultModelLoader's __init__ only vets disk-format options; ours names the model.
        BaseModelLoader.__init__(self, load_config)
        self.model_name = model_name_from(load_config.model_loader_extra_config)
        self.record: ActiveRecord | None = None

    def download_model(self, model_config: Any) -> None:
        """Nothing to download: weights live in the Store."""

    def _get_all_weights(
        self, model_config: Any, model: torch.nn.Module
    ) -> Iterator[tuple[str, torch.Tensor]]:
        with store_weights(self.model_name) as (record, tensors):
            self.record = record
            yield from tensors

    def load_model(self, *, model_config: Any, device_config: Any) -> torch.nn.Module:
        model = super().load_model(model_config=model_config, device_config=device_config)
        if self.record is None:
            raise ConfigurationError(
                "--load-format mooncake read no weights (ModelOpt loading is not supported)"
            )
        mark_served(model, served_record(self.record), self.model_name)
        logger.info(
            "mooncake: loaded %s generation %d from the Store",
            self.model_name,
            self.record.generation,
        )
        return model
