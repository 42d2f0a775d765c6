"""A simulated VeRL trainer rank: a separate process in a gloo group, driven over queues.

Like VeRL's actor workers it lives across syncs and builds its engine once, exactly as
``ActorRolloutRefWorker.init_model`` does (``import_external_libs`` +
``CheckpointEngineRegistry.new(..., is_master=rank == 0)``). Per sync it answers the
manager's calls: ``prepare`` -> metadata, ``init_process_group`` kwargs -> ``send_weights``
result, then ``finalize``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

BUCKET_BYTES = 1 << 20
TIMEOUT_S = 300


def weights(
    model_dir: Path, fail_at: int | None, exit_at: int | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, as VeRL's per-tensor generator would yield them."""
    from mooncake_rl.generations.commands import checkpoint_tensors

    for index, (name, tensor) in enumerate(checkpoint_tensors(model_dir)):
        if index == fail_at:
            raise RuntimeError("simulated failure while gathering a tensor")
        if index == exit_at:
            os._exit(17)  # the rank dies mid-publish
        yield name, tensor


def serve_trainer(
    rank: int,
    world_size: int,
    init_method: str,
    env: dict[str, str],
    engine_kwargs: dict[str, Any],
    inbox: Any,
    outbox: Any,
) -> None:
    """Commands: ("sync", model_dir, fail_at, exit_at), then init kwargs, then "finalize";
    ("stop",)."""
    os.environ.update(env)  # MOONCAKE_RL_NODE, MOONCAKE_RL_LOCAL_SEGMENT: per node, as in VeRL
    import torch.distributed as dist
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    from mooncake_rl.errors import MooncakeRLError

    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    import_external_libs("verl_bridge.backend")
    engine = CheckpointEngineRegistry.new(
        "mooncake_store",
        is_master=dist.get_rank() == 0,
        bucket_size=BUCKET_BYTES,
        **engine_kwargs,
    )
    try:
        while (command := inbox.get(timeout=TIMEOUT_S))[0] == "sync":
            _, model_dir, fail_at, exit_at = command
            outbox.put(engine.prepare())
            engine.init_process_group(**inbox.get(timeout=TIMEOUT_S))
            with torch.no_grad():
                try:
                    sent = engine.send_weights(weights(model_dir, fail_at, exit_at), global_steps=7)
                    result: tuple[str, Any] = ("ok", asyncio.run(sent))
                except MooncakeRLError as error:
                    result = (type(error).__name__, str(error))
            outbox.put(result)
            assert inbox.get(timeout=TIMEOUT_S) == "finalize"
            engine.finalize()
            outbox.put("finalized")
    finally:
        engine.close()
        dist.destroy_process_group()
