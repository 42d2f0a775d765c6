"""vLLM's side of a LoRA generation: from the Store into the worker's own LoRA manager.

    the Store: an adapter generation's record and tensors (every object checked against its
        checksum, :func:`mooncake_rl.generations.weights.generation_weights`)
    --refused unless it binds the base this engine serves--> vLLM's ``PEFTHelper`` checked
        against the engine's LoRA config (rank, modules) --> ``LoRAModel.from_lora_tensors``
    --make_resident--> added to the worker's adapter manager and pinned: requests naming it
        (``LoRARequest`` with id :func:`adapter_id`) find it loaded, so vLLM never reads its
        ``lora_path``; ``evict`` unpins and removes it

Why not vLLM's path loading: an adapter here has no local directory, and the manager's
``add_adapter`` skips loading any id it already holds. Pinned, the LRU never drops it for
a path that does not exist. The base weights are never touched.
"""

from __future__ import annotations

from typing import Any

import torch
import xxhash

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations.lora import AdapterRecord, load_adapter_record
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.generations.weights import generation_weights
from mooncake_rl.store import StoreClient

ADAPTER_PATH = "mooncake://{model}/{generation}"
"""What a ``LoRARequest`` names as its path: never read (the adapter is resident)."""


def adapter_id(generation: int) -> int:
    """The ``lora_int_id`` of one adapter generation (vLLM needs it >= 1 and unique)."""
    return generation


def adapter_path(model: str, generation: int) -> str:
    return ADAPTER_PATH.format(model=model, generation=generation)


def read_adapter_generation(
    store: StoreClient, model: str, generation: int, serves: tuple[str, int]
) -> tuple[AdapterRecord, dict[str, torch.Tensor]]:
    """Generation ``generation`` of adapter ``model``: its record and tensors, refused
    (naming why) unless it is an adapter bound to ``serves`` (base model, generation)."""
    record = load_adapter_record(store, model, generation)
    if record is None:
        raise ConfigurationError(
            f"generation {generation} of {model!r} is no LoRA adapter (it holds model weights)"
        )
    refusal = record.refusal(*serves)
    if refusal is not None:
        raise ConfigurationError(refusal)
    info = next(
        (i for i in GenerationRegistry(store, model).generations() if i.generation == generation),
        None,
    )
    if info is None:
        raise ConfigurationError(f"generation {generation} of {model!r} was never announced")
    return record, {name: t.clone() for name, t in generation_weights(store, model, info)}


def adapter_model(
    manager: Any, record: AdapterRecord, tensors: dict[str, torch.Tensor], lora_id: int
) -> Any:
    """vLLM's ``LoRAModel`` of the adapter, refused when the engine's LoRA config cannot
    serve it (a rank over ``--max-lora-rank``, a feature vLLM lacks)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    peft = PEFTHelper.from_dict(dict(record.config))
    try:
        peft.validate_legal(manager.lora_config)
    except ValueError as error:
        raise ConfigurationError(f"this engine cannot serve the adapter: {error}") from error
    return LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors=tensors,
        peft_helper=peft,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
    )


def lora_digest(lora: Any) -> str:
    """XXH3-64 over an adapter's weights as vLLM holds them: every module's A and B (a
    packed module's list of them, a missing slice named), in module order, with its
    scaling."""
    digest = xxhash.xxh3_64()
    for name in sorted(lora.loras):
        weights = lora.loras[name]
        digest.update(f"{name}:{weights.scaling}".encode())
        for part in (weights.lora_a, weights.lora_b):
            for tensor in part if isinstance(part, list) else [part]:
                if tensor is None:
                    digest.update(b"-")
                    continue
                digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def merged_digest(manager: Any, fresh: Any) -> str:
    """The digest a resident adapter must have: ``fresh`` (a build of its own) merged into
    packed modules as the manager merges every adapter it adds."""
    manager._adapter_manager._create_merged_loras_inplace(fresh)
    return lora_digest(fresh)


def held_adapter(manager: Any, lora_id: int) -> Any:
    """The ``LoRAModel`` the manager holds under ``lora_id`` (None: none)."""
    return manager._adapter_manager.get_adapter(lora_id)


def make_resident(manager: Any, lora: Any) -> None:
    """Add ``lora`` to the worker's adapter manager (replacing one of its id) and pin it."""
    adapters = manager._adapter_manager
    adapters.remove_adapter(lora.id)
    adapters.add_adapter(lora)
    manager.pin_adapter(lora.id)


def evict(manager: Any, lora_id: int) -> None:
    """Drop a resident adapter (a no-op for one not held)."""
    manager.remove_adapter(lora_id)


def resident(manager: Any) -> set[int]:
    return set(manager.list_adapters())


class VllmAdapterNames:
    """Adapter names in vLLM's own request table (``OpenAIServingModels.lora_requests``):
    a request naming one runs with its resident adapter, and ``/v1/models`` lists it."""

    def __init__(self, serving_models: Any, policy: str, base: str) -> None:
        self.table: dict[str, Any] = serving_models.lora_requests
        self.policy, self.base = policy, base
        self._mine: dict[str, int] = {}

    def register(self, name: str, generation: int) -> None:
        from vllm.lora.request import LoRARequest

        self.table[name] = LoRARequest(
            lora_name=name,
            lora_int_id=adapter_id(generation),
            lora_path=adapter_path(self.policy, generation),
            base_model_name=self.base,
        )
        self._mine[name] = generation

    def drop(self, name: str) -> None:
        self.table.pop(name, None)
        self._mine.pop(name, None)

    def resident(self) -> dict[str, int]:
        return dict(sorted(self._mine.items()))
