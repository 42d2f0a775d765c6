"""Execute one worker's routing slice: ranged Store reads, then TE one-sided pushes.

Batches flow through a pipeline — read(k+1) overlaps verify(k) overlaps push(k-1) overlaps
scatter(k-2) — on background threads (Mooncake's bindings and xxHash release the GIL while
they move or hash bytes). With the generation's checksum table, every batch's landed reads
are checked (``mooncake_rl.apply.verify``) before any of its bytes is pushed to a peer or
scattered; a mismatch fails the stage with ``CorruptObject`` naming the object.

A staging watermark bounds the bytes of batches that are read but not yet pushed; it must
admit at least two batches so reads and pushes can overlap at all (the coordinator checks
every worker's watermark against the plan's batch before it drains an engine).

A push to the worker itself is a local copy (a sieved span's pieces, out of staging): it runs
as a batched in-memory copy (``mooncake_rl.apply.copies``), not through the Transfer Engine.

Every byte count Mooncake returns is verified by the wrappers; a failure raises with the
range, the peer and the Mooncake error. Consumers are passive: a worker learns that its bytes
arrived only because every worker's ``run_stage`` returned (the coordinator's barrier).
"""

from __future__ import annotations

import bisect
import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from mooncake_rl.apply.coalesce import coalesced_reads, coalesced_writes
from mooncake_rl.apply.copies import LocalCopier, PlannedCopies
from mooncake_rl.apply.registration import Region
from mooncake_rl.apply.verify import Landed, RangeVerifier
from mooncake_rl.engine import TransferEngineClient, Write
from mooncake_rl.errors import InvariantViolation, MooncakeError
from mooncake_rl.generations.checksums import ObjectChecksum
from mooncake_rl.store import RangeRead, StoreClient


@dataclass(frozen=True)
class ReadOp:
    """Read ``length`` bytes at ``src_offset`` of Store object ``key`` into a local region."""

    key: str
    src_offset: int
    region: str
    dst_offset: int
    length: int


@dataclass(frozen=True)
class PushOp:
    """Write local region bytes into a peer worker's region (one-sided)."""

    peer: str
    src_region: str
    src_offset: int
    dst_region: str
    dst_offset: int
    length: int


@dataclass(frozen=True)
class Batch:
    reads: tuple[ReadOp, ...] = ()
    pushes: tuple[PushOp, ...] = ()

    @property
    def staging_bytes(self) -> int:
        return sum(op.length for op in self.reads)


@dataclass(frozen=True)
class Peer:
    """Where a peer worker can be written: its TE endpoint and registered regions."""

    endpoint: str
    regions: Mapping[str, Region]


@dataclass
class StageResult:
    read_bytes: int = 0
    pushed_bytes: int = 0
    peak_staging_bytes: int = 0
    batches: int = 0
    pushed_per_peer: dict[str, int] = field(default_factory=dict)
    verified_bytes: int = 0
    """Read bytes checked against their block (or whole-object) hash."""
    unverified_bytes: int = 0
    """Read bytes in blocks the batch covered only in part (or all, without a table)."""
    verify_seconds: float = 0.0
    """Time spent hashing (on the verify thread, overlapped with reads and pushes)."""
    copied_bytes: int = 0
    """Bytes copied between the worker's own regions (local copies, not pushed)."""
    copy_moves: int = 0
    """Native moves those copies took (copies adjacent on both sides merge into one)."""


