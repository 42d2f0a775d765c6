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

from engine_ext.receiver import ServedRecord
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations.registry import ActiveRecord
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
def store_weights(
    model_name: str,
) -> Iterator[tuple[ActiveRecord, Iterator[tuple[str, torch.Tensor]]]]:
    """The active record and its tensors, over a Store client that lends no memory."""
    with StoreClient(Settings().with_overrides(segment_bytes=0)) as store:
        yield active_weights(store, model_name)


def mark_served(
    model: torch.nn.Module, served: ServedRecord, model_name: str | None = None
) -> None:
    """Record on the module which active record (of which model) it now serves."""
    model._mooncake_served = served
    if model_name is not None:
        model._mooncake_model_name = model_name


def served_record(record: ActiveRecord) -> ServedRecord:
    return ServedRecord(record.generation, record.fence, record.incarnation)


def served_by(model: torch.nn.Module) -> tuple[ServedRecord, str | None]:
    """(record, model name) the module serves; generation 0 if not loaded from the Store."""
    return getattr(model, "_mooncake_served", ServedRecord()), getattr(
        model, "_mooncake_model_name", None
    )
