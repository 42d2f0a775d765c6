"""Store and Transfer Engine wrappers against a real master, across real processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch

from mooncake_rl.counters import COUNTERS
from mooncake_rl.engine import TransferEngineClient, Write
from mooncake_rl.errors import (
    ConfigurationError,
    MooncakeError,
    ObjectHasLease,
    ObjectNotFound,
    StoreFull,
    TransferFailed,
    mooncake_error,
)
from mooncake_rl.services import EmbeddedMaster, MasterConfig, SegmentHolder, free_ports
from mooncake_rl.settings import Settings
from mooncake_rl.store import DESCRIPTOR_BATCH as STORE_BATCH
from mooncake_rl.store import RangeRead, StoreClient
from tests.conftest import settings_for
from tests.procs import ProcessGroup


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


# -- workers (run in their own processes) ---------------------------------------------------
def put_own_segment(settings: Settings, key: str, seed: int, nbytes: int, release) -> dict:
    with StoreClient(settings) as client:
        before = COUNTERS.snapshot()
        client.put_tensor(key, pattern(seed, nbytes), preferred_segments=[client.segment])
        put = (COUNTERS.snapshot() - before).store_put_bytes
        # Keep the segment mounted until the parent has inspected the replicas.
        release.get(timeout=60)
        return {"segment": client.segment, "put_bytes": put}


def receive_te_write(settings: Settings, nbytes: int, addresses, release) -> list[int]:
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    with TransferEngineClient(settings) as engine:
        engine.register(buffer.data_ptr(), nbytes)
        addresses.put((engine.endpoint, buffer.data_ptr()))
        release.get(timeout=60)
        return buffer.tolist()


# -- tests ----------------------------------------------------------------------------------
def test_put_from_lands_in_each_publishers_own_segment(master: EmbeddedMaster) -> None:
    with ProcessGroup() as group:
        release = group.queue()
        for index, node in enumerate(("node-a", "node-b")):
            group.start(
                put_own_segment, settings_for(master, node), f"seg/{node}", index, 300_000, release
            )
        with StoreClient(settings_for(master, "reader")) as reader:
            deadline = time.monotonic() + 60
            while not all(reader.exists(["seg/node-a", "seg/node-b"])):
                assert time.monotonic() < deadline, "publishers did not put in time"
                time.sleep(0.05)
            placed = {key: reader.replica_segments(key) for key in ("seg/node-a", "seg/node-b")}
            release.put(1)
            release.put(1)
            results = group.results()
            for node, result in zip(("node-a", "node-b"), results, strict=True):
                assert placed[f"seg/{node}"] == (result["segment"],)
                assert result["put_bytes"] == 300_000
            assert results[0]["segment"] != results[1]["segment"]
            reader.remove(["seg/node-a", "seg/node-b"], force=True)


def test_get_into_ranges_reads_partial_ranges_of_several_objects(master: EmbeddedMaster) -> None:
    sizes = {"ranges/a": 10_000, "ranges/b": 7_777, "ranges/c": 123_456}
    with StoreClient(settings_for(master, "writer")) as writer:
        for seed, (key, size) in enumerate(sizes.items()):
            writer.put_tensor(key, pattern(seed, size), preferred_segments=[writer.segment])
        with ProcessGroup() as group:
            reads = [
                RangeRead("ranges/a", 0, 0, 100),
                RangeRead("ranges/b", 7_000, 100, 777),
                RangeRead("ranges/c", 50_000, 877, 60_000),
                RangeRead("ranges/a", 9_000, 60_877, 1_000),
            ]
            group.start(read_ranges_worker, settings_for(master, "reader"), reads)
            got, read_bytes = group.results()[0]
        expected = torch.cat(
            [
                pattern(0, 10_000)[0:100],
                pattern(1, 7_777)[7_000:7_777],
                pattern(2, 123_456)[50_000:110_000],
                pattern(0, 10_000)[9_000:10_000],
            ]
        )
        assert torch.equal(torch.tensor(got, dtype=torch.uint8), expected)
        assert read_bytes == 100 + 777 + 60_000 + 1_000
        writer.remove(list(sizes), force=True)


def read_ranges_worker(settings: Settings, reads: list[RangeRead]) -> tuple[list[int], int]:
    total = sum(r.length for r in reads)
    buffer = torch.zeros(total, dtype=torch.uint8)
    with StoreClient(settings) as client:
        client.register(buffer.data_ptr(), total)
        before = COUNTERS.snapshot()
        assert client.read_ranges(buffer.data_ptr(), reads) == total
        return buffer.tolist(), (COUNTERS.snapshot() - before).store_read_bytes


def upsert_repeatedly(settings: Settings, key: str, value: bytes, times: int, start) -> int:
    with StoreClient(settings) as client:
        start.get(timeout=60)
        for _ in range(times):
            client.upsert_bytes(key, value)
        return times


def test_clients_upserting_one_key_at_once_all_succeed(master: EmbeddedMaster, holders) -> None:
    """Mooncake refuses one of two concurrent upserts of a key (ILLEGAL_CLIENT); the client
    repeats it, so ranks renewing one lease together never fail, and the last write wins."""
    values = [b"a" * 200, b"b" * 200]
    holders("node-upsert")  # lends the memory the records live in
    with ProcessGroup() as group:
        start = group.queue()
        for node, value in zip(("node-a", "node-b"), values, strict=True):
            group.start(
                upsert_repeatedly,
                settings_for(master, node, segment_bytes=0),
                "race",
                value,
                150,
                start,
            )
        time.sleep(3)  # both clients connected before either writes
        start.put(1)
        start.put(1)
        assert group.results() == [150, 150]
    with StoreClient(settings_for(master, "reader", segment_bytes=0)) as reader:
        assert reader.get_bytes("race") in values
        reader.remove(["race"], force=True)


def test_transfer_engine_write_between_processes(master: EmbeddedMaster) -> None:
    settings = settings_for(master)
    source = pattern(7, 4096)
    with ProcessGroup() as group:
        addresses, release = group.queue(), group.queue()
        group.start(receive_te_write, settings, 4096, addresses, release)
        peer, base = addresses.get(timeout=60)
        with TransferEngineClient(settings) as engine:
            engine.register(source.data_ptr(), 4096)
            before = COUNTERS.snapshot()
            writes = [
                Write(source.data_ptr(), base, 1000),
                Write(source.data_ptr() + 3000, base + 3000, 1096),
            ]
            assert engine.write(peer, writes) == 2096
            assert (COUNTERS.snapshot() - before).te_pushed_bytes == 2096
            # An address outside the peer's registered memory is refused, not silently dropped.
            with pytest.raises(TransferFailed) as refused:
                engine.write(peer, [Write(source.data_ptr(), base + (1 << 30), 16)])
            assert refused.value.code < 0
            assert (COUNTERS.snapshot() - before).te_pushed_bytes == 2096
        release.put(1)
        received = torch.tensor(group.results()[0], dtype=torch.uint8)
    assert torch.equal(received[:1000], source[:1000])
    assert torch.equal(received[3000:], source[3000:])
    assert int(received[1000:3000].count_nonzero()) == 0


def test_error_codes_become_typed_exceptions(settings: Settings) -> None:
    with StoreClient(settings) as client:
        with pytest.raises(ObjectNotFound) as missing:
            client.get_bytes("errors/missing")
        assert missing.value.code == -704
        assert str(missing.value).startswith("OBJECT_NOT_FOUND (-704) in get_size")
        assert "errors/missing" in str(missing.value)

        too_big = torch.zeros(settings.segment_bytes * 4, dtype=torch.uint8)
        with pytest.raises(StoreFull) as full:
            client.put_tensor("errors/too-big", too_big)
        assert full.value.code == -200 and full.value.name == "NO_AVAILABLE_HANDLE"

        client.put_bytes("errors/leased", b"x" * 4096)
        client.get_bytes("errors/leased")  # a read grants a lease
        assert client.remove(["errors/leased"]) == {"errors/leased": -706}
        assert client.remove(["errors/leased"], force=True) == {}
        with pytest.raises(ObjectNotFound):
            client.size("errors/leased")


def test_a_record_larger_than_the_clients_buffer_is_written_whole(master: EmbeddedMaster) -> None:
    """``put`` and ``upsert`` stage through the client's local buffer and refuse a larger
    value (a 50,000-tensor manifest is 20 MB, over the benchmarks' 16 MiB buffer)."""
    settings = settings_for(master, "small-buffer", buffer_bytes=1 << 20)
    record = bytes(range(256)) * (3 << 12)  # 3 MiB
    with StoreClient(settings) as client:
        client.put_bytes("records/large", record)
        client.put_bytes("records/large", b"a second put of a key is ignored" * (1 << 16))
        client.put_bytes("records/small", b"small")
        client.upsert_bytes("records/upserted", record)
        assert client.get_bytes("records/upserted") == record
        client.upsert_bytes("records/upserted", record[::-1])
        assert client.get_bytes("records/upserted") == record[::-1]
        assert client.get_bytes("records/large") == record
        assert client.get_bytes("records/small") == b"small"


def test_mooncake_error_mapping_is_specific() -> None:
    assert isinstance(mooncake_error(-706, "remove"), ObjectHasLease)
    unknown = mooncake_error(-4242, "op", "ctx")
    assert type(unknown) is MooncakeError and unknown.name == "UNKNOWN_ERROR"
    assert str(unknown) == "UNKNOWN_ERROR (-4242) in op [ctx]"
    with pytest.raises(ValueError):
        mooncake_error(0, "op")


def test_read_counters_match_bytes_moved(settings: Settings) -> None:
    with StoreClient(settings) as client:
        client.put_bytes("counters/a", b"a" * 5000)
        buffer = torch.zeros(5000, dtype=torch.uint8)
        client.register(buffer.data_ptr(), 5000)
        before = COUNTERS.snapshot()
        client.read_ranges(buffer.data_ptr(), [RangeRead("counters/a", 10, 0, 4990)])
        client.get_bytes("counters/a")
        delta = COUNTERS.snapshot() - before
        assert (delta.store_read_bytes, delta.store_put_bytes) == (4990 + 5000, 0)
        with pytest.raises(ObjectNotFound):
            client.read_ranges(buffer.data_ptr(), [RangeRead("counters/none", 0, 0, 10)])
        assert (COUNTERS.snapshot() - before).store_read_bytes == 9990


def test_complete_replicas_answer_each_key_in_order_across_batches(settings: Settings) -> None:
    """Several descriptor batches are in flight at once; each key still gets its own answer
    in the order asked: its size and segment, or None where it is absent."""
    keys = [f"replicas/{i:05d}" for i in range(STORE_BATCH * 2 + 100)]
    sizes = [1 + i % 7 for i in range(len(keys))]
    with StoreClient(settings) as client:
        for start in range(0, len(keys), 1000):
            chunk = slice(start, start + 1000)
            client._store.put_batch(keys[chunk], [b"x" * n for n in sizes[chunk]])
        absent = {3, STORE_BATCH + 1, len(keys) - 1}
        client.remove([keys[i] for i in absent])
        asked = [*keys, "replicas/never"]
        found = client.complete_replicas(asked)
        # Where each object lies, one key at a time (other tests' holders share the master).
        sampled = [i for i in range(0, len(keys), 61) if i not in absent]
        holders = {i: client.replica_segments(keys[i]) for i in sampled}
    assert found[-1] is None and len(found) == len(asked)
    for i, held in enumerate(found[:-1]):
        assert (held is None) if i in absent else (held is not None and held[0] == sizes[i]), i
    for i, segments in holders.items():
        assert found[i][1] in segments, keys[i]


def test_store_refuses_unreachable_master() -> None:
    settings = Settings(master="127.0.0.1:1", segment_bytes=16 << 20, buffer_bytes=16 << 20)
    with pytest.raises(ConfigurationError, match=r"127\.0\.0\.1:1"):
        StoreClient(settings)


def test_missing_system_library_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncake_rl.services import processes

    absent = ("libnuma.so.1", "libmooncake-absent.so.9")
    monkeypatch.setattr(processes, "SYSTEM_LIBRARIES", absent)
    with pytest.raises(
        ConfigurationError, match="apt-get install -y libibverbs1 librdmacm1 libnuma1"
    ):
        EmbeddedMaster().start()


def test_master_dies_with_its_parent(tmp_path) -> None:
    """A killed owner (CLI or test runner) takes its master down: no orphans."""
    script = (
        "import sys,time; from mooncake_rl.services import EmbeddedMaster, MasterConfig;"
        f"m=EmbeddedMaster(MasterConfig(log_dir=__import__('pathlib').Path({str(tmp_path)!r}))).start();"
        "print(m.pid, flush=True); time.sleep(600)"
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        master_pid = int(owner.stdout.readline())
        assert psutil.pid_exists(master_pid)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 10
        while (
            psutil.pid_exists(master_pid)
            and psutil.Process(master_pid).status() != psutil.STATUS_ZOMBIE
        ):
            assert time.monotonic() < deadline, "master outlived its parent"
            time.sleep(0.05)
    finally:
        owner.kill()
        owner.wait()


def test_stop_reaps_the_master() -> None:
    master = EmbeddedMaster(MasterConfig(lease_ttl_ms=500)).start()
    pid = master.pid
    assert master.is_running()
    master.stop()
    assert not master.is_running()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_ports_picked_together_are_distinct_and_free() -> None:
    """A master's three ports come from one pick. Picked one at a time, 500 ports out of
    the kernel's ~14,000 repeat one nearly always, as one CI run's master showed: it died
    binding its own port twice."""
    ports = free_ports(500)
    assert len(set(ports)) == 500
    for port in ports[:20]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_ranged_reads_repeat_what_an_expired_lease_cut_short() -> None:
    """A 1 ms read lease expires during most of these reads (the master answers
    LEASE_EXPIRED); they are repeated, and every byte still lands exactly once."""
    size, piece = 48 << 20, 1 << 20
    with (
        EmbeddedMaster(MasterConfig(lease_ttl_ms=1)) as master,
        SegmentHolder(master.master_address, master.metadata_url, 64 << 20) as holder,
    ):
        writer = settings_for(master, "w", segment_bytes=0, local_segment=holder.segment)
        with StoreClient(writer) as store:
            store.put_tensor("leased", pattern(7, size), preferred_segments=[holder.segment])
        reader = settings_for(master, "r", segment_bytes=0, buffer_bytes=size)
        with StoreClient(reader) as store:
            buffer = torch.zeros(size, dtype=torch.uint8)
            store.register(buffer.data_ptr(), size)
            before = COUNTERS.snapshot()
            reads = [RangeRead("leased", o, o, piece) for o in range(0, size, piece)]
            assert store.read_ranges(buffer.data_ptr(), reads) == size
            moved = COUNTERS.snapshot() - before
            assert torch.equal(buffer, pattern(7, size))
        assert moved.store_read_bytes == size
        assert moved.store_reread_bytes % piece == 0
