"""The only module that imports ``mooncake.store``: a thin, typed Store client.

Negative return codes become :mod:`mooncake_rl.errors` exceptions naming the operation and
key; successful reads and puts add to :data:`mooncake_rl.counters.COUNTERS`.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import re
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from mooncake_rl import etcd
from mooncake_rl.affinity import unpinned_native_threads
from mooncake_rl.counters import COUNTERS
from mooncake_rl.errors import (
    ConfigurationError,
    FailoverAmbiguous,
    InvariantViolation,
    MooncakeError,
    ObjectAlreadyExists,
    ObjectNotFound,
    mooncake_error,
)
from mooncake_rl.native_logs import native_setup
from mooncake_rl.services import check_system_libraries, require_etcd
from mooncake_rl.settings import Settings

T = TypeVar("T")


def loopback_transport_env(settings: Settings) -> None:
    """TCP on one machine needs Mooncake's loopback switches before a client starts."""
    if settings.protocol == "tcp":
        os.environ.setdefault("MC_FORCE_TCP", "1")
        if settings.hostname.startswith("127."):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", settings.hostname)


def regex_literal(text: str) -> str:
    """``text`` as a pattern of the master's (ECMAScript) regular expressions."""
    return re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", text)


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


RECORD_READ_ATTEMPTS = 5
RECORD_REPLICAS = 3
"""Copies of every small record (claims, fences, manifests, index): Mooncake places as many
as there are segments, so no record depends on one segment when more than one exists."""
DESCRIPTOR_BATCH = 4096  # keys per batch_get_replica_desc RPC
DESCRIPTOR_THREADS = 4  # such RPCs in flight at once
READ_ATTEMPTS = 6
"""Ranged reads repeated after LEASE_EXPIRED: attempts in a row that land nothing."""
LEASE_EXPIRED = -707
UPSERT_ATTEMPTS = 8  # upserts repeated after a concurrent upsert of the same key
ILLEGAL_CLIENT = -601
CLUSTER_ENV = "MC_STORE_CLUSTER_ID"
LEADER_LOST = frozenset({-900, -901})
"""RPC_FAIL, RPC_TIMEOUT: the leader died and no standby leads yet (seen for ~9 s here)."""
SETTLING = frozenset({-101, -103, -200, -703})
"""SEGMENT_NOT_FOUND, CLIENT_NOT_FOUND, NO_AVAILABLE_HANDLE, REPLICA_IS_NOT_READY: a new
leader before the clients have remounted their segments (seen for ~1 s after it leads)."""
SETTLE_S = 5.0
"""How long settling codes are repeated when this client saw no lost leader: the native
client can ride out the election inside one blocked call and surface only these."""
BACKOFF_S = (0.1, 0.5)  # first and longest pause between attempts while the leader changes


def _require_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail fast with a clear message; Mooncake's own setup retries for minutes."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise ConfigurationError(
            f"mooncake_master is not reachable at {address} ({error}); start one with "
            "`mooncake-rl master` or set MOONCAKE_RL_MASTER"
        ) from error


def _require_cluster(settings: Settings) -> None:
    """A durable Store's etcd answers and leads ``cluster_id`` (waiting out an election).

    Mooncake's client waits for a leader of its cluster id forever; a client whose id differs
    from the masters' would hang, so an id nobody leads or logged under is refused at once,
    naming the ids that etcd does lead.
    """
    endpoints = settings.master.removeprefix(etcd.ETCD_SCHEME)
    require_etcd(endpoints)
    wanted = settings.cluster_id
    deadline = time.monotonic() + settings.failover_s
    while etcd.leader(endpoints, wanted) is None:
        if not etcd.has_log(endpoints, wanted):
            others = ", ".join(repr(c) for c in etcd.clusters(endpoints)) or "none"
            raise ConfigurationError(
                f"no Store master runs cluster id {wanted!r} in etcd {endpoints} (clusters "
                f"there: {others}); set MOONCAKE_RL_CLUSTER_ID to the masters' --cluster_id"
            )
        if time.monotonic() >= deadline:
            raise ConfigurationError(
                f"no master of cluster {wanted!r} has led for {settings.failover_s:.0f}s "
                f"(etcd {endpoints}): start `mooncake-rl master --etcd {endpoints}`"
            )
        time.sleep(0.2)


