"""VeRL adapter: the ``mooncake_store`` checkpoint-engine backend (``verl_bridge.backend``).

This package imports nothing heavy: only ``verl_bridge.backend`` (and, through it, Ray) and
``verl_bridge.ext`` (the rollout servers' worker extension) import VeRL, so the core and the
engine adapters never pull VeRL in. Select the backend with
``checkpoint_engine.custom_backend_module=verl_bridge.backend`` (see ``docs/verl.md``).
"""

BACKEND_NAME = "mooncake_store"

__all__ = ["BACKEND_NAME"]
