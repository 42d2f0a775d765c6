"""LoRA adapters as generations of their own, bound to the base generation they apply to.

    PEFT directory (adapter_config.json + *.safetensors) --read_adapter--> Adapter: its
        config checked (LoRA, rank, alpha, target modules) and every tensor matched to a
        target module's lora_A / lora_B of that rank
    Adapter + the base (model, generation) --publish_adapter--> a generation of the policy
        name: the tensors as payloads, and a sealed adapter record (the PEFT config, the base)
        written before the announce; announce, checksums, leases, retention and GC as for
        any generation
    readers --load_adapter_record--> the record, refused unless it binds the base they serve

Why a generation of its own: an adapter moves without its base (megabytes, not the model),
several adapter generations can stay resident beside one base, and a restarted engine
loads both from the Store. Why bound to a base generation: an adapter trained against one
base is wrong on another, so an engine serving anything else refuses it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations.assignment import TrainerTopology
from mooncake_rl.generations.keys import adapter_key, group_id
from mooncake_rl.generations.publisher import (
    DEFAULT_KEEP,
    GenerationPublisher,
    finalize_generation,
    start_attempt,
)
from mooncake_rl.generations.records import (
    ActiveRecord,
    FenceError,
    decode_record,
    read_optional,
    seal,
    unseal,
)
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.store import StoreClient

ADAPTER_CONFIG = "adapter_config.json"
_LORA_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])(?:\.[^.]+)?\.weight$")


class AdapterRefused(ConfigurationError):
    """An adapter that cannot be published or loaded as given; nothing was changed."""


@dataclass(frozen=True)
class AdapterBase:
    """The generation of the base model an adapter applies to."""

    model: str
    generation: int

    def __post_init__(self) -> None:
        if not self.model or type(self.generation) is not int or self.generation < 1:
            raise AdapterRefused(f"an adapter's base needs a model and a generation, got {self}")


@dataclass(frozen=True)
class AdapterRecord:
    """What a LoRA generation is beside its tensors: its base, rank, alpha, target modules
    and the PEFT config as published (engines hand it to their LoRA loader)."""

    base: AdapterBase
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    config: Mapping[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        body = asdict(self)
        body["target_modules"] = list(self.target_modules)
        return seal(body)

    @classmethod
    def decode(cls, data: bytes) -> AdapterRecord:
        body = unseal(data, "adapter record")
        try:
            base = AdapterBase(**body.pop("base"))  # type: ignore[arg-type]
            modules = tuple(body.pop("target_modules"))  # type: ignore[arg-type]
        except (KeyError, TypeError) as error:
            raise FenceError(f"adapter record has unexpected fields ({error})") from error
        return decode_record(cls, {**body, "base": base, "target_modules": modules}, "adapter")

    def refusal(self, model: str, generation: int) -> str | None:
        """Why an engine serving ``generation`` of ``model`` must refuse this adapter."""
        if (self.base.model, self.base.generation) == (model, generation):
            return None
        return (
            f"the adapter applies to generation {self.base.generation} of "
            f"{self.base.model!r}; this engine serves generation {generation} of {model!r}"
        )


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter read from a directory, checked."""

    config: Mapping[str, Any]
    tensors: Mapping[str, torch.Tensor]

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def target_modules(self) -> tuple[str, ...]:
        modules = self.config["target_modules"]
        return (modules,) if isinstance(modules, str) else tuple(sorted(modules))

    def record(self, base: AdapterBase) -> AdapterRecord:
        return AdapterRecord(
            base, self.rank, float(self.config["lora_alpha"]), self.target_modules, self.config
        )


