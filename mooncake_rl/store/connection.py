"""Settings --> a connected native client --> registered buffers --> calls that ride a
leader change --> close (or park).

:class:`StoreConnection` is what every Store operation stands on: the native client, the
buffers registered with it, and :meth:`~StoreConnection._ride`, which repeats a call while a
durable Store's leader changes (:func:`rides_failover` wraps a whole method in it).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any, Self, TypeVar

from mooncake_rl import etcd
from mooncake_rl.errors import MooncakeError, mooncake_error
from mooncake_rl.services import check_system_libraries
from mooncake_rl.settings import Settings
from mooncake_rl.store.native import (
    loopback_transport_env,
    park,
    require_master,
    set_up,
    unpark,
)

T = TypeVar("T")

LEADER_LOST = frozenset({-900, -901})
"""RPC_FAIL, RPC_TIMEOUT: the leader died and no standby leads yet (seen for ~9 s here)."""
SETTLING = frozenset({-101, -103, -200, -703})
"""SEGMENT_NOT_FOUND, CLIENT_NOT_FOUND, NO_AVAILABLE_HANDLE, REPLICA_IS_NOT_READY: a new
leader before the clients have remounted their segments (seen for ~1 s after it leads)."""
SETTLE_S = 5.0
"""How long settling codes are repeated when this client saw no lost leader: the native
client can ride out the election inside one blocked call and surface only these."""
BACKOFF_S = (0.1, 0.5)  # first and longest pause between attempts while the leader changes


def check(code: int, operation: str, context: str = "") -> int:
    """``code``, or the :mod:`mooncake_rl.errors` exception a negative one names."""
    if code < 0:
        raise mooncake_error(code, operation, context)
    return code


def rides_failover(method: Callable[..., T]) -> Callable[..., T]:
    """A :class:`StoreConnection` method repeated while a durable Store's leader changes."""

    @functools.wraps(method)
    def riding(self: StoreConnection, *args: Any, **kwargs: Any) -> T:
        return self._ride(method.__name__, lambda _attempt: method(self, *args, **kwargs))

    return riding


class StoreConnection:
    """The native client, the buffers registered with it, and the ride over a leader
    change: what every Store operation stands on."""

    def __init__(self, settings: Settings) -> None:
        check_system_libraries()
        loopback_transport_env(settings)
        self.durable = settings.master.startswith(etcd.ETCD_SCHEME)
        require_master(settings, self.durable)
        self.settings = settings
        self._parkable = settings.segment_bytes == 0
        parked = unpark(settings) if self._parkable else None
        self._store: Any = set_up(settings, self.durable) if parked is None else parked
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
        check(
            self._store.register_buffer(ptr, size), "register_buffer", f"ptr={ptr:#x} size={size}"
        )
        self._registered[ptr] = size

    def unregister(self, ptr: int) -> None:
        if self._registered.pop(ptr, None) is not None:
            check(self._store.unregister_buffer(ptr), "unregister_buffer", f"ptr={ptr:#x}")

    # -- riding a leader change ---------------------------------------------------------
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

    # -- a durable Store's etcd ---------------------------------------------------------
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

    # -- close --------------------------------------------------------------------------
    def close(self) -> None:
        """Release the client. A client that lends no memory is parked for the next
        :class:`StoreClient` of the same settings in this process instead: the pinned
        wheel's close joins threads that sleep out their waits, 1 s on a plain master and a
        hard-coded 30 s on a durable Store's leader monitor (an engine's loader, a command,
        a trainer rank would pay it every time), and its next setup is saved too."""
        if self._closed:
            return
        self._closed = True
        for ptr in list(self._registered):
            self.unregister(ptr)
        if self._parkable:
            park(self.settings, self._store)
        else:
            self._store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
