"""VeRL's ``CheckpointEngineManager``, made to leave no replica paused when a sync raises.

Data flow of one ``update_weights`` (VeRL 0.9.1): abort the replicas' requests (pause), release
their KV cache, sync (prepare, send, receive, finalize), resume the KV cache, resume
generation. When the sync raises (a trainer rank's generator failed, a rank died, the engine
update failed), VeRL skips the last two steps, so its replicas stay paused with their KV
cache released until the next sync, serving nothing. :func:`resume_replicas_after_failure`
wraps the manager's own ``update_weights`` so that, for a manager whose backend is
``mooncake_store``, the two steps run before the error propagates. With the Store backend a
failed sync leaves every engine on a complete generation (the previous one, or a rebuild
from the Store's active one), so resuming serves nothing half-updated.

VeRL offers no hook for a failed sync; the wrapper is installed once, when VeRL imports
``verl_bridge.backend`` in the driver, and leaves managers of other backends as they were.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from verl.checkpoint_engine.base import CheckpointEngineManager
from verl.utils.ray_utils import auto_await

from verl_bridge import BACKEND_NAME

logger = logging.getLogger(__name__)

Sync = Callable[..., Coroutine[Any, Any, Any]]


def resume_replicas_after_failure(manager_cls: type = CheckpointEngineManager) -> None:
    """Wrap ``manager_cls.update_weights`` (once) so a raising sync resumes the replicas."""
    current = manager_cls.update_weights
    if getattr(current, "_mooncake_resumes", False):
        return
    sync: Sync = current.__wrapped__  # the coroutine function under VeRL's ``auto_await``

    @functools.wraps(sync)
    async def update_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await sync(self, *args, **kwargs)
        except Exception as error:
            if self.backend != BACKEND_NAME:
                raise
            try:
                await self.resume_kv_cache_replicas()
                await self.resume_generation_replicas()
            except Exception as failure:  # the sync's own error stays the one raised
                logger.exception("mooncake_store: resuming the replicas after a failed sync")
                error.add_note(f"resuming the replicas afterwards failed too: {failure!r}")
            raise

    wrapped = auto_await(update_weights)
    wrapped._mooncake_resumes = True  # type: ignore[attr-defined]
    manager_cls.update_weights = wrapped
