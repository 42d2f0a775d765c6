"""The only module that imports ``mooncake.engine``: one-sided writes between workers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_rl.counters import COUNTERS
from mooncake_rl.errors import ConfigurationError, InvariantViolation, mooncake_error
from mooncake_rl.services import check_system_libraries
from mooncake_rl.settings import Settings
from mooncake_rl.store import loopback_transport_env


@dataclass(frozen=True)
class Write:
    """Copy ``length`` bytes from local address ``src`` to the peer's address ``dst``."""

    src: int
    dst: int
    length: int

    def __post_init__(self) -> None:
        if self.src <= 0 or self.dst <= 0 or self.length <= 0:
            raise InvariantViolation(f"invalid write {self}")


WRITE_ATTEMPTS = 3


def _register(engine: Any, ptr: int, size: int) -> None:
    code = engine.register_memory(ptr, size)
    if code != 0:
        raise mooncake_error(code if code < 0 else -1, "register_memory", f"ptr={ptr:#x}")


class TransferEngineClient:
    """A Transfer Engine endpoint: registers local memory and writes into peers' memory.

    Peers write into this worker through ``endpoint``, which never changes. Outgoing writes
    go through a sender engine: the endpoint's own until a batch fails, then a fresh one.
    """

    def __init__(self, settings: Settings) -> None:
        check_system_libraries()
        loopback_transport_env(settings)
        self.settings = settings
        self._engine = self._start_engine()
        self.endpoint: str = f"{settings.hostname}:{self._engine.get_rpc_port()}"
        self._sender = self._engine
        self._retired_senders: list[Any] = []
        self._registered: dict[int, int] = {}

    def _start_engine(self) -> Any:
        from mooncake.engine import TransferEngine

        engine = TransferEngine()
        # The data plane always uses the P2P handshake: peers exchange segment descriptors
        # directly, so newly registered buffers are visible without a metadata round trip.
        code = engine.initialize(
            self.settings.hostname,
            "P2PHANDSHAKE",
            self.settings.protocol,
            self.settings.rdma_devices,
        )
        if code != 0:
            raise ConfigurationError(
                f"Transfer Engine initialize failed ({code}) for {self.settings.hostname}"
            )
        return engine

    def _engines(self) -> list[Any]:
        return [self._engine] if self._sender is self._engine else [self._engine, self._sender]

    def register(self, ptr: int, size: int) -> None:
        if self._registered.get(ptr) == size:
            return
        for engine in self._engines():
            _register(engine, ptr, size)
        self._registered[ptr] = size

    def unregister(self, ptr: int) -> None:
        if self._registered.pop(ptr, None) is not None:
            for engine in self._engines():
                engine.unregister_memory(ptr)

    def _replace_sender(self) -> None:
        """Send through a fresh engine: new connections and a new handshake with every peer.

        On loopback TCP a peer's listener has been seen to leave one sender's connections
        unaccepted for 30-90 s while it accepted another's. The old sender stays alive
        (idle), so nothing it still holds is freed under it.
        """
        fresh = self._start_engine()
        for ptr, size in self._registered.items():
            _register(fresh, ptr, size)
        if self._sender is not self._engine:
            for ptr in self._registered:
                self._sender.unregister_memory(ptr)
            self._retired_senders.append(self._sender)
        self._sender = fresh

    def write(self, peer: str, writes: Sequence[Write]) -> int:
        """Batch one-sided write into ``peer``; all-or-error, byte count returned.

        A failed batch is written again through a fresh sender (the same bytes to the same
        place, so a repeat is harmless), up to ``WRITE_ATTEMPTS`` in all.
        """
        if not writes:
            return 0
        total = sum(w.length for w in writes)
        code = 0
        for attempt in range(WRITE_ATTEMPTS):
            if attempt:
                self._replace_sender()
            code = self._sender.batch_transfer_sync_write(
                peer, [w.src for w in writes], [w.dst for w in writes], [w.length for w in writes]
            )
            if code == 0:
                COUNTERS.add(pushed=total)
                return total
        raise mooncake_error(
            code if code < 0 else -800,
            "batch_transfer_sync_write",
            f"peer={peer} writes={len(writes)} bytes={total} attempts={WRITE_ATTEMPTS}",
        )

    def close(self) -> None:
        for ptr in list(self._registered):
            self.unregister(ptr)

    def __enter__(self) -> TransferEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
