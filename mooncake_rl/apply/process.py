"""A simulated rollout worker in its own process: an ApplyWorker driven over queues.

Tests and benchmarks run several of these on different node labels to exercise the data
plane across real processes without an inference engine.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from mooncake_rl.apply.delta import DeltaRead, decode, land
from mooncake_rl.apply.executor import Batch
from mooncake_rl.apply.landing import Landing
from mooncake_rl.apply.registration import Region
from mooncake_rl.apply.wire import with_checksums
from mooncake_rl.apply.worker import (
    ApplyWorker,
    allocate_arena,
    arena_views,
    copied_into_order,
    covering_spans,
    peers_from,
    pushed_regions,
    region_of,
)
from mooncake_rl.counters import COUNTERS
from mooncake_rl.generations.chain import DeltaTable
from mooncake_rl.generations.checksums import ObjectChecksum
from mooncake_rl.plan.delta import DELTA_REGION, EntryBlock, entry_offsets
from mooncake_rl.plan.demand import COMPAT_REGION, FALLBACK_REGION, STAGING_REGION
from mooncake_rl.plan.update import UpdatePlan
from mooncake_rl.settings import Settings

CARVE_BYTES = 512
"""CUDA's caching allocator rounds every block to 512 bytes."""


@dataclass(frozen=True)
class WorkerMemory:
    """Where a simulated worker receives: the device, and whether it holds live parameters.

    With ``parameters``, every region but the planner's (staging, fallback, compat) is a
    parameter of its own allocation, as an engine's are. ``in_place``: the parameters are the
    receive regions themselves (bytes land in live storage); otherwise they are received in
    the arena and landed by ``("land",)``: a :class:`~mooncake_rl.apply.landing.Landing`
    planned once, when the worker starts.
    """

    device: str = "cpu"
    parameters: bool = False
    in_place: bool = False

    def __post_init__(self) -> None:
        if self.in_place and not self.parameters:
            raise ValueError("in-place receive needs parameters to receive into")


def serve_worker(
    settings: Settings,
    worker_id: str,
    region_sizes: dict[str, int],
    inbox: Any,
    outbox: Any,
    memory: WorkerMemory = WorkerMemory(),
) -> None:
    """Commands, each as ``(sequence, command)``, answered ``(sequence, status, value)``:
    ("prepare", stages[, checksums]) -> description; ("run", batches or the index of a
    prepared stage, descriptions or None for the last ones sent) -> result; ("dump",
    region) -> bytes; ("fill", {region: bytes}) -> None; ("delta_prepare", delta table,
    reads, entry blocks, the planned fetch's batches) -> the description of the worker's
    entry buffer; ("delta_fetch", descriptions), then ("delta_land", checksums) -> the
    in-place delta path's figures (:class:`DeltaTaker`); ("land",) -> landing figures;
    ("digest",) -> XXH3-64 of every parameter; ("stop",)."""
    params, slabs = _parameters(region_sizes, memory)
    received = _Received.laid_out(region_sizes, params, slabs, memory, order=())
    worker = ApplyWorker(settings, worker_id)
    taker: DeltaTaker | None = None
    prepared: tuple = ()
    described: list[dict[str, Any]] = []
    try:
        while True:
            sequence, command = inbox.get(timeout=300)
            try:
                if command[0] == "prepare":
                    checksums = command[2] if len(command) > 2 else None
                    order = copied_into_order(command[1], worker_id)
                    if order != received.order:  # as an engine lays its arena out at prepare
                        received = _Received.laid_out(
                            region_sizes, params, slabs, memory, order, received.arena
                        )
                    worker.prepare(received.spans, received.regions, command[1], checksums)
                    worker.promote()
                    prepared = tuple(command[1])
                    outbox.put((sequence, "ok", worker.describe()))
                elif command[0] == "run":
                    before = COUNTERS.snapshot()
                    # An engine keeps its slice from prepare; so does a stage run by index.
                    batches = prepared[command[1]] if isinstance(command[1], int) else command[1]
                    # The peers' descriptions come once; later stages reuse them (None).
                    described = command[2] if command[2] is not None else described
                    peers = peers_from(described, pushed_regions(batches, worker_id))
                    result = worker.run_stage(batches, peers)
                    delta = COUNTERS.snapshot() - before
                    outbox.put((sequence, "ok", {"result": result, "counters": delta}))
                elif command[0] == "dump":
                    dump = received.buffers[command[1]].cpu().numpy().tobytes()
                    outbox.put((sequence, "ok", dump))
                elif command[0] == "fill":
                    for name, data in command[1].items():
                        received.buffers[name].copy_(
                            torch.frombuffer(bytearray(data), dtype=torch.uint8)
                        )
                    outbox.put((sequence, "ok", None))
                elif command[0] == "delta_prepare":
                    taker = taker or DeltaTaker(ApplyWorker(settings, worker_id))
                    outbox.put((sequence, "ok", taker.prepare(*command[1:])))
                elif command[0] == "delta_fetch":
                    assert taker is not None, "delta_fetch before delta_prepare"
                    outbox.put((sequence, "ok", taker.fetch(command[1])))
                elif command[0] == "delta_land":
                    assert taker is not None, "delta_land before delta_prepare"
                    outbox.put((sequence, "ok", taker.land(received.buffers, command[1])))
                elif command[0] == "land":
                    outbox.put((sequence, "ok", _land(received.landing, params, memory)))
                elif command[0] == "digest":
                    digests = {
                        n: xxhash.xxh3_64_hexdigest(t.cpu().numpy().tobytes())
                        for n, t in params.items()
                    }
                    outbox.put((sequence, "ok", digests))
                elif command[0] == "stop":
                    outbox.put((sequence, "ok", None))
                    return
            except Exception as error:
                outbox.put(
                    (
                        sequence,
                        "error",
                        f"{type(error).__name__}: {error}\n{traceback.format_exc()}",
                    )
                )
    finally:
        if taker is not None:
            taker.worker.close()
        worker.close()


