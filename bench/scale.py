"""Planning at fleet scale: seconds, memory and table size from 16 to 1,000 engines; ONE JSON.

    python -m bench.scale --model llama-70b --engines 16,128,1000 [--tp 8 --dtype fp8]

Each point runs in a fresh process (so its peak memory is its own): it builds the model
shape and ``engines`` identical engines of ``--tp`` GPUs (``mooncake_rl.plan.shapes``,
8 GPUs per node), then plans direct mode the way ``bench.plan`` does: ``plan_routing`` on an
empty cache with the layout digest the active record carries (``plan_seconds_cold``), then
the next generation's call, a cache hit, plus ``bind`` (``plan_seconds_cached``). Memory:
``plan_peak_rss_bytes`` is the process's peak resident set minus its resident set before
planning (shapes, manifests and placements built); both count pages swapped out
(``VmSwap``) as well as resident ones, so a host with a swap file can measure fleets larger
than its memory (``peak_swap_bytes`` says how much was swapped). The table's size is its records
(``reads``, ``pushes``, ``demands``: one per demanded byte range and consumer; ``records``
their sum, every byte range the plan names) and the bytes of its arrays. ``growth``
compares each point with the previous one. A point whose memory, extrapolated from the
points before it (:func:`predicted_peak`), would pass ``--max-rss-gb`` is not run, and one
whose resident set passes it while it runs is killed; ``skipped`` says which and why (this
machine is shared).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mooncake_rl.plan import PlanParams
from mooncake_rl.plan.cpu import host_cpu
from mooncake_rl.plan.shapes import DTYPES, LAYOUTS, MODELS

GB = 1e9


@dataclass(frozen=True)
class Point:
    """One fleet: ``engines`` engines of ``tp`` GPUs laid out ``layout``."""

    model: str
    engines: int
    tp: int = 8
    dtype: str = "bfloat16"
    layout: str = "tp"
    workers_per_node: int = 8
    balance_slack: float = PlanParams().balance_slack  # the planner's chunking knob

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; one of {sorted(MODELS)}")
        if self.dtype not in DTYPES or self.layout not in LAYOUTS:
            raise ValueError(f"dtype must be one of {DTYPES}, layout one of {LAYOUTS}")
        if not 0 < self.balance_slack <= 1:
            raise ValueError(f"balance_slack must lie in (0, 1], got {self.balance_slack}")
        for name in ("engines", "tp", "workers_per_node"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


def _status(*fields: str, pid: int | str = "self") -> dict[str, int]:
    """``fields`` of a process's ``/proc/<pid>/status`` (kB lines), in bytes (0 if absent)."""
    found = dict.fromkeys(fields, 0)
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in found:
                found[name] = int(value.split()[0]) * 1024
    return found


def _memory(pid: int | str = "self") -> int:
    """Resident plus swapped-out bytes of a process."""
    return sum(_status("VmRSS", "VmSwap", pid=pid).values())


class _PeakMemory:
    """The peak of resident plus swapped bytes while planning. ``VmHWM`` counts no swapped
    page, so a thread samples both every 20 ms; the peak is never below ``VmHWM``."""

    def __init__(self) -> None:
        self.peak, self.swap = _memory(), 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            now = _status("VmRSS", "VmSwap")
            self.peak = max(self.peak, now["VmRSS"] + now["VmSwap"])
            self.swap = max(self.swap, now["VmSwap"])

    def __enter__(self) -> _PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _status("VmHWM")["VmHWM"])