def _set_cluster_env(cluster_id: str) -> None:
    """The native client reads its cluster id from the environment, once per process."""
    given = os.environ.setdefault(CLUSTER_ENV, cluster_id)
    if given != cluster_id:
        raise ConfigurationError(
            f"{CLUSTER_ENV}={given} disagrees with the cluster id {cluster_id!r} of these "
            f"settings; set MOONCAKE_RL_CLUSTER_ID={given} or unset {CLUSTER_ENV}"
        )


_BOUND_ETCD: list[frozenset[str]] = []
"""The etcd cluster this process's native clients met first (at most one entry)."""


def _require_bound_etcd(master: str) -> frozenset[str]:
    """The native client's etcd connection is one per process and keeps the first cluster it
    met (tried here: a client of a second etcd fails setup with -1 even after every client
    of the first closed); a client of another cluster is refused naming both, not at -1."""
    endpoints = frozenset(etcd.parse_endpoints(master))
    if _BOUND_ETCD and _BOUND_ETCD[0] != endpoints:
        raise ConfigurationError(
            f"this process's Store clients are bound to etcd {';'.join(sorted(_BOUND_ETCD[0]))} "
            f"(Mooncake's etcd client is one per process and keeps the first cluster it "
            f"met); connect to {master} from another process"
        )
    return endpoints


def _check(code: int, operation: str, context: str = "") -> int:
    if code < 0:
        raise mooncake_error(code, operation, context)
    return code


def rides_failover(method: Callable[..., T]) -> Callable[..., T]:
    """A :class:`StoreClient` method repeated while a durable Store's leader changes."""

    @functools.wraps(method)
    def riding(self: StoreClient, *args: Any, **kwargs: Any) -> T:
        return self._ride(method.__name__, lambda _attempt: method(self, *args, **kwargs))

    return riding


