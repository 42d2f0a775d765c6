"""Bytes --> Store objects and records: puts, upserts and exclusive creates (fences).

Objects are put from registered memory, one copy unless asked for more; small records get
``RECORD_REPLICAS`` copies and are staged through the client's local buffer when they fit
it. Concurrent upserts of one key are repeated until one wins; an exclusive create is safe
to repeat across a failover (:meth:`StoreWrites.create_exclusive`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from mooncake_rl.counters import COUNTERS
from mooncake_rl.errors import (
    FailoverAmbiguous,
    InvariantViolation,
    MooncakeError,
    ObjectAlreadyExists,
    ObjectNotFound,
    mooncake_error,
)
from mooncake_rl.store.connection import LEADER_LOST, check, rides_failover
from mooncake_rl.store.reads import StoreReads

RECORD_REPLICAS = 3
"""Copies of every small record (claims, fences, manifests, index): Mooncake places as many
as there are segments, so no record depends on one segment when more than one exists."""
UPSERT_ATTEMPTS = 8  # upserts repeated after a concurrent upsert of the same key
ILLEGAL_CLIENT = -601


class StoreWrites(StoreReads):
    """What a client writes; an exclusive create reads back what a failover left."""

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
        check(self._store.put_from(key, ptr, size, config), "put_from", f"key={key}")
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
        check(code, "put", f"key={key}")
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
        check(code, "upsert", f"key={key}")
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
        check(started, "put_session_start", key)
        with self._registered_copy(data) as ptr:
            written = self._store.batch_put_from_multi_buffer_ranges(
                [key], [[ptr]], [[size]], [[0]]
            )
            if written[0] != size:
                self._store.batch_put_session_revoke([key])
                raise mooncake_error(written[0] if written[0] < 0 else -800, "put_session", key)
            check(self._store.batch_put_session_end([key])[0], "put_session_end", key)
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