def measure(point: Point) -> dict[str, Any]:
    """Plan one fleet cold and cached (run in a fresh process: see the module doc)."""
    from mooncake_rl.generations.layout import layout_digest
    from mooncake_rl.plan import PlanCache, bind, plan_routing
    from mooncake_rl.plan.shapes import cluster, model_shape, weight_manifest

    t0 = time.perf_counter()
    model = model_shape(point.model, point.dtype)
    manifest, following = weight_manifest(model, 1), weight_manifest(model, 2)
    recorded, next_recorded = layout_digest(manifest), layout_digest(following)
    topology, demand = cluster(model, point.engines, point.tp, point.workers_per_node, point.layout)
    setup = time.perf_counter() - t0
    before = _memory()
    cache = PlanCache()
    params = PlanParams(balance_slack=point.balance_slack)
    t0, c0 = time.perf_counter(), time.process_time()
    with _PeakMemory() as memory:
        table = plan_routing(
            manifest, topology, demand, params=params, cache=cache, layout_digest=recorded
        )
    cold, cold_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    again = plan_routing(
        following, topology, demand, params=params, cache=cache, layout_digest=next_recorded
    )
    bind(again, following.group_id)
    cached = time.perf_counter() - t0
    assert again is table and cache.hits == 1
    arrays = (table.reads, table.pushes, table.demands, table.region_sizes)
    nic = table.totals.node_nic_bytes
    peak = memory.peak
    return {
        **asdict(point),
        "workers": len(topology.workers),
        "nodes": len(topology.nodes),
        "tensors": len(model.tensors),
        "model_bytes": model.nbytes,
        "setup_seconds": round(setup, 2),
        "plan_seconds_cold": round(cold, 3),
        "plan_cpu_seconds_cold": round(cold_cpu, 3),
        "plan_seconds_cached": round(cached, 4),
        "rss_before_plan_bytes": before,
        "peak_rss_bytes": peak,
        "plan_peak_rss_bytes": peak - before,
        "peak_swap_bytes": memory.swap,
        "reads": len(table.reads),
        "pushes": len(table.pushes),
        "demands": len(table.demands),
        "records": sum(len(a) for a in arrays[:3]),
        "table_bytes": sum(a.nbytes for a in arrays),
        "store_read_bytes": table.totals.store_read_bytes,
        "max_over_mean_node_nic_bytes": round(float(nic.max() / nic.mean()), 5),
        "delivered_bytes": int(table.totals.delivered_bytes.sum()),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def growth(previous: dict[str, Any], current: dict[str, Any]) -> dict[str, float]:
    """How each figure grew from one point to the next (pure). ``plan_memory_per_record_x``
    is 1 when planning memory grows exactly as the records (byte ranges read, pushed and
    demanded) the table names; ``plan_memory_per_demand_x`` compares with the demanded
    ranges alone."""
    keys = ("engines", "demands", "pushes", "records", "table_bytes", "plan_peak_rss_bytes")
    ratios = {k: current[k] / previous[k] for k in (*keys, "plan_seconds_cold") if previous[k]}
    if "plan_peak_rss_bytes" in ratios:
        for per in ("demands", "records"):
            if per in ratios:
                ratios[f"plan_memory_per_{per.rstrip('s')}"] = (
                    ratios["plan_peak_rss_bytes"] / ratios[per]
                )
    return {f"{k}_x": round(v, 3) for k, v in ratios.items()}


def predicted_peak(done: Sequence[dict[str, Any]], engines: int) -> float:
    """Peak memory of a point of ``engines``, extrapolated from the measured ones (pure):
    planning memory as a power of engines fitted to the last two points (linear from one),
    on top of the last point's memory before planning."""
    last = done[-1]
    exponent = 1.0
    if len(done) > 1 and done[-2]["plan_peak_rss_bytes"] > 0:
        first = done[-2]
        exponent = max(
            1.0,
            math.log(last["plan_peak_rss_bytes"] / first["plan_peak_rss_bytes"])
            / math.log(last["engines"] / first["engines"]),
        )
    scale = (engines / last["engines"]) ** exponent
    return last["rss_before_plan_bytes"] + last["plan_peak_rss_bytes"] * scale


def watched(point: Point, max_rss_bytes: float) -> dict[str, Any]:
    """Run one point in a fresh process; kill it if its memory (resident plus swapped)
    passes the cap."""
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.scale", "--point", json.dumps(asdict(point))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started, peak = time.perf_counter(), 0
    while child.poll() is None:
        with contextlib.suppress(FileNotFoundError):  # ended between poll() and the read
            peak = max(peak, _memory(child.pid))
        if peak > max_rss_bytes:
            child.kill()
            child.communicate()
            return {
                **asdict(point),
                "why": f"stopped after {time.perf_counter() - started:.0f} s: its memory "
                f"(resident plus swapped) passed --max-rss-gb {max_rss_bytes / GB:g}",
            }
        time.sleep(0.2)
    out, err = child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"{point} failed:\n{err[-3000:]}")
    return json.loads(out)


def run(points: Sequence[Point], max_rss_bytes: float) -> dict[str, Any]:
    """Each point in a fresh process, smallest first, while memory is predicted to fit (and
    is watched while it runs)."""
    done: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for point in sorted(points, key=lambda p: p.engines):
        if done and (predicted := predicted_peak(done, point.engines)) > max_rss_bytes:
            skipped.append(
                {
                    **asdict(point),
                    "predicted_peak_rss_bytes": int(predicted),
                    "why": f"extrapolated from {done[-1]['engines']} engines: "
                    f"{predicted / GB:.1f} GB > --max-rss-gb {max_rss_bytes / GB:g}",
                }
            )
            continue
        figures = watched(point, max_rss_bytes)
        (skipped if "why" in figures else done).append(figures)
    return {
        "bench": "scale",
        "points": done,
        "growth": [growth(a, b) for a, b in itertools.pairwise(done)],
        "skipped": skipped,
        "max_rss_bytes": max_rss_bytes,
        "host_cpus": os.cpu_count(),
        "host": host_cpu().as_json(),
        "parent_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="llama-70b")
    p.add_argument("--engines", default="16,128,1000", help="comma-separated engine counts")
    p.add_argument("--tp", type=int, default=8, help="GPUs per engine")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--layout", choices=LAYOUTS, default="tp")
    p.add_argument("--workers-per-node", type=int, default=8)
    p.add_argument(
        "--max-rss-gb",
        type=float,
        default=10.0,
        help="skip or stop a point whose memory (resident plus swapped) would pass this",
    )
    p.add_argument(
        "--balance-slack",
        type=float,
        default=PlanParams().balance_slack,
        help="the planner's chunking knob: larger, fewer chunks and pushes, looser balance",
    )
    p.add_argument("--point", help=argparse.SUPPRESS)  # the child: one point
    args = p.parse_args(argv)
    if args.point:
        print(json.dumps(measure(Point(**json.loads(args.point)))))
        return 0
    points = [
        Point(
            args.model,
            int(n),
            args.tp,
            args.dtype,
            args.layout,
            args.workers_per_node,
            args.balance_slack,
        )
        for n in args.engines.split(",")
    ]
    print(json.dumps(run(points, args.max_rss_gb * GB)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
