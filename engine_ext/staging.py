"""Where a worker stages an update: in device memory while it fits, else in host memory.

prepare's slice (bytes to stage, largest batch) + the budget setting + the device's free
memory -> :func:`choose_staging` (pure) -> :class:`StagingPlace` -> the arena is allocated
there (pinned on CUDA, so landing is one host-to-device copy per tensor) -> reported in
prepare's reply (``staging``).

Staging runs while the engine serves, so it must not take the memory the engine serves
with: vLLM hands almost all free device memory to its KV cache at start, and what is left
is the budget's ceiling. The budget caps it further (``MOONCAKE_RL_STAGING_BUDGET_BYTES``);
a budget that cannot hold one batch of the plan is refused before anything is allocated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine_ext.admission import RequestRefused

DEVICE_HEADROOM = 0.9
"""Of the device's free memory, the share staging may take (the rest absorbs activations)."""


@dataclass(frozen=True)
class StagingPlace:
    """Where one update's staged bytes live, and why."""

    where: Literal["device", "host"]
    device: str
    """The arena's torch device (``cpu`` for host staging)."""
    staged_bytes: int
    budget_bytes: int | None
    free_device_bytes: int | None

    def __post_init__(self) -> None:
        if self.staged_bytes < 0:
            raise ValueError(f"staged bytes must be >= 0, got {self.staged_bytes}")
        if self.where == "host" and self.device != "cpu":
            raise ValueError(f"host staging lives on the cpu device, not {self.device}")

    @property
    def pinned(self) -> bool:
        """Host staging for a CUDA engine is pinned: its landing is a plain DMA copy."""
        return self.where == "host" and self.free_device_bytes is not None

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "pinned": self.pinned}


def choose_staging(
    staged_bytes: int,
    largest_batch_bytes: int,
    device: torch.device,
    budget_bytes: int | None,
    free_device_bytes: int | None,
) -> StagingPlace:
    """Device staging when the staged bytes fit both the budget and the device's free
    memory (``free_device_bytes``: ``None`` for a CPU engine, whose device is the host);
    host staging otherwise. Refuses a budget smaller than the plan's largest batch."""
    if budget_bytes is not None and budget_bytes < largest_batch_bytes:
        raise RequestRefused(
            409,
            "staging_budget",
            f"the staging budget ({budget_bytes} bytes, MOONCAKE_RL_STAGING_BUDGET_BYTES) "
            f"cannot hold one batch of this plan ({largest_batch_bytes} bytes): raise the "
            "budget, or plan with a smaller --batch-bytes",
        )
    if free_device_bytes is None or device.type == "cpu":
        return StagingPlace("host", "cpu", staged_bytes, budget_bytes, None)
    limits = [int(free_device_bytes * DEVICE_HEADROOM)]
    if budget_bytes is not None:
        limits.append(budget_bytes)
    where: Literal["device", "host"] = "device" if staged_bytes <= min(limits) else "host"
    return StagingPlace(
        where,
        str(device) if where == "device" else "cpu",
        staged_bytes,
        budget_bytes,
        free_device_bytes,
    )


def free_device_bytes(device: torch.device) -> int | None:
    """What the device could still hand out: the driver's free memory plus what torch's
    caching allocator holds unused (``None`` off CUDA)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached)
