"""Shared benchmark plumbing: sizes, synthetic models, services."""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from mooncake_rl.generations.catalog import TensorSpec
from mooncake_rl.services import EmbeddedMaster, SegmentHolder
from mooncake_rl.settings import Settings
from mooncake_rl.store import RangeRead, StoreClient
from mooncake_rl.units import parse_size as parse_size  # the benches' size flags


def cpu_model() -> str:
    """This host's CPU as /proc/cpuinfo names it (figures from different hosts differ)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def synthetic_model(
    total_bytes: int, tensors: int, dtype: torch.dtype = torch.bfloat16
) -> list[tuple[str, torch.Tensor]]:
    """Mixed sizes whose rows split evenly over TP 1, 2, 4 and 8; one large embedding-like one."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(tensors, generator=generator) + 0.05
    weights[0] = weights[1:].sum() / 7
    elements = (weights / weights.sum() * total_bytes / dtype.itemsize).long()
    out = []
    for index, count in enumerate(elements.tolist()):
        rows = max(8, (count // 512) // 8 * 8)
        out.append((f"w{index}", torch.randn(rows, 512, generator=generator).to(dtype)))
    return out


def specs_of(model: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [
        TensorSpec.of(name, tensor, str(tensor.dtype).removeprefix("torch."))
        for name, tensor in model
    ]


def client_settings(master: EmbeddedMaster, holder: SegmentHolder, node: str = "node0") -> Settings:
    """A client that lends no memory and prefers ``holder``'s segment, labelled ``node``."""
    return Settings(
        master=master.master_address,
        metadata=master.metadata_url,
        node=node,
        segment_bytes=0,
        local_segment=holder.segment,
        buffer_bytes=16 << 20,
    )


@contextlib.contextmanager
def store_services(segment_bytes: int) -> Iterator[tuple[EmbeddedMaster, SegmentHolder, Settings]]:
    with (
        EmbeddedMaster() as master,
        SegmentHolder(master.master_address, master.metadata_url, segment_bytes) as holder,
    ):
        yield master, holder, client_settings(master, holder)


@contextlib.contextmanager
def node_services(
    segment_bytes: int, nodes: Iterable[str]
) -> Iterator[tuple[EmbeddedMaster, dict[str, Settings]]]:
    """A master and one segment holder of ``segment_bytes`` per node label; client settings
    per label."""
    with EmbeddedMaster() as master, contextlib.ExitStack() as stack:
        settings = {}
        for node in sorted(set(nodes)):
            holder = stack.enter_context(
                SegmentHolder(master.master_address, master.metadata_url, segment_bytes)
            )
            settings[node] = client_settings(master, holder, node)
        yield master, settings


def get_into_gbps(settings: Settings, device: str, keys: Mapping[str, int]) -> float:
    """The Store's ranged ``get_into`` of whole objects (key -> bytes) straight into
    ``device`` memory, one call, best of three after a warm-up: the raw read an update is
    measured against in the same run."""
    total = sum(keys.values())
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    reads, offset = [], 0
    for key, nbytes in sorted(keys.items()):
        reads.append(RangeRead(key, 0, offset, nbytes))
        offset += nbytes
    with StoreClient(settings) as store:
        store.register(buffer.data_ptr(), total)
        try:
            store.read_ranges(buffer.data_ptr(), reads)  # warm: connections, first touch
            seconds = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                store.read_ranges(buffer.data_ptr(), reads)
                if device.startswith("cuda"):
                    torch.cuda.synchronize(device)
                seconds = min(seconds, time.perf_counter() - started)
        finally:
            store.unregister(buffer.data_ptr())
    return total / seconds / 1e9
