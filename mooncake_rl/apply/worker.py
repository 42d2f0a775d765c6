"""One rollout worker's data-plane endpoint: Store client, TE client, regions, executor.

Engine adapters hold one per worker process (TP rank); tests and benchmarks hold one per
simulated worker. Regions are the worker's destination buffers (parameters or staging);
they are registered in both domains at prepare and reused across generations.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from mooncake_rl.apply.executor import Batch, Peer, StageResult, WorkerExecutor
from mooncake_rl.apply.registration import Domain, Region, RegistrationManager
from mooncake_rl.engine import TransferEngineClient
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.checksums import ObjectChecksum
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

ALIGN = 64


def region_of(name: str, tensor: torch.Tensor) -> Region:
    if not tensor.is_contiguous():
        raise InvariantViolation(f"region {name} must be contiguous")
    return Region(
        name, tensor.data_ptr(), tensor.numel() * tensor.element_size(), str(tensor.device)
    )


def region_align(nbytes: int) -> int:
    """Where a region of ``nbytes`` may start in an arena: at a multiple of ``ALIGN``, or of
    the largest power of two dividing its size where that is smaller. Its element size
    divides its size, so its views stay aligned to its dtype, while the small regions a
    sieved span's copies fill one after another sit back to back."""
    return min(ALIGN, nbytes & -nbytes)


