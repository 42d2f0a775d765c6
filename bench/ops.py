"""Mooncake's per-operation costs on real local services (``python -m bench.ops``, JSON).

    Store ranged reads (one ``get_into_ranges`` call each): K keys x 1 small range,
        1 key x R small ranges, 1 key x 1 large range
    Transfer Engine (one ``batch_transfer_sync_write`` per call): W small writes, 1 large one
    fit per kind: seconds = a * ops + bytes / bandwidth (least squares over every sample)

Why: the simulator (``bench.simulate``) charges each Store read and each push a fixed cost
besides its bytes; these are the TCP defaults it uses. Small ranges are 4 KiB and never
adjacent (a gap between them), so nothing merges; each point is the median of a few calls.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np
import torch

from bench.common import parse_size, store_services
from mooncake_rl.engine import TransferEngineClient, Write
from mooncake_rl.store import RangeRead, StoreClient

SMALL = 4096
GAP = 4096  # between small ranges: adjacent ones would merge in the executor


@dataclass(frozen=True)
class Sample:
    """One timed point: ``ops`` native operations moving ``nbytes`` in ``seconds``."""

    ops: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class Fit:
    """seconds = per_op_s * ops + nbytes / bytes_per_s, by least squares."""

    per_op_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.per_op_s >= 0 and self.bytes_per_s > 0):
            raise ValueError(f"a fit needs a non-negative per-op cost and positive rate: {self}")


def fit(samples: Sequence[Sample]) -> Fit:
    """Per-op seconds and byte rate of ``samples`` (pure); needs ops and bytes to vary."""
    x = np.array([[s.ops, s.nbytes] for s in samples], np.float64)
    y = np.array([s.seconds for s in samples], np.float64)
    (per_op, per_byte), *_ = np.linalg.lstsq(x, y, rcond=None)
    return Fit(max(float(per_op), 0.0), 1.0 / float(per_byte))


def timed(call: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``repeats`` calls, after one warm-up call."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _spread(count: int) -> list[int]:
    """Offsets of ``count`` small ranges with a gap between neighbours."""
    return [i * (SMALL + GAP) for i in range(count)]


def measure(large: int, repeats: int, counts: Sequence[int]) -> dict[str, Any]:
    most = max(counts)
    span = max(large, most * (SMALL + GAP))
    segment = span * 2 + most * SMALL + (64 << 20)
    with (
        store_services(segment) as (_, _, settings),
        StoreClient(settings) as store,
        TransferEngineClient(settings) as engine,
        TransferEngineClient(settings) as peer,
    ):
        source = torch.randint(0, 255, (span,), dtype=torch.uint8)
        target = torch.zeros(span, dtype=torch.uint8)
        for buffer in (source, target):
            store.register(buffer.data_ptr(), span)
        store.put_from("ops/large", source.data_ptr(), span)
        keys = [f"ops/small/{i}" for i in range(most)]
        for key in keys:
            store.put_from(key, source.data_ptr(), SMALL)
        base = target.data_ptr()

        def read(reads: list[RangeRead]) -> Callable[[], object]:
            return lambda: store.read_ranges(base, reads)

        per_key = [
            Sample(k, k * SMALL, timed(read([RangeRead(keys[i], 0, o, SMALL)
                                             for i, o in enumerate(_spread(k))]), repeats))
            for k in counts
        ]  # fmt: skip
        per_range = [
            Sample(r, r * SMALL, timed(read([RangeRead("ops/large", o, o, SMALL)
                                             for o in _spread(r)]), repeats))
            for r in counts
        ]  # fmt: skip
        large_read = Sample(1, large, timed(read([RangeRead("ops/large", 0, 0, large)]), repeats))

        engine.register(source.data_ptr(), span)
        peer.register(target.data_ptr(), span)

        def write(writes: list[Write]) -> Callable[[], object]:
            return lambda: engine.write(peer.endpoint, writes)

        src, dst = source.data_ptr(), target.data_ptr()
        writes = [
            Sample(w, w * SMALL, timed(write([Write(src + o, dst + o, SMALL)
                                              for o in _spread(w)]), repeats))
            for w in counts
        ]  # fmt: skip
        large_write = Sample(1, large, timed(write([Write(src, dst, large)]), repeats))
        engine.unregister(source.data_ptr())
        peer.unregister(target.data_ptr())
    # An extra range's cost is the slope over ranges of one key; a key's is the slope over
    # keys of one range each (so it includes that key's one range).
    read_key = fit([*per_key, large_read])
    read_range = fit([*per_range, large_read])
    push = fit([*writes, large_write])
    return {
        "store_read_per_key_us": round(read_key.per_op_s * 1e6, 1),
        "store_read_per_extra_range_us": round(read_range.per_op_s * 1e6, 1),
        "te_write_per_range_us": round(push.per_op_s * 1e6, 1),
        "store_read_large_gbs": round(large / large_read.seconds / 1e9, 3),
        "te_write_large_gbs": round(large / large_write.seconds / 1e9, 3),
        "fitted_read_gbs": round(read_key.bytes_per_s / 1e9, 3),
        "fitted_write_gbs": round(push.bytes_per_s / 1e9, 3),
        "samples": {
            name: [vars(s) for s in samples]
            for name, samples in (
                ("read_keys", [*per_key, large_read]),
                ("read_ranges_one_key", [*per_range, large_read]),
                ("te_writes", [*writes, large_write]),
            )
        },
    }


def host() -> dict[str, Any]:
    """What ran it: CPU model, cores, load, the Mooncake wheel."""
    with open("/proc/cpuinfo") as cpuinfo:
        model = next(
            (line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line),
            platform.processor(),
        )
    wheel = next(
        (f"{d.metadata['Name']} {d.version}" for d in metadata.distributions()
         if (d.metadata["Name"] or "").startswith("mooncake-transfer-engine")),
        "unknown",
    )  # fmt: skip
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "mooncake": wheel,
        "transport": "tcp loopback (MC_FORCE_TCP)",
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__.split("\n")[0])
    p.add_argument("--large", default="64MiB", help="the large range's size")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--counts", default="1,16,64,256", help="small-op counts per call")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    started = time.perf_counter()
    result = measure(parse_size(args.large), args.repeats, counts)
    print(
        json.dumps(
            {
                "bench": "ops",
                "command": " ".join(["python -m bench.ops", *(argv or sys.argv[1:])]),
                "host": host(),
                "small_range_bytes": SMALL,
                "model": "seconds = a * ops + bytes / bandwidth per call kind (least squares)",
                **result,
                "wall_seconds": round(time.perf_counter() - started, 1),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