class StoreClient:
    """A connected Mooncake Store client that lends ``segment_bytes`` to the cluster."""

    def __init__(self, settings: Settings) -> None:
        check_system_libraries()
        loopback_transport_env(settings)
        self.durable = settings.master.startswith(etcd.ETCD_SCHEME)
        if self.durable:
            _require_bound_etcd(settings.master)
            _require_cluster(settings)
            _set_cluster_env(settings.cluster_id)
        else:
            _require_reachable(settings.master)
        from mooncake.store import MooncakeDistributedStore

        self.settings = settings
        self._parkable = self.durable and settings.segment_bytes == 0
        parked = _unpark(settings) if self._parkable else None
        self._store = parked or MooncakeDistributedStore()
        if parked is None:
            with unpinned_native_threads(), native_setup(settings):
                code = self._store.setup(
                    settings.hostname,
                    settings.metadata,
                    settings.segment_bytes,
                    settings.buffer_bytes,
                    settings.protocol,
                    settings.rdma_devices,
                    settings.master,
                )
            if code != 0:
                raise ConfigurationError(
                    f"Store setup failed ({code}): is mooncake_master reachable at "
                    f"{settings.master} and metadata at {settings.metadata}?"
                )
            if self.durable and not _BOUND_ETCD:
                _BOUND_ETCD.append(_require_bound_etcd(settings.master))
        self.segment: str = self._store.get_hostname()
        # Where "prefer local" points: this client's own segment, or the node's segment
        # holder when the client lends no memory (short-lived or crash-prone processes).
        self.local_segment: str | None = (
            self.segment if settings.segment_bytes > 0 else settings.local_segment
        )
        self._registered: dict[int, int] = {}
        self._closed = False
        self.failover_s = settings.failover_s
        self._leader_lost_at = -float("inf")
        self._riding = threading.local()  # .active: this thread is inside a ride

    # -- registration -------------------------------------------------------------------
    def register(self, ptr: int, size: int) -> None:
        """Register a buffer as a source/destination of direct transfers (idempotent)."""
        if self._registered.get(ptr) == size:
            return
        _check(
            self._store.register_buffer(ptr, size), "register_buffer", f"ptr={ptr:#x} size={size}"
        )
        self._registered[ptr] = size

    def unregister(self, ptr: int) -> None:
        if self._registered.pop(ptr, None) is not None:
            _check(self._store.unregister_buffer(ptr), "unregister_buffer", f"ptr={ptr:#x}")

    # -- writes -------------------------------------------------------------------------
    def _config(self, replica_num: int, preferred_segments: Sequence[str], hard_pin: bool):
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = replica_num
        config.preferred_segments = list(preferred_segments)
        config.with_hard_pin = hard_pin
        return config

    @rides_failover
    def put_from(
        self,
        key: str,
        ptr: int,
        size: int,
        *,
        replica_num: int = 1,
        preferred_segments: Sequence[str] = (),
        hard_pin: bool = True,
    ) -> None:
        """Put ``size`` bytes at registered address ``ptr`` as object ``key``.

        Mooncake silently ignores a put to an existing key: callers use fresh keys.
        """
        config = self._config(replica_num, preferred_segments, hard_pin)
        _check(self._store.put_from(key, ptr, size, config), "put_from", f"key={key}")
        COUNTERS.add(put=size)

    def put_tensor(
        self,
        key: str,
        tensor: torch.Tensor,
        *,
        replica_num: int = 1,
        preferred_segments: Sequence[str] = (),
        hard_pin: bool = True,
    ) -> None:
        """Put a tensor's raw bytes; registers a contiguous view for the duration of the put."""
        data = tensor.detach().contiguous()
        ptr, size = data.data_ptr(), data.numel() * data.element_size()
        if size == 0:
            raise InvariantViolation(f"refusing to put an empty tensor as {key}")
        self.register(ptr, size)
        try:
            self.put_from(
                key,
                ptr,
                size,
                replica_num=replica_num,
                preferred_segments=preferred_segments,
                hard_pin=hard_pin,
            )
        finally:
            self.unregister(ptr)

    @rides_failover
    def put_bytes(self, key: str, data: bytes, *, preferred_segments: Sequence[str] = ()) -> None:
        """A record (``RECORD_REPLICAS`` copies); a put to an existing key is ignored."""
        config = self._config(RECORD_REPLICAS, preferred_segments, True)
        code = self._write_record(
            data,
            lambda: self._store.put(key, data, config),
            lambda ptr: self._store.put_from(key, ptr, len(data), config),
        )
        _check(code, "put", f"key={key}")
        COUNTERS.add(put=len(data))

    @rides_failover
    def upsert_bytes(self, key: str, data: bytes) -> None:
        """Insert or replace a small record; readers see the old or the new value.

        Clients upserting one key at the same moment (the TP ranks of an engine renewing
        its lease) collide: the master refuses to end an upsert that another client's
        upsert of the key replaced (``ILLEGAL_CLIENT``). Such an upsert is simply repeated,
        after a random pause so that the writers fall out of step: the last one wins.
        """
        config = self._config(RECORD_REPLICAS, (), True)
        for attempt in range(UPSERT_ATTEMPTS):
            code = self._write_record(
                data,
                lambda: self._store.upsert(key, data, config),
                lambda ptr: self._store.upsert_from(key, ptr, len(data), config),
            )
            if code != ILLEGAL_CLIENT:
                break
            time.sleep(random.uniform(0.005, 0.05) * (attempt + 1))
        _check(code, "upsert", f"key={key}")
        COUNTERS.add(put=len(data))

    def create_exclusive(self, key: str, data: bytes) -> None:
        """Create ``key`` only if absent (a fence): raises ObjectAlreadyExists otherwise.

        Safe to repeat across a failover: a repeat that finds ``key`` holding exactly ``data``
        is this call's own create that the old leader logged before dying (never a lost
        announce); anything else there is another writer's (never a double claim). A create
        the dying leader left half-done raises :class:`FailoverAmbiguous`.
        """

        def create(attempt: int) -> None:
            try:
                self._create_once(key, data)
            except ObjectAlreadyExists:
                if attempt == 0 or not self._holds(key, data):
                    raise

        self._ride("create_exclusive", create)

    def _create_once(self, key: str, data: bytes) -> None:
        size = len(data)
        config = self._config(RECORD_REPLICAS, (), True)
        started = self._store.batch_put_session_start([key], [size], config)[0]
        _check(started, "put_session_start", key)
        with self._registered_copy(data) as ptr:
            written = self._store.batch_put_from_multi_buffer_ranges(
                [key], [[ptr]], [[size]], [[0]]
            )
            if written[0] != size:
                self._store.batch_put_session_revoke([key])
                raise mooncake_error(written[0] if written[0] < 0 else -800, "put_session", key)
            _check(self._store.batch_put_session_end([key])[0], "put_session_end", key)
        COUNTERS.add(put=size)

    def _holds(self, key: str, data: bytes) -> bool:
        """Whether ``key`` holds ``data``; ambiguous when it stays unreadable (half-created)."""
        try:
            return self.get_bytes(key) == data
        except ObjectNotFound:
            return False
        except MooncakeError as error:
            if error.code in LEADER_LOST:
                raise  # the ride repeats the create and this check
            raise FailoverAmbiguous(
                f"create of {key} was cut by a master failover and the object it left is "
                f"unreadable ({error.name}); whether this call created it is unknown: rerun "
                "the command (it claims afresh), or remove the key"
            ) from error

    def _ride(self, operation: str, call: Callable[[int], T]) -> T:
        """``call(attempt)``, repeated while a durable Store's leader changes.

        Only a durable Store's client rides: its standby takes over with every object. A
        lone master that died comes back empty (if at all), so its errors surface at once.
        Settling codes are repeated for ``failover_s`` after a lost leader, else for
        ``SETTLE_S`` (a full Store fails that much later). Past its window the last error
        is raised, saying so.
        """
        if getattr(self._riding, "active", False):  # an outer ride repeats the whole call
            return call(0)
        self._riding.active = True
        try:
            return self._ride_loop(operation, call)
        finally:
            self._riding.active = False

    def _ride_loop(self, operation: str, call: Callable[[int], T]) -> T:
        """The loop of :meth:`_ride`: a deadline from the first failover error on."""
        deadline: float | None = None
        attempt = 0
        while True:
            try:
                return call(attempt)
            except MooncakeError as error:
                now = time.monotonic()
                if not self.durable:
                    raise
                if error.code in LEADER_LOST:
                    self._leader_lost_at = now
                elif error.code not in SETTLING:
                    raise
                settling = now - self._leader_lost_at > self.failover_s
                deadline = deadline or now + (SETTLE_S if settling else self.failover_s)
                if now >= deadline:
                    window = SETTLE_S if settling else self.failover_s
                    error.add_note(self._gave_up(operation, error.code in LEADER_LOST, window))
                    raise
            time.sleep(min(BACKOFF_S[0] * 2**attempt, BACKOFF_S[1]))
            attempt += 1

    def _gave_up(self, operation: str, leaderless: bool, window_s: float) -> str:
        if leaderless:
            return (
                f"{operation}: no Store master led for {window_s:.0f}s "
                f"(MOONCAKE_RL_FAILOVER_S); check the masters and etcd at "
                f"{self.settings.master} (`mooncake-rl status`)"
            )
        return (
            f"{operation}: repeated for {window_s:.0f}s in case the Store's leader "
            "had just changed; the error stayed"
        )

    def _write_record(
        self, data: bytes, staged: Callable[[], int], from_buffer: Callable[[int], int]
    ) -> int:
        """``staged`` copies the value through the client's local buffer, which refuses one
        that does not fit (a 50,000-tensor manifest is 20 MB); a larger record is written by
        ``from_buffer`` from a registered copy."""
        if len(data) <= self.settings.buffer_bytes // 2:
            return staged()
        with self._registered_copy(data) as ptr:
            return from_buffer(ptr)

    @contextmanager
    def _registered_copy(self, data: bytes) -> Iterator[int]:
        """A registered copy of ``data`` for puts that read it in place; its address."""
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.register(buffer.data_ptr(), len(data))
        try:
            yield buffer.data_ptr()
        finally:
            self.unregister(buffer.data_ptr())

    # -- reads --------------------------------------------------------------------------
    @rides_failover
    def size(self, key: str) -> int:
        return _check(self._store.get_size(key), "get_size", f"key={key}")

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
        size = _check(self._store.get_size(key), "get_size", f"key={key}")
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
            _check(code, "batch_is_exist", f"key={key}")
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
                _check(code, "batch_is_exist", f"key={key}")

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

    # -- removal ------------------------------------------------------------------------
    @rides_failover
    def remove(self, keys: Sequence[str], *, force: bool = False) -> dict[str, int]:
        """Remove keys; returns the keys that failed with their codes (missing keys are fine)."""
        if not keys:
            return {}
        codes = self._store.batch_remove(list(keys), force)
        lost = next((c for c in codes if c in LEADER_LOST), None)
        if lost is not None:  # repeated whole: keys already removed answer OBJECT_NOT_FOUND
            raise mooncake_error(lost, "batch_remove", f"{len(keys)} keys")
        return {k: c for k, c in zip(keys, codes, strict=True) if c < 0 and c != -704}

    @rides_failover
    def remove_matching(self, pattern: str, *, force: bool = False) -> int:
        """Remove every key ``pattern`` (the master's ECMAScript regex) matches: the Store
        lists no keys, so this is how records nobody tracked are found."""
        return _check(self._store.remove_by_regex(pattern, force), "remove_by_regex", pattern)

    def remove_prefix(self, prefix: str, *, force: bool = False) -> int:
        """Remove every key starting with ``prefix``, including ones nobody listed."""
        return self.remove_matching("^" + regex_literal(prefix), force=force)

    def etcd_usage(self) -> etcd.Usage | None:
        """How full a durable Store's etcd is (its operation log is never pruned)."""
        if not self.durable:
            return None
        return etcd.usage(self._etcd_endpoints, self.settings.etcd_quota_bytes)

    @property
    def _etcd_endpoints(self) -> str:
        return self.settings.master.removeprefix(etcd.ETCD_SCHEME)

    def require_log_space(self, what: str) -> None:
        """Raise :class:`EtcdOutOfSpace` when a durable Store's etcd refuses writes.

        Mooncake answers puts with success when it cannot log them (it only warns in its
        own log), so a write that must survive a failover (an announce) asks etcd first.
        """
        if self.durable and etcd.out_of_space(self._etcd_endpoints):
            usage = self.etcd_usage()
            assert usage is not None
            raise etcd.out_of_space_error(self._etcd_endpoints, usage, what)

    def close(self) -> None:
        """Release the client. A durable Store's client that lends no memory is parked for
        the next :class:`StoreClient` of the same settings in this process instead: the
        pinned wheel's close of such a client joins a leader-monitor thread that sleeps out
        a hard-coded 30 s wait (an engine's loader would pay it at every start)."""
        if self._closed:
            return
        self._closed = True
        for ptr in list(self._registered):
            self.unregister(ptr)
        if self._parkable:
            _park(self.settings, self._store)
        else:
            self._store.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_PARKED: dict[tuple[object, ...], list[Any]] = defaultdict(list)
