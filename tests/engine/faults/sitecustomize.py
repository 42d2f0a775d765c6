"""Loaded by every Python process of a test engine whose PYTHONPATH names this folder.

Puts back the upstream vLLM 0.32 behaviour that mooncake-rl works around: a weight reload
does not re-run the CPU MoE prepack, so the experts keep the old generation's packed bytes.
The post-landing check must catch it and the engine must never serve the result.
"""

import engine_ext.vllm.worker as _worker

_worker.repack_cpu_experts = lambda model: None
