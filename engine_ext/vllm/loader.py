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

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations.catalog import rollout_dtype
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

logger = logging.getLogger(__name__)
LOAD_FORMAT = "mooncake"


def model_name_from(extra_config: dict[str, Any] | None) -> str:
    name = (extra_config or {}).get("name")
    if not name:
        raise ConfigurationError(
            '--load-format mooncake needs --model-loader-extra-config \'{"name": "<model>"}\''
        )
    return str(name)


def active_weights(
    store: StoreClient, model: str
) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """The active generation number and its tensors, read one object at a time."""
    registry = GenerationRegistry(store, model)
    record = registry.active()
    if record is None:
        raise ConfigurationError(f"model {model!r} has no active generation in the Store")
    manifest = registry.load_manifest(record.generation, record.manifest_digest)
    specs = {t.tensor_id: t for t in manifest.tensors}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for fragment in manifest.fragments:
            spec = specs[fragment.tensor_id]
            data = bytearray(store.get_bytes(fragment.object_key))
            yield (
                spec.tensor_id,
                torch.frombuffer(data, dtype=rollout_dtype(spec.dtype)).view(spec.global_shape),
            )

    return record.generation, tensors()


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
            with StoreClient(Settings().with_overrides(segment_bytes=0)) as store:
                _, tensors = active_weights(store, self.model_name)
                yield from tensors

        def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
            with StoreClient(Settings().with_overrides(segment_bytes=0)) as store:
                generation, tensors = active_weights(store, self.model_name)
                loaded = model.load_weights(tensors)
            expected = {name for name, _ in model.named_parameters()}
            if loaded is not None and (missing := expected - set(loaded)):
                raise ConfigurationError(
                    f"generation {generation} lacks weights for {sorted(missing)[:5]}"
                )
            model._mooncake_generation = generation
            model._mooncake_model_name = self.model_name
            logger.info(
                "mooncake: loaded %s generation %d from the Store", self.model_name, generation
            )

    register_model_loader(LOAD_FORMAT)(MooncakeModelLoader)
