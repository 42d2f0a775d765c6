"""mooncake-rl: move each new RL policy from trainers into live engines via Mooncake Store.

``mooncake_rl.Ext`` (the vLLM worker extension) is resolved lazily so the core never imports
vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Ext"]


def __getattr__(name: str) -> Any:
    if name == "Ext":
        from engine_ext.vllm.worker import MooncakeWorkerExtension

        return MooncakeWorkerExtension
    raise AttributeError(name)
