"""A rollout-worker process for data-plane tests: an ApplyWorker driven over queues."""

from __future__ import annotations

import traceback
from typing import Any

from mooncake_rl.apply.worker import (
    ApplyWorker,
    allocate_arena,
    arena_views,
    peers_from,
    region_of,
)
from mooncake_rl.counters import COUNTERS
from mooncake_rl.settings import Settings


def serve_worker(
    settings: Settings, worker_id: str, region_sizes: dict[str, int], inbox: Any, outbox: Any
) -> None:
    """Commands: ("prepare", stages) -> description; ("run", batches, descriptions) ->
    result; ("dump", region) -> bytes; ("stop",)."""
    arena, regions = allocate_arena(region_sizes)
    buffers = arena_views(arena, regions)
    worker = ApplyWorker(settings, worker_id)
    try:
        while True:
            command = inbox.get(timeout=300)
            try:
                if command[0] == "prepare":
                    worker.prepare(region_of("arena", arena), regions, command[1])
                    worker.promote()
                    outbox.put(("ok", worker.describe()))
                elif command[0] == "run":
                    before = COUNTERS.snapshot()
                    result = worker.run_stage(command[1], peers_from(command[2]))
                    delta = COUNTERS.snapshot() - before
                    outbox.put(("ok", {"result": result, "counters": delta}))
                elif command[0] == "dump":
                    outbox.put(("ok", buffers[command[1]].numpy().tobytes()))
                elif command[0] == "stop":
                    outbox.put(("ok", None))
                    return
            except Exception as error:
                outbox.put(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        worker.close()
