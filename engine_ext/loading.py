"""Engine-neutral parts of ``--load-format mooncake``: which model, read it, tag it.

Both engines take ``--model-loader-extra-config '{"name": "<model name>"}'``, feed the
Store's active generation to their own ``load_weights``, and tag the loaded module with the
generation it serves so the receiver starts from the right fence.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine_ext.leases import (
    LEASE_ATTEMPTS,
    STARTUP_HOLD_TTLS,
    LeaseNotTaken,
    lease_active,
    lease_id,
    loader_engine_id,
)
from engine_ext.served import ServedRecord
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations.leases import lease_book
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
    model_name: str, engine_id: str | None = None
) -> Iterator[tuple[ActiveRecord, Iterator[tuple[str, torch.Tensor]]]]:
    """The active record and its tensors, over a Store client that lends no memory.

    The engine's serving lease on the generation is written before any of its objects is
    read (:func:`engine_ext.leases.lease_active`), renewed while the tensors are read, and
    left held for the engine's startup; the serving renewal task continues it under the
    same id (``engine_id``, else :func:`engine_ext.leases.loader_engine_id`).
    """
    settings = Settings()
    holder = engine_id or loader_engine_id()
    with StoreClient(settings.with_overrides(segment_bytes=0)) as store:
        for _ in range(LEASE_ATTEMPTS):
            leased, _lease = lease_active(store, model_name, holder, settings)
            record, tensors = active_weights(store, model_name)
            if record.generation == leased.generation:
                break
            # The active record moved between the lease and the read: lease the new one.
        else:
            raise LeaseNotTaken(
                f"the active generation of {model_name} kept moving while leasing it"
            )
        yield record, _leased(store, model_name, holder, record.generation, settings, tensors)
        lease_book(store, model_name).renew(
            lease_id(holder), record.generation, settings.lease_ttl_s * STARTUP_HOLD_TTLS
        )


def _leased(
    store: StoreClient,
    model_name: str,
    holder: str,
    generation: int,
    settings: Settings,
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors, renewing the lease whenever a third of its TTL passed (long loads)."""
    book = lease_book(store, model_name)
    renewed = time.monotonic()
    for item in tensors:
        if time.monotonic() - renewed >= settings.lease_ttl_s / 3:
            book.renew(lease_id(holder), generation, settings.lease_ttl_s)
            renewed = time.monotonic()
        yield item


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
