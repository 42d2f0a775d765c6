"""Engine-neutral parts of ``--load-format mooncake``: which model, read it, tag it.

Both engines take ``--model-loader-extra-config '{"name": "<model name>"}'``, feed the
Store's active generation to their own ``load_weights``, and tag the loaded module with the
generation it serves so the receiver starts from the right fence.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

LOAD_FORMAT = "mooncake"


def model_name_from(extra_config: dict[str, Any] | None) -> str:
    name = (extra_config or {}).get("name")
    if not name:
        raise ConfigurationError(
            '--load-format mooncake needs --model-loader-extra-config \'{"name": "<model>"}\''
        )
    return str(name)


@contextmanager
def store_weights(model_name: str) -> Iterator[tuple[int, Iterator[tuple[str, torch.Tensor]]]]:
    """The active generation and its tensors, over a Store client that lends no memory."""
    with StoreClient(Settings().with_overrides(segment_bytes=0)) as store:
        yield active_weights(store, model_name)


def mark_served(model: torch.nn.Module, generation: int, model_name: str | None = None) -> None:
    """Record on the module which generation (of which model) it now serves."""
    model._mooncake_generation = generation
    if model_name is not None:
        model._mooncake_model_name = model_name


def served_by(model: torch.nn.Module) -> tuple[int, str | None]:
    """(generation, model name) the module serves; generation 0 if not loaded from the Store."""
    return int(getattr(model, "_mooncake_generation", 0)), getattr(
        model, "_mooncake_model_name", None
    )
