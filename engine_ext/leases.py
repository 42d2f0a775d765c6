"""Serving leases: an engine keeps renewing a record of the generation it serves.

GC never deletes a generation under an unexpired lease, so a generation stays in the Store
while any engine serves it. Renewal runs on the engine's event loop; a failed renewal is
logged and retried at the next tick (the lease simply expires if the engine goes away).
"""

from __future__ import annotations

import asyncio
import logging

from engine_ext.receiver import Receiver
from mooncake_rl.generations.gc import LeaseBook
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

logger = logging.getLogger(__name__)


def lease_id(engine_id: str) -> str:
    return engine_id.replace("/", "_")


async def renew_leases(receiver: Receiver, settings: Settings) -> None:
    """Renew every ``lease_ttl_s / 3`` seconds for as long as the engine runs."""
    store = await asyncio.to_thread(StoreClient, settings.with_overrides(segment_bytes=0))
    book = LeaseBook(store, receiver.model)
    try:
        while True:
            try:
                await asyncio.to_thread(
                    book.renew,
                    lease_id(receiver.backend.engine_id),
                    receiver.generation,
                    settings.lease_ttl_s,
                )
            except Exception:  # the Store may be briefly unreachable; retry next tick
                logger.warning("mooncake: lease renewal failed", exc_info=True)
            await asyncio.sleep(settings.lease_ttl_s / 3)
    finally:
        await asyncio.to_thread(store.close)
