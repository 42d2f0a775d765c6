"""Checksum cost: ``python -m bench.checksums [--size 1GiB --hash-size 1GiB --tensors 32]``.

Prints one JSON object: the hash rates on this machine (XXH3-128 over whole objects, XXH3-64
over 4 MiB blocks, on one thread and on every core, against BLAKE3 and SHA-256 for the
record), then a real one-process publish of a synthetic bf16 model with the time its
publisher spent computing checksums (``ObjectChecksum.of``, timed in place) and its share of
the publish. The share of update time comes from ``python -m bench.apply`` (its
``checksums`` field).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from bench.common import parse_size, store_services, synthetic_model
from mooncake_rl.generations import publisher as publisher_module
from mooncake_rl.generations.checksums import BLOCK_BYTES, ObjectChecksum
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.store import StoreClient


def _rate(nbytes: int, body: Callable[[], object], repeats: int = 3) -> float:
    """Best-of GB/s (1e9 bytes per second)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        body()
        best = min(best, time.perf_counter() - started)
    return round(nbytes / best / 1e9, 2)


def hash_rates(nbytes: int) -> dict[str, Any]:
    data = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    blocks = [data[s : s + BLOCK_BYTES] for s in range(0, nbytes, BLOCK_BYTES)]
    cores = os.cpu_count() or 1
    rates: dict[str, Any] = {"bytes": nbytes, "cores": cores}
    rates["xxh3_128_whole_gbps"] = _rate(nbytes, lambda: xxhash.xxh3_128_hexdigest(data))
    rates["xxh3_64_blocks_gbps"] = _rate(
        nbytes, lambda: [xxhash.xxh3_64_hexdigest(b) for b in blocks]
    )
    rates["object_checksum_of_gbps"] = _rate(nbytes, lambda: ObjectChecksum.of(data))
    with ThreadPoolExecutor(cores) as pool:
        rates["xxh3_64_blocks_all_cores_gbps"] = _rate(
            nbytes, lambda: list(pool.map(xxhash.xxh3_64_hexdigest, blocks))
        )
    try:
        import blake3

        rates["blake3_one_thread_gbps"] = _rate(nbytes, lambda: blake3.blake3(data).digest())
        rates["blake3_all_cores_gbps"] = _rate(
            nbytes, lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest()
        )
    except ImportError:
        rates["blake3"] = "not installed"
    rates["sha256_gbps"] = _rate(nbytes, lambda: hashlib.sha256(data).digest(), repeats=1)
    return rates


def publish_share(size: int, tensors: int) -> dict[str, Any]:
    """One real publish; ``ObjectChecksum.of`` wrapped in place to time it."""
    spent = [0.0]
    original = publisher_module.ObjectChecksum.of

    def timed(data: Any) -> ObjectChecksum:
        started = time.perf_counter()
        try:
            return original(data)
        finally:
            spent[0] += time.perf_counter() - started

    model = synthetic_model(size, tensors)
    total = sum(t.numel() * t.element_size() for _, t in model)
    with (
        store_services(int(total * 1.2) + (64 << 20)) as (_, _, settings),
        StoreClient(settings) as store,
    ):
        publisher_module.ObjectChecksum.of = timed  # type: ignore[method-assign]
        try:
            started = time.perf_counter()
            publish_local(store, "bench-checksums", model, dtype="bfloat16", keep=None)
            seconds = time.perf_counter() - started
        finally:
            publisher_module.ObjectChecksum.of = original  # type: ignore[method-assign]
    return {
        "model_bytes": total,
        "tensors": tensors,
        "publish_seconds": round(seconds, 4),
        "checksum_seconds": round(spent[0], 4),
        "checksum_share_of_publish": round(spent[0] / seconds, 4),
    }


def main() -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hash-size", default="1GiB")
    parser.add_argument("--size", default="1GiB", help="model size of the publish")
    parser.add_argument("--tensors", type=int, default=32)
    args = parser.parse_args()
    print(
        json.dumps(
            {
                "bench": "checksums",
                "hash": hash_rates(parse_size(args.hash_size)),
                "publish": publish_share(parse_size(args.size), args.tensors),
            }
        )
    )


if __name__ == "__main__":
    main()
