"""Updates under live traffic: the request router in front of the engines.

- :mod:`~mooncake_rl.router.adapters`: one interface over ``vllm-router`` and
  ``sglang-router``;
- :mod:`~mooncake_rl.router.rotation`: the serialized take-out / re-admit / retire steps;
- :mod:`~mooncake_rl.router.probe`: the capability checks and rolling waves, before any drain.

The bracket itself (take out, drain, sync, re-admit in a ``finally``) is
:meth:`mooncake_rl.coordinator.Coordinator.update` with ``router=``.
"""

from mooncake_rl.router.adapters import (
    KINDS,
    Router,
    RouterError,
    RouterSpec,
    SglangRouter,
    VllmRouter,
    open_router,
)
from mooncake_rl.router.probe import VersionSkew, require_compatible, waves
from mooncake_rl.router.rotation import EngineHeldOut, Rotation, RotationBusy

__all__ = [
    "KINDS",
    "EngineHeldOut",
    "Rotation",
    "RotationBusy",
    "Router",
    "RouterError",
    "RouterSpec",
    "SglangRouter",
    "VersionSkew",
    "VllmRouter",
    "open_router",
    "require_compatible",
    "waves",
]
