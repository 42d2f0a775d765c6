"""The only module that imports ``mooncake.engine``: one-sided writes between workers."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mooncake_rl.affinity import unpinned_native_threads
from mooncake_rl.counters import COUNTERS
from mooncake_rl.errors import ConfigurationError, InvariantViolation, mooncake_error
from mooncake_rl.native_logs import native_setup
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
WRITES_PER_CALL = 512
CALLS_IN_FLIGHT = 4


class TransferEngineClient:
    """A Transfer Engine endpoint: registers local memory and writes into peers' memory."""

    def __init__(self, settings: Settings) -> None:
        check_system_libraries()
        loopback_transport_env(settings)
        from mooncake.engine import TransferEngine

        self.settings = settings
        self._engine = TransferEngine()
        # The data plane always uses the P2P handshake: peers exchange segment descriptors
        # directly, so newly registered buffers are visible without a metadata round trip.
        with unpinned_native_threads(), native_setup(settings):
            code = self._engine.initialize(
                settings.hostname, "P2PHANDSHAKE", settings.protocol, settings.rdma_devices
            )
        if code != 0:
            raise ConfigurationError(
                f"Transfer Engine initialize failed ({code}) for {settings.hostname}"
            )
        self.endpoint: str = f"{settings.hostname}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, int] = {}

    def register(self, ptr: int, size: int) -> None:
        if self._registered.get(ptr) == size:
            return
        code = self._engine.register_memory(ptr, size)
        if code != 0:
            raise mooncake_error(code if code < 0 else -1, "register_memory", f"ptr={ptr:#x}")
        self._registered[ptr] = size

    def unregister(self, ptr: int) -> None:
        if self._registered.pop(ptr, None) is not None:
            self._engine.unregister_memory(ptr)

    def write(self, peer: str, writes: Sequence[Write]) -> int:
        """Batch one-sided write into ``peer``; all-or-error, byte count returned.

        The writes go out in native calls of at most ``WRITES_PER_CALL`` ranges, up to
        ``CALLS_IN_FLIGHT`` at once: one call of thousands of ranges overflows the TCP
        transport's lane queue and fails whole (seen here at 5,000), while a few bounded
        calls in flight keep the link busy.
        """
        if not writes:
            return 0
        calls = [writes[i : i + WRITES_PER_CALL] for i in range(0, len(writes), WRITES_PER_CALL)]
        if len(calls) == 1:
            return self._write_call(peer, calls[0])
        with ThreadPoolExecutor(min(CALLS_IN_FLIGHT, len(calls))) as pool:
            return sum(pool.map(lambda call: self._write_call(peer, call), calls))

    def _write_call(self, peer: str, writes: Sequence[Write]) -> int:
        """One native batch write.

        A failed batch is written again (the same bytes to the same place, so a repeat is
        harmless): a peer whose Transfer Engine threads get no CPU for a while (they were
        pinned beside busy compute threads before :mod:`mooncake_rl.affinity`) leaves a
        writer's sessions without a status frame for 30 s and then recovers; when every
        attempt fails, the error stands.
        """
        total = sum(w.length for w in writes)
        for _ in range(WRITE_ATTEMPTS):
            code = self._engine.batch_transfer_sync_write(
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
