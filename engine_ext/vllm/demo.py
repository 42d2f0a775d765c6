"""``make demo``: a trainer publishes, a live vLLM engine switches atomically, narrated.

1. start the durable Store as ``mooncake-rl master`` does (etcd, two HA masters logging to
   it) and a node segment holder;
2. make a tiny Llama locally; 3. publish it as generation 1;
4. start vLLM with ``--worker-extension-cls mooncake_rl.Ext --load-format mooncake``;
5. publish perturbed generations and update through the coordinator (compat, then direct),
   SIGKILLing the leading master between the two: the standby takes over with every
   generation, and nothing is republished;
6. check each greedy output against a transformers reference of that generation;
7. print timings and byte counts, and shut everything down.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator
from mooncake_rl.generations.commands import publish_checkpoint
from mooncake_rl.services import DurableConfig, DurableStore, SegmentHolder
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, hf_greedy, make_tiny_llama, perturbed_copy

MODEL = "demo-tiny-llama"


def _verdict(output: list[int], reference: list[int]) -> str:
    return f"{output} {'==' if output == reference else '!='} transformers {reference}"


def _kill_leader(console: Console, durable: DurableStore) -> None:
    """SIGKILL the leading master, as a node loss would; its standby replays the log."""
    leader = durable.wait_for_leader()
    assert leader.pid is not None
    os.kill(leader.pid, signal.SIGKILL)
    killed = time.perf_counter()
    standby = durable.wait_for_leader(timeout_s=60.0)
    console.print(
        f"   [bold]SIGKILLed[/] leader {leader.rpc_address}; standby {standby.rpc_address} "
        f"leads after {time.perf_counter() - killed:.1f}s with every generation"
    )


def _updates(
    console: Console,
    store: StoreClient,
    durable: DurableStore,
    engine: VllmServer,
    checkpoints: list[Path],
    refs: list[list[int]],
) -> bool:
    table = Table("generation", "mode", "matches", "store read B", "pushed B", "update s")
    ok = True
    with Coordinator(store, [engine.url]) as coordinator:
        for index, mode in ((1, "compat"), (2, "direct")):
            if index == 2:
                _kill_leader(console, durable)
            generation = publish_checkpoint(store, MODEL, checkpoints[index], "float32").generation
            started = time.perf_counter()
            result = coordinator.update(MODEL, mode=mode)
            seconds = time.perf_counter() - started
            output = engine.complete(PROMPT)
            served = engine.mooncake("GET", "status").json()["generation"]
            ok &= output == refs[index] and served == generation
            console.print(
                f"[bold]5.[/] generation {generation} ({mode}): {_verdict(output, refs[index])}"
            )
            console.print(f"   phases {result.phase_seconds}")
            table.add_row(
                str(generation),
                mode,
                str(output == refs[index]),
                str(result.store_read_bytes),
                str(result.pushed_bytes),
                f"{seconds:.2f}",
            )
    console.print(table)
    return ok


def run_demo() -> int:
    console = Console()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mooncake-rl-demo-") as scratch:
        root = Path(scratch)
        checkpoints = [make_tiny_llama(root / "g1")]
        checkpoints += [
            perturbed_copy(checkpoints[0], root / f"g{i + 2}", seed=i + 1) for i in range(2)
        ]
        refs = [hf_greedy(c) for c in checkpoints]
        console.print(f"[bold]1.[/] tiny Llama in {checkpoints[0]} (+2 perturbed next policies)")
        with (
            DurableStore(DurableConfig(masters=2, log_dir=root / "logs")) as durable,
            SegmentHolder(
                durable.master_address,
                durable.metadata_url,
                256 << 20,
                log_dir=root / "logs",
                cluster_id=durable.cluster_id,
            ) as holder,
        ):
            console.print(
                f"[bold]2.[/] durable Store {durable.master_address} (etcd, 2 HA masters), "
                f"segment {holder.segment}"
            )
            settings = Settings(
                master=durable.master_address,
                cluster_id=durable.cluster_id,
                metadata=durable.metadata_url,
                node="trainer-node",
                segment_bytes=0,
                local_segment=holder.segment,
            )
            with StoreClient(settings) as store:
                record = publish_checkpoint(store, MODEL, checkpoints[0], "float32")
                console.print(f"[bold]3.[/] published generation {record.generation}")
                booted = time.perf_counter()
                rollout = settings.with_overrides(node="rollout-node")
                with VllmServer(
                    checkpoints[0], rollout, name=MODEL, log_dir=root / "logs"
                ) as engine:
                    output = engine.complete(PROMPT)
                    ok = output == refs[0]
                    console.print(
                        f"[bold]4.[/] vLLM loaded generation 1 from the Store in "
                        f"{time.perf_counter() - booted:.0f}s: {_verdict(output, refs[0])}"
                    )
                    ok &= _updates(console, store, durable, engine, checkpoints, refs)
    verdict = "[green]all outputs match their references" if ok else "[red]MISMATCH"
    console.print(
        f"[bold]6.[/] stopped everything after {time.perf_counter() - started:.0f}s; {verdict}"
    )
    return 0 if ok else 1
