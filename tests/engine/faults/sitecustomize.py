"""Loaded by every Python process of a test engine whose PYTHONPATH names this folder.

Once the file named by ``MOONCAKE_RL_TEST_STALE_EXPERTS`` exists, puts back the upstream
vLLM 0.32 behaviour that mooncake-rl works around: a weight reload does not re-run the CPU
MoE prepack, so the experts keep the old generation's packed bytes. The post-landing check
must catch it and the engine must never serve the result.
"""

import os

import engine_ext.vllm.worker as _worker

_repack = _worker.repack_cpu_experts


def _repack_unless_faulted(model):
    if not os.path.exists(os.environ["MOONCAKE_RL_TEST_STALE_EXPERTS"]):
        _repack(model)


_worker.repack_cpu_experts = _repack_unless_faulted
