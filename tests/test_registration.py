"""Registration manager against real Store and Transfer Engine clients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from mooncake_rl.apply.registration import Domain, Region, RegistrationManager
from mooncake_rl.engine import TransferEngineClient, Write
from mooncake_rl.errors import InvariantViolation, TransferFailed
from mooncake_rl.settings import Settings
from mooncake_rl.store import RangeRead, StoreClient


class Recording:
    """Wraps a real client and records calls, so tests can see exactly what was registered."""

    def __init__(self, client: StoreClient | TransferEngineClient) -> None:
        self.client = client
        self.calls: list[tuple[str, int, int]] = []

    def register(self, ptr: int, size: int) -> None:
        self.client.register(ptr, size)
        self.calls.append(("register", ptr, size))

    def unregister(self, ptr: int) -> None:
        self.client.unregister(ptr)
        self.calls.append(("unregister", ptr, 0))


def test_lifecycle_against_real_clients(settings: Settings) -> None:
    big = torch.zeros(1 << 16, dtype=torch.uint8)
    other = torch.zeros(4096, dtype=torch.uint8)
    with (
        StoreClient(settings) as store,
        TransferEngineClient(settings) as engine,
        TransferEngineClient(settings) as peer,
    ):
        store_rec, engine_rec = Recording(store), Recording(engine)
        manager = RegistrationManager(
            "worker-0", {Domain.STORE: store_rec, Domain.ENGINE: engine_rec}
        )
        whole = Region("params", big.data_ptr(), big.numel())
        inner = Region("params.layer0", big.data_ptr() + 1024, 2048)
        assert manager.provision([whole, inner]) == 2  # one per domain; the inner one is reused
        with pytest.raises(InvariantViolation, match="partially overlaps"):
            manager.provision([Region("straddle", big.data_ptr() + (1 << 16) - 8, 64)])
        assert len(store_rec.calls) == 1 and len(engine_rec.calls) == 1
        manager.promote()
        # Next generation, same buffers: nothing is registered again.
        assert manager.provision([whole, inner]) == 0
        # A new buffer is provisional until promoted; rollback removes exactly it.
        assert manager.provision([Region("staging", other.data_ptr(), 4096)]) == 2
        manager.rollback()
        assert store_rec.calls[-1] == ("unregister", other.data_ptr(), 0)
        assert [k.base for k in manager.keys(Domain.ENGINE)] == [big.data_ptr()]

        # The registered region really is a remote-write destination and a read destination.
        source = torch.arange(256, dtype=torch.int64).to(torch.uint8)
        peer.register(source.data_ptr(), 256)
        peer.write(engine.endpoint, [Write(source.data_ptr(), inner.address(0, 256), 256)])
        assert torch.equal(big[1024:1280], source)
        store.put_bytes("registration/obj", bytes(range(200)))
        store.read_ranges(big.data_ptr(), [RangeRead("registration/obj", 0, 4000, 200)])
        assert bytes(big[4000:4200].tolist()) == bytes(range(200))

        manager.teardown()
        assert store_rec.calls[-1] == ("unregister", big.data_ptr(), 0)
        assert engine_rec.calls[-1] == ("unregister", big.data_ptr(), 0)
        with pytest.raises(TransferFailed):
            peer.write(engine.endpoint, [Write(source.data_ptr(), inner.address(0, 256), 256)])
        store.remove(["registration/obj"], force=True)


def test_reconnect_starts_a_new_epoch(settings: Settings) -> None:
    buffer = torch.zeros(4096, dtype=torch.uint8)
    with StoreClient(settings) as first, StoreClient(settings) as second:
        manager = RegistrationManager("w", {Domain.STORE: first})
        region = Region("r", buffer.data_ptr(), 4096)
        manager.provision([region])
        manager.promote()
        assert manager.keys(Domain.STORE)[0].epoch == 0
        manager.reconnect({Domain.STORE: second})
        assert manager.keys(Domain.STORE) == []
        assert manager.provision([region]) == 1
        manager.promote()
        assert manager.keys(Domain.STORE)[0].epoch == 1


def test_region_addresses_are_bounds_checked() -> None:
    region = Region("r", 0x1000, 100)
    assert region.address(10, 90) == 0x100A
    with pytest.raises(InvariantViolation, match="outside region r"):
        region.address(10, 91)
    with pytest.raises(InvariantViolation):
        Region("bad", 0, 10)


def test_provision_agrees_with_a_scan_of_every_registration(settings: Settings) -> None:
    """Regions inside one real buffer, in random order: each one already held by a
    registration is skipped, one that partially overlaps a registration is refused naming
    it, and the rest are registered; as a scan of every registration would decide (the
    manager looks only at its neighbours in base order)."""
    buffer = torch.zeros(1 << 12, dtype=torch.uint8)
    base = buffer.data_ptr()
    spans = st.tuples(st.integers(0, 60), st.integers(1, 8)).map(
        lambda t: (t[0] * 64, min(t[1] * 64, 4096 - t[0] * 64))
    )

    with StoreClient(settings) as store, TransferEngineClient(settings) as engine:

        @hypothesis_settings(max_examples=40, deadline=None)
        @given(st.lists(spans, min_size=1, max_size=12))
        def check(layout: list[tuple[int, int]]) -> None:
            recorded = {Domain.STORE: Recording(store), Domain.ENGINE: Recording(engine)}
            manager = RegistrationManager("w", dict(recorded))
            held: list[tuple[int, int]] = []
            try:
                for index, (offset, size) in enumerate(layout):
                    region = Region(f"r{index}", base + offset, size)
                    inside = any(s <= offset and offset + size <= s + n for s, n in held)
                    clash = not inside and any(
                        s < offset + size and offset < s + n for s, n in held
                    )
                    if clash:
                        with pytest.raises(InvariantViolation, match="partially overlaps"):
                            manager.provision([region])
                        continue
                    assert manager.provision([region]) == (0 if inside else 2)
                    if not inside:
                        held.append((offset, size))
                for domain in recorded:
                    keys = manager.keys(domain, provisional=True)
                    assert [(k.base - base, k.size) for k in keys] == sorted(held)
            finally:
                manager.teardown()

        check()