@dataclass(frozen=True)
class _Received:
    """Where a simulated worker receives: its arena, regions (arena and in-place
    parameters), the spans to register, byte views by region, and the planned landing."""

    arena: torch.Tensor
    regions: dict[str, Region]
    spans: list[Region]
    buffers: dict[str, torch.Tensor]
    landing: Landing
    order: list[str]

    @classmethod
    def laid_out(
        cls,
        sizes: Mapping[str, int],
        params: Mapping[str, torch.Tensor],
        slabs: list[Region] | None,
        memory: WorkerMemory,
        order: list[str],
        reuse: torch.Tensor | None = None,
    ) -> _Received:
        in_place = dict(params) if memory.in_place else {}
        received = {n: size for n, size in sizes.items() if n not in in_place}
        arena, regions = allocate_arena(received, reuse, memory.device, order=order)
        buffers = arena_views(arena, regions)
        landing = Landing.of((params[n], buffers[n]) for n in params if n not in in_place)
        regions |= {name: region_of(name, tensor) for name, tensor in in_place.items()}
        held = [region_of("arena", arena), *(regions[n] for n in in_place)]
        return cls(arena, regions, covering_spans(held, slabs), buffers | in_place, landing, order)


def _parameters(
    sizes: Mapping[str, int], memory: WorkerMemory
) -> tuple[dict[str, torch.Tensor], list[Region] | None]:
    """The worker's parameters, each a tensor of its own, in the order the engine declared
    them (an engine builds its modules, and so allocates their parameters, in the model's
    order, as a trainer's state dict lists them), and the memory they were carved
    from (``None``: read the CUDA allocator's segments). On the CPU they are carved from one
    slab at ``CARVE_BYTES`` steps, as CUDA's caching allocator carves a GPU's from its
    segments, and the slab is registered whole, as ``covering_spans`` registers a segment:
    Mooncake's ``register_buffer`` takes time in proportion to the buffers already
    registered (4,000 take 49 s here), so a buffer per parameter would spend minutes
    registering a 20,000-tensor worker, which no GPU run pays."""
    if not memory.parameters:
        return {}, None
    planner = {STAGING_REGION, FALLBACK_REGION, COMPAT_REGION}
    names = [n for n in sizes if n not in planner]  # declared: the model's order
    if memory.device.startswith("cuda"):
        params = {n: torch.zeros(sizes[n], dtype=torch.uint8, device=memory.device) for n in names}
        return params, None
    steps = [-(-sizes[n] // CARVE_BYTES) * CARVE_BYTES for n in names]
    slab = torch.zeros(max(sum(steps), 1), dtype=torch.uint8)
    starts = itertools.accumulate(steps, initial=0)
    params = {n: slab[at : at + sizes[n]] for n, at in zip(names, starts, strict=False)}
    return params, [region_of("slab", slab)]


class DeltaTaker:
    """The in-place delta path of a simulated worker whose regions hold the delta's base,
    on an :class:`ApplyWorker` of its own (its one region: the entry buffer), in the steps
    an engine takes (:mod:`engine_ext.delta`): prepare lays the buffer out and registers it;
    fetch runs the planned stage (reads, and pushes to the peers that share entries); once
    every worker fetched (the caller's barrier), land decodes, scatters and checks every
    box against N (:mod:`mooncake_rl.apply.delta`)."""

    def __init__(self, worker: ApplyWorker) -> None:
        self.worker = worker
        self.prepared: tuple[DeltaTable, Sequence[DeltaRead], Sequence[EntryBlock]] | None = None
        self.batches: tuple[Batch, ...] = ()
        self.entries = torch.empty(0, dtype=torch.uint8)

    def prepare(
        self,
        table: DeltaTable,
        reads: Sequence[DeltaRead],
        blocks: Sequence[EntryBlock],
        batches: Sequence[Batch],
    ) -> dict[str, Any]:
        self.entries = torch.empty(max(entry_offsets(blocks)[-1], 1), dtype=torch.uint8)
        region = region_of(DELTA_REGION, self.entries)
        self.worker.prepare(region, {DELTA_REGION: region}, [batches])
        self.worker.promote()
        self.prepared, self.batches = (table, reads, blocks), tuple(batches)
        return self.worker.describe()

    def fetch(self, descriptions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        before = COUNTERS.snapshot()
        started = time.perf_counter()
        peers = peers_from(descriptions, pushed_regions(self.batches, self.worker.worker_id))
        self.worker.run_stage(self.batches, peers)
        counters = COUNTERS.snapshot() - before
        return {
            "fetch_seconds": time.perf_counter() - started,
            "store_read_bytes": counters.store_read_bytes,
            "pushed_bytes": counters.te_pushed_bytes,
        }

    def land(
        self, regions: Mapping[str, torch.Tensor], checksums: Mapping[str, ObjectChecksum]
    ) -> dict[str, Any]:
        assert self.prepared is not None, "land before prepare"
        table, reads, blocks = self.prepared
        started = time.perf_counter()
        changes = decode(self.entries.numpy(), blocks, table, reads)
        decoded = time.perf_counter() - started
        return {
            "decode_seconds": decoded,
            **land(changes, reads, regions, checksums),
            "entry_bytes": changes.entry_bytes,
            "changed_bytes": changes.changed_bytes,
        }


def _land(
    landing: Landing, params: Mapping[str, torch.Tensor], memory: WorkerMemory
) -> dict[str, Any]:
    """Received bytes into the parameters: nothing to do in place, else the planned copies."""
    nbytes = sum(t.numel() for t in params.values())
    started = time.perf_counter()
    landing.run()
    if memory.device.startswith("cuda"):
        torch.cuda.synchronize(memory.device)
    return {
        "seconds": time.perf_counter() - started,
        "tensors": len(params),
        "copies": 0 if memory.in_place else landing.runs,
        "in_place_bytes": nbytes if memory.in_place else 0,
        "staged_bytes": 0 if memory.in_place else nbytes,
    }


class WorkerCluster:
    """Worker processes (spawned) on node labels, each with its own inbox and outbox."""

    def __init__(
        self,
        settings_by_worker: Mapping[str, Settings],
        region_sizes: Mapping[str, Mapping[str, int]],
        memory: WorkerMemory = WorkerMemory(),
    ) -> None:
        context = mp.get_context("spawn")
        self._sequence = 0  # of the last call; replies echo it
        self.inboxes: dict[str, Any] = {}
        self.outboxes: dict[str, Any] = {}
        self.processes: dict[str, Any] = {}
        for worker_id, settings in settings_by_worker.items():
            self.inboxes[worker_id], self.outboxes[worker_id] = context.Queue(), context.Queue()
            process = context.Process(
                target=serve_worker,
                args=(
                    settings,
                    worker_id,
                    dict(region_sizes[worker_id]),
                    self.inboxes[worker_id],
                    self.outboxes[worker_id],
                    memory,
                ),
            )
            process.start()
            self.processes[worker_id] = process

    def call(self, worker_id: str, *command: Any, timeout_s: float = 600) -> Any:
        status, value = self.call_all({worker_id: command}, timeout_s)[worker_id]
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call_all(
        self, commands: Mapping[str, tuple], timeout_s: float = 600
    ) -> dict[str, tuple[str, Any]]:
        """Send every command first (so workers run concurrently), then collect replies.

        Each command carries a sequence number and its reply echoes it: a reply that comes
        after its call gave up (a worker slow to start on a loaded host) is dropped, not
        taken for the answer to the next call."""
        self._sequence += 1
        for worker_id, command in commands.items():
            self.inboxes[worker_id].put((self._sequence, command))
        deadline = time.monotonic() + timeout_s
        return {worker_id: self._reply(worker_id, deadline, timeout_s) for worker_id in commands}

    def _reply(self, worker_id: str, deadline: float, timeout_s: float) -> tuple[str, Any]:
        """The worker's reply to the current call; an error at once if its process died
        without one."""
        outbox, process = self.outboxes[worker_id], self.processes[worker_id]

        def current(wait_s: float) -> tuple[str, Any]:
            while True:
                sequence, status, value = outbox.get(timeout=wait_s)
                if sequence == self._sequence:
                    return status, value

        while True:
            try:
                return current(max(0.0, min(0.5, deadline - time.monotonic())))
            except queue.Empty:
                pass
            if not process.is_alive():
                try:  # a reply sent just before it exited may still be in the pipe
                    return current(0.5)
                except queue.Empty:
                    return (
                        "error",
                        f"no reply: the worker exited with code {process.exitcode} "
                        "(process alive: False)",
                    )
            if time.monotonic() >= deadline:
                return "error", f"no reply within {timeout_s}s (process alive: True)"

    def close(self) -> None:
        for worker_id, process in self.processes.items():
            if process.is_alive():
                self.inboxes[worker_id].put((self._sequence + 1, ("stop",)))
                process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()

    def __enter__(self) -> WorkerCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_planned_update(
    cluster: WorkerCluster,
    plan: UpdatePlan,
    timeout_s: float = 600,
    checksums: Mapping[str, ObjectChecksum] | None = None,
) -> dict[str, Any]:
    """Prepare every worker with its slice, then run each stage on all of them (a barrier).

    Returns per-worker counter deltas (``read``, ``pushed``, ``pushed_per_peer``: bytes
    each peer received from this worker; ``copied``: local copies out of sieved spans, in
    ``copy_moves`` native moves) and
    peak staging, plus the apply wall time.
    With the generation's ``checksums`` every worker checks its landed reads (and the
    totals gain ``verified``, ``unverified`` and ``verify_seconds``).
    """
    workers = sorted(cluster.processes)

    def prepare(worker: str) -> tuple[Any, ...]:
        found = plan.worker_slice(worker)
        if checksums is None:
            return ("prepare", found.stages)
        return ("prepare", found.stages, with_checksums(found, checksums).checksums)

    prepared = cluster.call_all({w: prepare(w) for w in workers}, timeout_s)
    failed = {w: v for w, (status, v) in prepared.items() if status != "ok"}
    if failed:
        raise RuntimeError(f"prepare failed: {failed}")
    descriptions = [value for _, value in prepared.values()]
    started = time.perf_counter()
    totals: dict[str, Any] = {
        w: {
            "read": 0,
            "pushed": 0,
            "peak_staging": 0,
            "pushed_per_peer": {},
            "verified": 0,
            "unverified": 0,
            "verify_seconds": 0.0,
            "copied": 0,
            "copy_moves": 0,
        }
        for w in workers
    }
    for stage in range(plan.stages):
        commands = {w: ("run", stage, descriptions if stage == 0 else None) for w in workers}
        for worker, (status, value) in cluster.call_all(commands, timeout_s).items():
            if status != "ok":
                raise RuntimeError(f"{worker} failed in stage {stage}: {value}")
            totals[worker]["read"] += value["counters"].store_read_bytes
            totals[worker]["pushed"] += value["counters"].te_pushed_bytes
            totals[worker]["verified"] += value["result"].verified_bytes
            totals[worker]["unverified"] += value["result"].unverified_bytes
            totals[worker]["verify_seconds"] += value["result"].verify_seconds
            totals[worker]["copied"] += value["result"].copied_bytes
            totals[worker]["copy_moves"] += value["result"].copy_moves
            totals[worker]["peak_staging"] = max(
                totals[worker]["peak_staging"], value["result"].peak_staging_bytes
            )
            per_peer = totals[worker]["pushed_per_peer"]
            for peer, moved in value["result"].pushed_per_peer.items():
                per_peer[peer] = per_peer.get(peer, 0) + moved
    return {"seconds": time.perf_counter() - started, "workers": totals}
