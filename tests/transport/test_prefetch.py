"""The CPU leg's pipeline (:func:`mooncake_rl.transport.source.prefetched`): the next bucket
is read and packed while the previous one is handed off, and what comes out is exactly what
the serial read gives, byte for byte, from a real Store."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.buckets import pack
from mooncake_rl.transport.source import Source, prefetched, read_buckets
from tests.conftest import settings_for


def test_the_producer_runs_one_item_ahead_of_the_consumer() -> None:
    produced: list[int] = []
    second = threading.Event()

    def items() -> Iterator[int]:
        for i in range(4):
            produced.append(i)
            if i == 1:
                second.set()
            yield i

    out = prefetched(items())
    assert next(out) == 0
    assert second.wait(5)  # item 1 is read while the caller still holds item 0
    assert list(out) == [1, 2, 3] and produced == [0, 1, 2, 3]


def test_an_error_comes_at_its_place_and_an_early_close_stops_the_producer() -> None:
    def failing() -> Iterator[int]:
        yield 0
        raise OSError("read failed")

    out = prefetched(failing())
    assert next(out) == 0
    with pytest.raises(OSError, match="read failed"):
        next(out)
    produced: list[int] = []

    def endless() -> Iterator[int]:
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    out = prefetched(endless())
    assert next(out) == 0
    out.close()
    count = len(produced)
    assert count <= 4 and len(produced) == count  # stopped, nothing more is read
    with pytest.raises(InvariantViolation):
        next(prefetched(iter([]), depth=0))


def test_pipelined_buckets_are_the_serial_ones_byte_for_byte(master: EmbeddedMaster) -> None:
    generator = torch.Generator().manual_seed(5)
    tensors = {f"w{i}": torch.randn(96, 16 + i, generator=generator) for i in range(9)}
    with StoreClient(settings_for(master)) as store:
        publish_local(store, "prefetch", tensors.items(), dtype="float32")
        record = GenerationRegistry(store, "prefetch").active()
        assert record is not None
        source = Source.of(record, 16 << 10)
        _, serial = read_buckets(store, source)
        expected = [(b.index, pack(t)) for b, t in serial]
        _, buckets = read_buckets(store, source)
        piped = list(prefetched((b.index, pack(t)) for b, t in buckets))
    assert len(expected) > 3 and piped == expected
