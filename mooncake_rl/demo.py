"""``make demo``: the smallest real round trip through Mooncake Store, narrated.

Starts an embedded master, puts a tensor from one client into its own segment, reads it
back with ranged reads from a second client, and checks every byte.
"""

from __future__ import annotations

import time

import torch

from mooncake_rl.counters import COUNTERS
from mooncake_rl.services import EmbeddedMaster, MasterConfig
from mooncake_rl.settings import Settings
from mooncake_rl.store import RangeRead, StoreClient


def run_demo() -> int:
    started = time.perf_counter()
    with EmbeddedMaster(MasterConfig()) as master:
        print(
            f"[demo] mooncake_master up at {master.master_address} (metadata {master.metadata_url})"
        )
        settings = Settings(
            master=master.master_address,
            metadata=master.metadata_url,
            segment_bytes=64 << 20,
            buffer_bytes=16 << 20,
        )
        payload = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
        nbytes = payload.numel() * payload.element_size()
        with (
            StoreClient(settings.with_overrides(node="trainer")) as publisher,
            StoreClient(settings.with_overrides(node="rollout")) as reader,
        ):
            publisher.put_tensor("demo/weight", payload, preferred_segments=[publisher.segment])
            where = reader.replica_segments("demo/weight")
            print(f"[demo] put {nbytes} bytes into {where}; publisher is {publisher.segment}")
            out = torch.empty_like(payload)
            reader.register(out.data_ptr(), nbytes)
            half = nbytes // 2
            reader.read_ranges(
                out.data_ptr(),
                [
                    RangeRead("demo/weight", half, half, nbytes - half),
                    RangeRead("demo/weight", 0, 0, half),
                ],
            )
            exact = torch.equal(out, payload)
            counts = COUNTERS.snapshot()
            print(
                f"[demo] read back in two ranges by a second client: byte-exact={exact}; "
                f"put={counts.store_put_bytes} read={counts.store_read_bytes} bytes"
            )
    print(f"[demo] master stopped; {time.perf_counter() - started:.1f}s total")
    return 0 if exact else 1
