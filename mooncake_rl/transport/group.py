"""The broadcast group: one sender (rank 0) and every rank of every broadcast engine.

The group is a process group of its own, built from a TCP store the sender hosts and never
registered as a default group: vLLM and SGLang workers already run their own. The same
code runs NCCL on GPUs and gloo on CPUs; the backend follows the device of the tensors.
Every member joins at ``rank`` (an engine's TP rank r at its ``rank_offset + r``, as in
SGLang's ``init_weights_update_group`` and vLLM's NCCL weight-transfer backend).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from mooncake_rl.errors import InvariantViolation

Backend = Literal["gloo", "nccl"]


def gpu_uuid(device: torch.device | None = None) -> str | None:
    """The physical id (CUDA UUID, as ``nvidia-smi -L`` prints it) of ``device`` or of the
    current CUDA device; ``None`` without CUDA. Classification compares these ids."""
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return None
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def backend_for(device: torch.device) -> Backend:
    return "nccl" if device.type == "cuda" else "gloo"


def sender_device(train_pool: Collection[str]) -> torch.device | None:
    """A CUDA device of this host in the train pool, for an NCCL sender; ``None`` if none.

    The sender must sit on a GPU none of the receivers use, and classification keeps every
    broadcast engine off the train pool's GPUs."""
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        device = torch.device("cuda", index)
        if gpu_uuid(device) in train_pool:
            return device
    return None


@dataclass(frozen=True)
class GroupSpec:
    """Where the group meets (the sender's TCP store) and who this member is."""

    host: str
    port: int
    world_size: int
    rank: int
    name: str
    backend: Backend
    timeout_s: float

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536 or not 0 <= self.rank < self.world_size:
            raise InvariantViolation(f"malformed broadcast group {self}")
        if self.world_size < 2 or self.timeout_s <= 0:
            raise InvariantViolation(f"malformed broadcast group {self}")


class BroadcastGroup:
    """One member's handle on the group; rank 0 hosts the TCP store and sends."""

    def __init__(self, spec: GroupSpec, local_address: str) -> None:
        """Blocks until every member joined (or the timeout passes). ``local_address``: the
        address other members reach this one at (gloo connects members pairwise)."""
        timeout = timedelta(seconds=spec.timeout_s)
        self.spec = spec
        self._store: dist.TCPStore | None = dist.TCPStore(
            spec.host,
            spec.port,
            spec.world_size,
            spec.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        prefixed = dist.PrefixStore(spec.name, self._store)
        if spec.backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
            self._group: dist.ProcessGroup | None = dist.ProcessGroupGloo(
                prefixed, spec.rank, spec.world_size, options
            )
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(prefixed, spec.rank, spec.world_size, options)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` into every member's ``tensor`` (same size, contiguous)."""
        assert self._group is not None, "the group was closed"
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([tensor], options).wait()

    def barrier(self) -> None:
        """Wait until every member finished this update; the group stays up for the next
        (one group per engine set: forming it costs seconds, an update of a small model
        less)."""
        assert self._group is not None, "the group was closed"
        self._group.barrier().wait()

    def close(self) -> None:
        """Wait until every member finished, then drop the group and (sender) the TCP store:
        the sender's teardown returning is the acknowledgement that frees its port."""
        if self._group is None:
            return
        try:
            self.barrier()
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the group and the TCP store without waiting for anyone: after a failure,
        the other members' connections close and their pending calls fail at once."""
        self._group = None
        self._store = None
