"""The remote sender's slot in a real Store: a trainer that is not needed is released, a
sender that never answers (or fails) fails the coordinator's future, and a real broadcast
through the slot delivers the generation byte-exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.services import EmbeddedMaster, free_port
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.buckets import pack, shm_name, this_host_id, write_shm
from mooncake_rl.transport.group import BroadcastGroup, GroupSpec
from mooncake_rl.transport.layout import receive_layout
from mooncake_rl.transport.rendezvous import (
    RECORDS,
    SlotLauncher,
    close_slot,
    serve_slot,
    slot_key,
)
from mooncake_rl.transport.sender import SenderFailed, SenderSpec
from mooncake_rl.transport.source import Source, read_buckets
from tests.conftest import settings_for


@pytest.fixture(scope="module")
def store(master: EmbeddedMaster) -> Iterator[StoreClient]:
    with StoreClient(settings_for(master)) as client:
        yield client


def slot_records(store: StoreClient, slot: str) -> list[bool]:
    return store.exists([slot_key(slot, record) for record in RECORDS])


def test_a_trainer_waits_until_the_slot_closes_when_no_sender_is_needed(
    store: StoreClient, master: EmbeddedMaster
) -> None:
    slot = uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(serve_slot, store, slot, settings_for(master), 30.0)
        time.sleep(0.3)
        assert not waiting.done()
        close_slot(store, slot)
        assert waiting.result(timeout=10) is None
    assert not any(slot_records(store, slot))  # the trainer reads last and clears


def spec_for(record, port: int, world_size: int = 2, timeout_s: float = 20.0) -> SenderSpec:
    return SenderSpec(
        Source.of(record, 1 << 10), "127.0.0.1", port, world_size, uuid.uuid4().hex, timeout_s
    )


def published(store: StoreClient, model: str):
    generator = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn(64, 8, generator=generator) for i in range(5)}
    publish_local(store, model, tensors.items(), dtype="float32")
    record = GenerationRegistry(store, model).active()
    assert record is not None
    return record, tensors


def test_a_sender_that_never_answers_fails_the_coordinators_future(store: StoreClient) -> None:
    record, _ = published(store, "slot-silent")
    slot = uuid.uuid4().hex
    launcher = SlotLauncher(store, slot, "127.0.0.1")
    sender = launcher.start(spec_for(record, free_port(), timeout_s=1.0))
    with pytest.raises(SenderFailed, match="stopped answering"):
        sender.future.result(timeout=10)
    assert not sender.alive()
    launcher.close()


def broadcast_through_slot(
    store: StoreClient, master: EmbeddedMaster, model: str, port: int, fed: bool = False
) -> dict:
    """Trainer side in a thread, one gloo receiver in another: the bytes arrive exactly,
    the coordinator's future resolves with the sender's report, the slot is cleared.
    ``fed``: this thread plays the CPU leg on the sender's host, feeding it every bucket
    it read through shared memory (as ``TransportLegs`` does); the sender reads nothing."""
    record, tensors = published(store, model)
    manifest = GenerationRegistry(store, model).load_manifest(record.generation)
    layout = receive_layout(manifest, 1 << 10)
    slot = uuid.uuid4().hex
    spec = replace(spec_for(record, port), fed=fed)
    received = torch.zeros(layout.total_bytes, dtype=torch.uint8)

    def receive() -> None:
        member = BroadcastGroup(
            GroupSpec("127.0.0.1", port, 2, 1, spec.group_name, "gloo", 20.0), "127.0.0.1"
        )
        for bucket in layout.buckets:
            member.broadcast(received[bucket.start : bucket.end])
        member.close()

    launcher = SlotLauncher(store, slot, "127.0.0.1", this_host_id() if fed else "")
    assert launcher.same_host is fed
    with ThreadPoolExecutor(2) as pool:
        trainer = pool.submit(serve_slot, store, slot, settings_for(master), 60.0)
        receiver = threading.Thread(target=receive)
        receiver.start()
        sender = launcher.start(spec)
        if fed:
            session = uuid.uuid4().hex
            _, buckets = read_buckets(store, spec.source)
            for bucket, read in buckets:
                path = write_shm(shm_name(session, bucket.index), pack(read))
                sender.offer(bucket.index, shm_name(session, bucket.index)).result(timeout=30)
                path.unlink()
        report = sender.future.result(timeout=60)
        receiver.join()
        launcher.close()
        assert trainer.result(timeout=10) == report
    assert report["sent_bytes"] == layout.total_bytes and report["buckets"] == len(layout.buckets)
    assert report["read_bytes"] == (0 if fed else layout.total_bytes)
    for tensor in layout.tensors:
        landed = received[tensor.offset : tensor.offset + tensor.nbytes]
        assert torch.equal(landed, tensors[tensor.name].reshape(-1).view(torch.uint8))
    assert not any(slot_records(store, slot))
    return report


def test_the_slot_carries_a_real_broadcast_and_its_outcome(
    store: StoreClient, master: EmbeddedMaster
) -> None:
    broadcast_through_slot(store, master, "slot-broadcast", free_port())


def test_a_slot_sender_on_this_host_is_fed_and_reads_nothing(
    store: StoreClient, master: EmbeddedMaster
) -> None:
    """Trainer rank 0 on the coordinator's host (VeRL's first node): the CPU leg's buckets
    reach the sender through shared memory, so an ``auto`` update reads the Store once."""
    broadcast_through_slot(store, master, "slot-fed", free_port(), fed=True)


def test_a_sigkilled_trainers_slot_is_swept_and_the_next_sync_claims_cleanly(
    store: StoreClient, master: EmbeddedMaster
) -> None:
    """A trainer process (the remote sender) SIGKILLed while it forms the group: the
    coordinator's future fails, closing the slot sweeps the records the dead trainer would
    have removed, and the next sync on the same port delivers."""
    record, _ = published(store, "slot-killed")
    slot, port = uuid.uuid4().hex, free_port()
    code = (
        "import sys\n"
        "from mooncake_rl.settings import Settings\n"
        "from mooncake_rl.store import StoreClient\n"
        "from mooncake_rl.transport.rendezvous import serve_slot\n"
        "settings = Settings().with_overrides(segment_bytes=0)  # lends no memory\n"
        "serve_slot(StoreClient(settings), sys.argv[1], settings, 120.0)\n"
    )
    env = {**os.environ, **settings_for(master).client_env()}
    trainer = subprocess.Popen([sys.executable, "-c", code, slot], env=env)
    try:
        launcher = SlotLauncher(store, slot, "127.0.0.1")
        sender = launcher.start(spec_for(record, port, timeout_s=60.0))
        deadline = time.monotonic() + 120  # a loaded 2-core host starts it slowly
        while not store.exists([slot_key(slot, "beat")])[0]:  # the trainer waits or sends
            assert trainer.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.0)  # it read the spec and hosts the group's TCP store
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    with pytest.raises(SenderFailed, match="stopped answering"):
        sender.future.result(timeout=30)
    launcher.close()
    assert not any(slot_records(store, slot))
    broadcast_through_slot(store, master, "slot-after-kill", port)


def test_a_sender_that_fails_after_joining_releases_its_receivers_at_once(
    store: StoreClient, master: EmbeddedMaster
) -> None:
    """A spec naming a generation the Store does not hold: the sender joins the group, then
    fails reading; the receiver's pending broadcast fails at once (not after the group
    timeout), and the coordinator's future carries the sender's error."""
    record, _ = published(store, "slot-failing")
    spec = spec_for(record, free_port(), timeout_s=60.0)
    wrong = replace(spec, source=replace(spec.source, generation=record.generation + 7))
    failures: list[float] = []

    def receive() -> None:
        member = BroadcastGroup(
            GroupSpec("127.0.0.1", spec.port, 2, 1, spec.group_name, "gloo", 60.0), "127.0.0.1"
        )
        started = time.monotonic()
        try:
            member.broadcast(torch.empty(16, dtype=torch.uint8))
        except RuntimeError:
            failures.append(time.monotonic() - started)
            member.abort()

    slot = uuid.uuid4().hex
    launcher = SlotLauncher(store, slot, "127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        trainer = pool.submit(serve_slot, store, slot, settings_for(master), 90.0)
        receiver = threading.Thread(target=receive)
        receiver.start()
        sender = launcher.start(wrong)
        with pytest.raises(SenderFailed, match=r"remote sender: ObjectNotFound.*manifest"):
            sender.future.result(timeout=60)
        receiver.join(timeout=60)
        launcher.close()
        assert trainer.result(timeout=10) is None
    assert len(failures) == 1 and failures[0] < 30, failures
