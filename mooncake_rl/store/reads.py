"""Keys --> whole records, ranged reads into registered buffers, and replica lookups.

Whole records are read into a fresh registered buffer and retried while a just-upserted
replica settles; ranged reads (:meth:`StoreReads.read_into`) land many ranges of many
objects in one native call and repeat those whose object lease expired mid-read. Every byte
count is verified; what lands adds to :data:`mooncake_rl.counters.COUNTERS`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from mooncake_rl.counters import COUNTERS
from mooncake_rl.errors import InvariantViolation, MooncakeError, ObjectNotFound, mooncake_error
from mooncake_rl.store.connection import StoreConnection, check, rides_failover

RECORD_READ_ATTEMPTS = 5
DESCRIPTOR_BATCH = 4096  # keys per batch_get_replica_desc RPC
DESCRIPTOR_THREADS = 4  # such RPCs in flight at once
READ_ATTEMPTS = 6
"""Ranged reads repeated after LEASE_EXPIRED: attempts in a row that land nothing."""
LEASE_EXPIRED = -707


@dataclass(frozen=True)
class RangeRead:
    """Copy ``length`` bytes at ``src_offset`` of object ``key`` to ``dst_offset`` of a buffer."""

    key: str
    src_offset: int
    dst_offset: int
    length: int

    def __post_init__(self) -> None:
        if not self.key:
            raise InvariantViolation("range read needs a key")
        if self.src_offset < 0 or self.dst_offset < 0 or self.length <= 0:
            raise InvariantViolation(f"invalid range read {self}")


class StoreReads(StoreConnection):
    """What a client reads: sizes, whole records, byte ranges, existence and replicas."""

    @rides_failover
    def size(self, key: str) -> int:
        return check(self._store.get_size(key), "get_size", f"key={key}")

    def get_bytes(self, key: str) -> bytes:
        """Whole small object (records, manifests), read into a registered buffer."""
        return self.get_array(key).tobytes()

    @rides_failover
    def get_array(self, key: str) -> np.ndarray:
        """Whole object as the uint8 array it was read into: a large one (a cached routing
        table) is used in place, not copied again.

        A record replaced by ``upsert`` moments ago can briefly answer ``REPLICA_IS_NOT_READY``
        or a transfer error while its new replica settles; such reads are retried a few times.
        A missing key is not retried.
        """
        for attempt in range(RECORD_READ_ATTEMPTS):
            try:
                return self._get_once(key)
            except ObjectNotFound:
                raise
            except MooncakeError:
                if attempt + 1 == RECORD_READ_ATTEMPTS:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _get_once(self, key: str) -> np.ndarray:
        size = check(self._store.get_size(key), "get_size", f"key={key}")
        buffer = torch.empty(max(size, 1), dtype=torch.uint8)
        self.register(buffer.data_ptr(), buffer.numel())
        try:
            code = self._store.get_into(key, buffer.data_ptr(), buffer.numel())
        finally:
            self.unregister(buffer.data_ptr())
        if code != size:
            raise mooncake_error(
                code if code < 0 else -800, "get_into", f"key={key} size={size} got={code}"
            )
        COUNTERS.add(read=size)
        return buffer[:size].numpy()

    def read_ranges(self, buffer_ptr: int, reads: Sequence[RangeRead]) -> int:
        """Ranged reads into one registered buffer; every byte count is verified."""
        return self.read_into({buffer_ptr: reads})

    @rides_failover
    def read_into(self, buffers: Mapping[int, Sequence[RangeRead]]) -> int:
        """Ranged reads into several registered buffers (each read's destination is an
        offset from its buffer's base and lies inside that registration) in one native
        call; every byte count is verified.

        A read whose object lease expired before it finished (``LEASE_EXPIRED``: a slow read
        on a loaded host) is repeated; rewriting the same bytes to the same place is
        harmless, and nothing can have removed a hard-pinned generation meanwhile. Each
        attempt that lands some ranges earns another: only ``READ_ATTEMPTS`` attempts in a
        row that land nothing give up (a loaded host may land a few ranges per lease).
        """
        pending = {base: list(reads) for base, reads in buffers.items() if reads}
        total = reread = idle = 0
        while pending:
            expired: dict[int, list[RangeRead]] = defaultdict(list)
            landed = False
            for base, read, count in self._read_once(pending):
                if count == read.length:
                    total += count
                    landed = True
                elif count == LEASE_EXPIRED and idle + 1 < READ_ATTEMPTS:
                    expired[base].append(read)
                    reread += read.length
                else:
                    context = f"key={read.key} src={read.src_offset} len={read.length} got={count}"
                    raise mooncake_error(count if count < 0 else -800, "get_into_ranges", context)
            idle = 0 if landed else idle + 1
            pending = expired
        COUNTERS.add(read=total, reread=reread)
        return total

    def _read_once(
        self, buffers: Mapping[int, Sequence[RangeRead]]
    ) -> Iterator[tuple[int, RangeRead, int]]:
        if not buffers:
            return
        bases = list(buffers)
        grouped: list[dict[str, list[RangeRead]]] = []
        for base in bases:
            by_key: dict[str, list[RangeRead]] = defaultdict(list)
            for read in buffers[base]:
                by_key[read.key].append(read)
            grouped.append(by_key)
        results = self._store.get_into_ranges(
            bases,
            [list(by_key) for by_key in grouped],
            [[[r.dst_offset for r in rs] for rs in by_key.values()] for by_key in grouped],
            [[[r.src_offset for r in rs] for rs in by_key.values()] for by_key in grouped],
            [[[r.length for r in rs] for rs in by_key.values()] for by_key in grouped],
        )
        for base, by_key, per_buffer in zip(bases, grouped, results, strict=True):
            for reads, counts in zip(by_key.values(), per_buffer, strict=True):
                for read, count in zip(reads, counts, strict=True):
                    yield base, read, count

    @rides_failover
    def exists(self, keys: Iterable[str]) -> list[bool]:
        keys = list(keys)
        if not keys:
            return []
        results = self._store.batch_is_exist(keys)
        for key, code in zip(keys, results, strict=True):
            check(code, "batch_is_exist", f"key={key}")
        return [code == 1 for code in results]

    def complete_sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Each key's size from a complete memory replica, or None; few RPCs for many keys."""
        return [None if found is None else found[0] for found in self.complete_replicas(keys)]

    @rides_failover
    def complete_replicas(self, keys: Sequence[str]) -> list[tuple[int, str] | None]:
        """Each key's (size, segment) of its first complete memory replica, or None; few
        RPCs for many keys. The segment is the replica's transport endpoint (segment name).

        Every update checks its generation's objects this way, so it is on the critical
        path: a 1T MoE has 140k objects (1.5 s here one batch at a time). The binding
        releases the GIL for the RPC, so a few batches are in flight at once, and each
        replica's fields are read once."""
        from mooncake.store import ReplicaStatus

        complete = ReplicaStatus.COMPLETE.value
        chunks = [
            keys[start : start + DESCRIPTOR_BATCH]
            for start in range(0, len(keys), DESCRIPTOR_BATCH)
        ]
        with ThreadPoolExecutor(DESCRIPTOR_THREADS, thread_name_prefix="descriptors") as pool:
            replies = list(pool.map(self._store.batch_get_replica_desc, map(list, chunks)))
        found_all: list[tuple[int, str] | None] = []
        for chunk, found in zip(chunks, replies, strict=True):
            self._check_absent([key for key in chunk if key not in found])
            replicas_of = found.get
            for key in chunk:
                held = None
                for replica in replicas_of(key, ()):
                    if replica.is_memory_replica() and replica.status.value == complete:
                        buffer = replica.get_memory_descriptor().buffer_descriptor
                        held = (buffer.size, buffer.transport_endpoint)
                        break
                found_all.append(held)
        return found_all

    def _check_absent(self, keys: Sequence[str]) -> None:
        """Descriptor calls answer "nothing" both for absent keys and for a lost leader;
        the existence check returns the error code that tells them apart."""
        if keys:
            for key, code in zip(keys, self._store.batch_is_exist(list(keys)), strict=True):
                check(code, "batch_is_exist", f"key={key}")

    @rides_failover
    def replica_segments(self, key: str) -> tuple[str, ...]:
        """Transport endpoints (segment names) holding ``key``'s memory replicas."""
        replicas = self._store.get_replica_desc(key)
        if not replicas:
            self._check_absent([key])
            raise mooncake_error(-704, "get_replica_desc", f"key={key}")
        return tuple(
            r.get_memory_descriptor().buffer_descriptor.transport_endpoint
            for r in replicas
            if r.is_memory_replica()
        )
