"""Agreement among one engine's ranks, as JSON over their CPU process group.

``torch.distributed.all_gather_object`` would pickle what ranks exchange; these values are
replies of the worker protocol (plain JSON), so they travel as UTF-8 bytes in tensors.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def gather_json(value: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``value``, in rank order; ``group=None`` is a group of one.

    A collective: every rank of ``group`` must call it, in the same order.
    """
    if group is None:
        return [value]
    data = json.dumps(value).encode()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    chunks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(chunks, padded, group=group)
    return [
        json.loads(chunk[: int(n)].numpy().tobytes())
        for chunk, n in zip(chunks, sizes, strict=True)
    ]