def check_adapter(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse, naming the cause, a config that is not plain LoRA or tensors that do not
    match it: each lora_A ``(rank, in)`` has its lora_B ``(out, rank)`` on a target module,
    and nothing else is there."""
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterRefused(f"peft_type is {config.get('peft_type')!r}; only LORA adapters")
    rank = config.get("r")
    if type(rank) is not int or rank < 1:
        raise AdapterRefused(f"adapter rank r must be an integer >= 1, got {rank!r}")
    if not isinstance(config.get("lora_alpha"), int | float):
        raise AdapterRefused(f"lora_alpha must be a number, got {config.get('lora_alpha')!r}")
    targets = config.get("target_modules")
    if not targets or not isinstance(targets, str | list):
        raise AdapterRefused("target_modules must name the modules the adapter changes")
    if not tensors:
        raise AdapterRefused("the adapter holds no tensors")
    wanted = {targets} if isinstance(targets, str) else set(targets)
    sides: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _LORA_TENSOR.match(name)
        if match is None:
            raise AdapterRefused(f"tensor {name!r} is no lora_A or lora_B weight")
        module = match["module"]
        if module.rsplit(".", 1)[-1] not in wanted:
            raise AdapterRefused(f"tensor {name!r} is on a module target_modules does not name")
        sides.setdefault(module, {})[match["side"]] = tensor
    for module, pair in sorted(sides.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterRefused(f"{module} has no {missing} weight: the adapter is incomplete")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterRefused(
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not of "
                f"rank {rank} (lora_A (r, in), lora_B (out, r))"
            )


def read_adapter(directory: Path) -> Adapter:
    """The PEFT adapter in ``directory`` (``adapter_config.json`` and its safetensors),
    checked (:func:`check_adapter`)."""
    from mooncake_rl.generations.commands import checkpoint_tensors

    path = directory / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise AdapterRefused(f"{directory} has no {ADAPTER_CONFIG}: not a PEFT adapter") from error
    except ValueError as error:
        raise AdapterRefused(f"{path} is not JSON: {error}") from error
    tensors = dict(checkpoint_tensors(directory))
    check_adapter(config, tensors)
    return Adapter(config, tensors)


def load_adapter_record(store: StoreClient, model: str, generation: int) -> AdapterRecord | None:
    """The adapter record of ``generation`` of ``model``, or None: a generation of weights."""
    return read_optional(store, adapter_key(group_id(model, generation)), AdapterRecord.decode)


def require_base(store: StoreClient, base: AdapterBase) -> None:
    """Refuse an adapter whose base generation is not announced in this Store."""
    registry = GenerationRegistry(store, base.model)
    known = {i.generation for i in registry.generations()}
    if base.generation not in known:
        raise AdapterRefused(
            f"the adapter's base, generation {base.generation} of {base.model!r}, is not "
            f"announced in this Store (announced: {sorted(known) or 'none'}); publish the base "
            "first, or name the generation engines serve"
        )


def publish_adapter(
    store: StoreClient,
    name: str,
    adapter: Adapter,
    base: AdapterBase,
    *,
    dtype: str = "float32",
    keep: int | None = DEFAULT_KEEP,
) -> ActiveRecord:
    """Claim, publish and announce ``adapter`` as the next generation of ``name``: its
    record first (an abort removes it with the rest), then its tensors, then the announce.
    Refused before anything is claimed when the base is not announced here, or when
    ``name``'s generations are weights, not adapters."""
    require_base(store, base)
    active = GenerationRegistry(store, name).active()
    if active is not None and load_adapter_record(store, name, active.generation) is None:
        raise AdapterRefused(
            f"{name!r} holds model weights (generation {active.generation}); publish the "
            "adapter under a name of its own"
        )
    generation, attempt = start_attempt(store, name)
    store.upsert_bytes(adapter_key(group_id(name, generation)), adapter.record(base).encode())
    publisher = GenerationPublisher(
        store,
        name,
        generation,
        0,
        TrainerTopology.single(store.settings.node),
        dtype,
        attempt=attempt,
    )
    report = publisher.publish(sorted(adapter.tensors.items()))
    return finalize_generation(publisher, report, keep=keep)