"""Idle native clients of durable Stores that lend no memory, by their setup arguments;
referenced here so no destructor joins their threads before the process ends."""
_PARKED_LOCK = threading.Lock()


def _setup_key(settings: Settings) -> tuple[object, ...]:
    return (
        settings.master,
        settings.cluster_id,
        settings.hostname,
        settings.metadata,
        settings.buffer_bytes,
        settings.protocol,
        settings.rdma_devices,
    )


def _park(settings: Settings, native: Any) -> None:
    with _PARKED_LOCK:
        _PARKED[_setup_key(settings)].append(native)


def _unpark(settings: Settings) -> Any | None:
    with _PARKED_LOCK:
        idle = _PARKED.get(_setup_key(settings))
        return idle.pop() if idle else None


def close_parked(master: str) -> int:
    """Really close every parked client of ``master`` (30 s, in parallel): for a process
    that outlives a durable Store it ran, such as a test session, before it stops that
    Store. Returns how many were closed."""
    with _PARKED_LOCK:
        keys = [key for key in _PARKED if key[0] == master]
        natives = [native for key in keys for native in _PARKED.pop(key)]
    with ThreadPoolExecutor(max_workers=max(1, len(natives))) as pool:
        list(pool.map(lambda native: native.close(), natives))
    return len(natives)


def exit_process(code: int) -> int:
    """``code``, or, if a client is parked, end the process with it at once: the
    interpreter's teardown would run the parked clients' destructors, 30 s each."""
    if any(_PARKED.values()):
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code