def arena_offsets(
    sizes: Mapping[str, int], order: Sequence[str] = ()
) -> tuple[dict[str, int], int]:
    """Each region's offset in an arena and the arena's bytes: the regions named in
    ``order`` first, in that order, then the others by name; pure."""
    names = [n for n in dict.fromkeys(order) if n in sizes]
    names += sorted(set(sizes) - set(names))
    offsets, cursor = {}, 0
    for name in names:
        align = region_align(sizes[name])
        offsets[name] = cursor = -(-cursor // align) * align
        cursor += sizes[name]
    return offsets, -(-cursor // ALIGN) * ALIGN


def copied_into_order(stages: Sequence[Sequence[Batch]], worker_id: str) -> list[str]:
    """The regions this worker's local copies fill (a sieved span's pieces), in the order of
    their sources. An arena laid out in this order (:func:`allocate_arena`) receives each
    span's pieces back to back, so the copies out of a span merge into one move instead of
    one per piece (5,000 pieces of a rank-major pack: one ``memmove``, not 5,000)."""
    copies = sorted(
        (push.src_region, push.src_offset, push.dst_region)
        for batches in stages
        for batch in batches
        for push in batch.pushes
        if push.peer == worker_id
    )
    return list(dict.fromkeys(region for _, _, region in copies))


def allocate_arena(
    sizes: Mapping[str, int],
    reuse: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    pin: bool = False,
    order: Sequence[str] = (),
) -> tuple[torch.Tensor, dict[str, Region]]:
    """Every region in one buffer on ``device``, laid out by :func:`arena_offsets`.

    ``reuse`` (the worker's current arena) is kept when the layout fits in it and it lives on
    ``device``: the bytes are overwritten by every update anyway, and an unchanged arena keeps
    its registrations (no re-registration, no new memory for peers to learn about).
    Otherwise a zeroed, larger buffer is allocated. On a GPU the arena sits beside the
    parameters it feeds, so Store reads and peer pushes land in device memory; ``pin``
    pins a host arena (host staging for a CUDA engine). ``order``: regions to lay out first,
    in this order (:func:`copied_into_order`).
    """
    device = torch.device(device)
    offsets, cursor = arena_offsets(sizes, order)
    needed = max(cursor, ALIGN)
    fits = (
        reuse is not None
        and reuse.numel() >= needed
        and reuse.device == device
        and (not pin or reuse.is_pinned())
    )
    arena = reuse if fits else torch.zeros(needed, dtype=torch.uint8, device=device, pin_memory=pin)
    base = arena.data_ptr()
    return arena, {
        n: Region(n, base + offsets[n], sizes[n], str(arena.device)) for n in sorted(sizes)
    }


def covering_spans(
    regions: Sequence[Region], segments: Sequence[Region] | None = None
) -> list[Region]:
    """The fewest registrable spans that cover ``regions`` (a staging arena and the live
    parameters received in place beside it).

    On CUDA a span is the caching allocator's segment holding the parameter: one
    ``cudaMalloc`` block, valid while any tensor lives in it, so thousands of parameters
    cost a handful of registrations. Elsewhere, regions that touch are merged; gaps are
    never registered (they may be memory nobody owns). ``segments``: the allocator's
    segments (read from torch when ``None`` and a region is on CUDA); they never overlap,
    so the one holding a region is the last to start at or before it (a bisection: a 1T
    MoE rank has tens of thousands of parameters in thousands of segments).
    """
    if segments is None:
        on_cuda = any(r.device.startswith("cuda") for r in regions)
        segments = _cuda_segments() if on_cuda else []
    ordered = sorted(segments, key=lambda s: (s.device, s.base))
    starts = [(s.device, s.base) for s in ordered]
    spans: list[Region] = []
    taken: set[tuple[str, int]] = set()
    for region in sorted(regions, key=lambda r: (r.device, r.base)):
        at = bisect.bisect_right(starts, (region.device, region.base)) - 1
        segment = ordered[at] if at >= 0 else None
        if (
            segment is not None
            and segment.device == region.device
            and region.base + region.size <= segment.base + segment.size
        ):
            if starts[at] not in taken:
                taken.add(starts[at])
                spans.append(segment)
            continue
        last = spans[-1] if spans else None
        if (
            last is not None
            and (last.device, last.base) not in taken
            and last.device == region.device
            and region.base <= last.base + last.size
        ):
            end = max(last.base + last.size, region.base + region.size)
            spans[-1] = Region(last.name, last.base, end - last.base, last.device)
        else:
            spans.append(Region(f"span{len(spans)}", region.base, region.size, region.device))
    return spans


def _cuda_segments() -> list[Region]:
    return [
        Region(f"segment{index}", s["address"], s["total_size"], f"cuda:{s['device']}")
        for index, s in enumerate(torch.cuda.memory.memory_snapshot())
    ]


def arena_views(arena: torch.Tensor, regions: Mapping[str, Region]) -> dict[str, torch.Tensor]:
    base = arena.data_ptr()
    return {n: arena[r.base - base : r.base - base + r.size] for n, r in regions.items()}


class ApplyWorker:
    def __init__(self, settings: Settings, worker_id: str) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self.store = StoreClient(settings)
        self.engine = TransferEngineClient(settings)
        self.registrations = RegistrationManager(
            worker_id, {Domain.STORE: self.store, Domain.ENGINE: self.engine}
        )
        self.regions: dict[str, Region] = {}
        self.spans: list[Region] = []
        self.checksums: Mapping[str, ObjectChecksum] | None = None
        self.executor: WorkerExecutor | None = None

    def describe(self) -> dict[str, Any]:
        """What peers need to write here: TE endpoint, node and region addresses."""
        return {
            "worker_id": self.worker_id,
            "node": self.settings.node,
            "endpoint": self.engine.endpoint,
            "regions": {n: {"base": r.base, "size": r.size} for n, r in self.regions.items()},
        }

    def prepare(
        self,
        spans: Region | Sequence[Region],
        regions: Mapping[str, Region],
        stages: Sequence[Sequence[Batch]],
        checksums: Mapping[str, ObjectChecksum] | None = None,
    ) -> None:
        """Validate every local range and register the memory; touches no bytes.

        ``spans``: the memory the regions lie in, registered in both domains: one arena, or
        several (parameters received in place, each its own span, beside a staging arena).
        ``checksums`` (the generation's table, at least every key this worker reads) makes
        every later stage check its landed reads; without it they land unchecked.

        Spans that differ from last time are registered on the same Transfer Engine and
        the old ones released. Peers need not learn of them in advance: a TCP receiver
        checks each write against what it has registered when the write arrives (so a write
        into released memory is refused), and RDMA reloads a peer's descriptor when an
        address misses it. One endpoint per worker for its lifetime also means peers'
        connections are made once and reused by every later update.
        """
        spans = [spans] if isinstance(spans, Region) else list(spans)
        executor = WorkerExecutor(
            self.store,
            self.engine,
            regions,
            self.settings.staging_watermark_bytes,
            checksums,
            spans,
            self.worker_id,
        )
        for batches in stages:
            executor.keep(batches)  # validated and compiled once, for every stage
        for region in regions.values():
            if not any(
                s.base <= region.base and region.base + region.size <= s.base + s.size
                for s in spans
            ):
                raise InvariantViolation(
                    f"region {region.name} lies outside the worker's registered memory"
                )
        kept = {(s.base, s.size) for s in spans}
        stale = [s.base for s in self.spans if (s.base, s.size) not in kept]
        if stale:
            self.registrations.release(stale)
        self.registrations.provision(spans)
        self.spans = spans
        self.regions = dict(regions)
        self.checksums = checksums
        self.executor = executor

    def promote(self) -> None:
        self.registrations.promote()

    def rollback(self) -> None:
        self.registrations.rollback()

    def run_stage(
        self,
        batches: Sequence[Batch],
        peers: Mapping[str, Peer],
        scatter: Callable[[Batch], None] | None = None,
    ) -> StageResult:
        """Run one stage's ``batches`` (compiled at prepare when they are the slice's)."""
        if self.executor is None:
            raise InvariantViolation("run_stage before prepare: no regions to receive into")
        return self.executor.run(batches, peers, scatter)

    def close(self) -> None:
        self.registrations.teardown()
        self.engine.close()
        self.store.close()


def pushed_regions(batches: Sequence[Batch], worker_id: str | None = None) -> dict[str, set[str]]:
    """The peers ``batches`` push to, each with the regions those pushes land in. Pushes to
    ``worker_id`` itself are local copies (a sieved span's pieces), checked against its own
    regions: they need no peer, and naming them would build a region per piece each stage."""
    found: dict[str, set[str]] = {}
    for batch in batches:
        for push in batch.pushes:
            if push.peer != worker_id:
                found.setdefault(push.peer, set()).add(push.dst_region)
    return found


def peers_from(
    descriptions: Sequence[Mapping[str, Any]],
    needed: Mapping[str, Collection[str]] | None = None,
) -> dict[str, Peer]:
    """The peers that ``descriptions`` advertise; with ``needed`` (:func:`pushed_regions`),
    only those peers, each with only those regions. A MoE worker advertises a region per
    parameter (tens of thousands) while a stage pushes into a few (sieved spans land in
    staging): building every region costs ~3 us each, per stage."""
    return {
        d["worker_id"]: Peer(
            d["endpoint"],
            {
                n: Region(n, r["base"], r["size"])
                for n, r in d["regions"].items()
                if needed is None or n in needed[d["worker_id"]]
            },
        )
        for d in descriptions
        if needed is None or d["worker_id"] in needed
    }