class _Watermark:
    """Admits batches while their staging bytes fit; always admits one batch alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.peak = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int, aborted: threading.Event) -> None:
        with self._cond:
            while self.in_flight and self.in_flight + nbytes > self.limit and not aborted.is_set():
                self._cond.wait(0.1)
            self.in_flight += nbytes
            self.peak = max(self.peak, self.in_flight)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.in_flight -= nbytes
            self._cond.notify_all()


def _containing_spans(regions: Mapping[str, Region], spans: Sequence[Region]) -> dict[str, int]:
    """Per region, the base of the registered span holding it (its own base when no span
    given holds it: a region registered alone)."""
    ordered = sorted(spans, key=lambda s: s.base)
    starts = [s.base for s in ordered]
    found = {}
    for name, region in regions.items():
        at = bisect.bisect_right(starts, region.base) - 1
        inside = at >= 0 and region.base + region.size <= starts[at] + ordered[at].size
        found[name] = starts[at] if inside else region.base
    return found


@dataclass(frozen=True, eq=False)
class CompiledBatch:
    """A batch resolved against one worker's memory: its native read calls (by registered
    span, coalesced), the pieces its checks hash (``None``: no checksum table), its local
    copies as merged addresses, and its pushes to peers (whose addresses come with the
    stage). A worker compiles its slice at prepare, so a stage does no per-range Python
    work on its own memory (5,000 pieces of a MoE pack: ~10 ms a stage, before)."""

    batch: Batch
    reads: Mapping[int, list[RangeRead]]
    landed: Mapping[str, list[Landed]] | None
    copies: PlannedCopies
    remote: tuple[PushOp, ...]


class WorkerExecutor:
    """Runs batches for one worker against its Store client, TE client and regions."""

    def __init__(
        self,
        store: StoreClient,
        engine: TransferEngineClient,
        regions: Mapping[str, Region],
        staging_watermark_bytes: int,
        checksums: Mapping[str, ObjectChecksum] | None = None,
        spans: Sequence[Region] = (),
        worker_id: str | None = None,
    ) -> None:
        """``worker_id``: this worker's name in the plan; pushes to it are local copies."""
        self.store = store
        self.engine = engine
        self.worker_id = worker_id
        self.regions = dict(regions)
        self.copier = LocalCopier(self.regions)
        self._span_of = _containing_spans(self.regions, spans)
        self.watermark_bytes = staging_watermark_bytes
        self.verifier = RangeVerifier(checksums) if checksums is not None else None
        self._compiled: dict[int, CompiledBatch] = {}

    def keep(self, batches: Sequence[Batch]) -> None:
        """Validate and compile the slice's ``batches`` once (at prepare), for every stage
        that runs them; touches no byte."""
        for batch in batches:
            self._compiled[id(batch)] = self.compile(batch)

    def validate(
        self, batches: Sequence[Batch], peers: Mapping[str, Peer] | None = None
    ) -> list[CompiledBatch]:
        """Every range lies inside a known region, locally (as compiled by :meth:`keep`, or
        now) and, with ``peers``, at the peer; touches no byte."""
        kept = (self._compiled.get(id(batch)) for batch in batches)
        compiled = [
            found if found is not None and found.batch is batch else self.compile(batch)
            for found, batch in zip(kept, batches, strict=True)
        ]
        if peers is not None:
            for found in compiled:
                for push in found.remote:
                    peer = peers.get(push.peer)
                    if peer is None:
                        raise InvariantViolation(f"push to unknown peer {push.peer}")
                    self._region(peer.regions, push.dst_region, push.peer).address(
                        push.dst_offset, push.length
                    )
        return compiled

    def compile(self, batch: Batch) -> CompiledBatch:
        """``batch`` resolved against this worker's memory; raises if it leaves it."""
        if batch.staging_bytes > self.watermark_bytes:
            raise InvariantViolation(
                f"a batch of {batch.staging_bytes} bytes exceeds the staging watermark "
                f"{self.watermark_bytes} (MOONCAKE_RL_STAGING_WATERMARK_BYTES): raise it to "
                "twice the plan's batch, or plan smaller batches (MOONCAKE_RL_BATCH_BYTES, "
                "`mooncake-rl update --batch-bytes`)"
            )
        local = self.regions
        for push in batch.pushes:
            self._region(local, push.src_region, "local").address(push.src_offset, push.length)
            if push.peer == self.worker_id:
                self._region(local, push.dst_region, "local").address(push.dst_offset, push.length)
        return CompiledBatch(
            batch,
            self._reads(batch),
            None
            if self.verifier is None
            else self.verifier.landed(
                [
                    (op.key, op.src_offset, op.length, local[op.region], op.dst_offset)
                    for op in batch.reads
                ]
            ),
            self.copier.plan(
                [
                    (o.src_region, o.src_offset, o.dst_region, o.dst_offset, o.length)
                    for o in batch.pushes
                    if o.peer == self.worker_id
                ]
            ),
            tuple(op for op in batch.pushes if op.peer != self.worker_id),
        )

    @staticmethod
    def _region(regions: Mapping[str, Region], name: str, owner: str) -> Region:
        try:
            return regions[name]
        except KeyError:
            raise InvariantViolation(f"{owner} has no region {name!r}") from None

    def _reads(self, batch: Batch) -> dict[int, list[RangeRead]]:
        """The batch's reads for one native call, each destination an offset from the base
        of the registered span holding its region, so ranges adjacent in memory merge across
        regions (a staged parameter's shard is a region of its own: one call per region cost
        ~0.6 ms each). A range never crosses a span: Mooncake refuses one that leaves the
        registration its buffer starts."""
        by_span: dict[int, list[RangeRead]] = defaultdict(list)
        for op in batch.reads:
            region = self._region(self.regions, op.region, "local")
            span = self._span_of[op.region]
            address = region.address(op.dst_offset, op.length)
            by_span[span].append(RangeRead(op.key, op.src_offset, address - span, op.length))
        return {s: coalesced_reads(r) for s, r in by_span.items()}

    def _verify(self, compiled: CompiledBatch, result: StageResult) -> None:
        if self.verifier is None or compiled.landed is None:
            result.unverified_bytes += compiled.batch.staging_bytes
            return
        stats = self.verifier.check(compiled.landed)
        result.verified_bytes += stats.verified_bytes
        result.unverified_bytes += stats.unverified_bytes
        result.verify_seconds += stats.seconds

    def _push(self, compiled: CompiledBatch, peers: Mapping[str, Peer], result: StageResult) -> int:
        result.copied_bytes += compiled.copies.run()
        result.copy_moves += compiled.copies.moves
        by_peer: dict[str, list[Write]] = defaultdict(list)
        for op in compiled.remote:
            peer = peers[op.peer]
            src = self.regions[op.src_region].address(op.src_offset, op.length)
            dst = peer.regions[op.dst_region].address(op.dst_offset, op.length)
            by_peer[op.peer].append(Write(src, dst, op.length))
        total = 0
        for name, writes in by_peer.items():
            try:
                moved = self.engine.write(peers[name].endpoint, coalesced_writes(writes))
            except MooncakeError as error:
                raise type(error)(
                    error.code, error.operation, f"peer worker {name}: {error.context}"
                ) from error
            result.pushed_per_peer[name] = result.pushed_per_peer.get(name, 0) + moved
            total += moved
        return total

    def run(
        self,
        batches: Sequence[Batch],
        peers: Mapping[str, Peer],
        scatter: Callable[[Batch], None] | None = None,
    ) -> StageResult:
        """Pipeline the batches; returns only when every read, push and scatter is done."""
        compiled = self.validate(batches, peers)
        result = StageResult(batches=len(batches))
        watermark = _Watermark(self.watermark_bytes)
        aborted = threading.Event()
        failures: list[BaseException] = []
        read_done: queue.Queue[CompiledBatch | None] = queue.Queue()
        verified: queue.Queue[CompiledBatch | None] = queue.Queue()
        push_done: queue.Queue[CompiledBatch | None] = queue.Queue()

        def guarded(body: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                try:
                    body()
                except BaseException as error:  # surfaced to the caller below
                    failures.append(error)
                    aborted.set()

            return run

        def reader() -> None:
            try:
                for batch in compiled:
                    if aborted.is_set():
                        return
                    watermark.acquire(batch.batch.staging_bytes, aborted)
                    result.read_bytes += self.store.read_into(batch.reads)
                    read_done.put(batch)
            finally:
                read_done.put(None)

        def verifier() -> None:
            try:
                while (batch := read_done.get()) is not None:
                    if aborted.is_set():
                        return
                    self._verify(batch, result)
                    verified.put(batch)
            finally:
                verified.put(None)

        def pusher() -> None:
            try:
                while (batch := verified.get()) is not None:
                    if aborted.is_set():
                        return
                    result.pushed_bytes += self._push(batch, peers, result)
                    watermark.release(batch.batch.staging_bytes)
                    push_done.put(batch)
            finally:
                push_done.put(None)

        threads = [
            threading.Thread(target=guarded(reader)),
            threading.Thread(target=guarded(verifier)),
            threading.Thread(target=guarded(pusher)),
        ]
        for thread in threads:
            thread.start()
        try:
            while (batch := push_done.get()) is not None:
                if scatter is not None and not aborted.is_set():
                    scatter(batch.batch)
        except BaseException as error:
            failures.append(error)
            aborted.set()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        result.peak_staging_bytes = watermark.peak
        return result
