"""Reading one generation for a non-Store transport: every object once, checked, in buckets."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from mooncake_rl.apply.coalesce import coalesced_reads
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import rollout_dtype
from mooncake_rl.generations.registry import ActiveRecord, GenerationRegistry
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.layout import Bucket, ReceiveLayout, receive_layout

T = TypeVar("T")


@dataclass(frozen=True)
class Source:
    """A generation by its digests, and the bucket size both ends lay it out with."""

    model: str
    generation: int
    manifest_digest: str
    checksums_digest: str
    bucket_bytes: int

    @classmethod
    def of(cls, record: ActiveRecord, bucket_bytes: int) -> Source:
        return cls(
            record.model,
            record.generation,
            record.manifest_digest,
            record.checksums_digest,
            bucket_bytes,
        )


def read_buckets(
    store: StoreClient, source: Source
) -> tuple[ReceiveLayout, Iterator[tuple[Bucket, dict[str, torch.Tensor]]]]:
    """The layout, and the generation's tensors bucket by bucket (by checkpoint name): one
    ranged read per bucket (a packed tensor's bytes alone, adjacent tensors merged), each
    tensor checked against its own checksum."""
    registry = GenerationRegistry(store, source.model)
    manifest = registry.load_manifest(source.generation, source.manifest_digest)
    checksums = registry.load_checksums(source.generation, source.checksums_digest).objects
    layout = receive_layout(manifest, source.bucket_bytes)

    def buckets() -> Iterator[tuple[Bucket, dict[str, torch.Tensor]]]:
        for bucket in layout.buckets:
            members = layout.bucket_tensors(bucket)
            data = torch.empty(bucket.nbytes, dtype=torch.uint8)
            reads = [read for t in members for read in t.reads(bucket.start)]
            store.register(data.data_ptr(), data.numel())
            try:
                store.read_ranges(data.data_ptr(), coalesced_reads(reads))
            finally:
                store.unregister(data.data_ptr())
            tensors = {}
            for tensor in members:
                own = data[tensor.offset - bucket.start :][: tensor.nbytes]
                tensor.check(own, checksums)
                dtype = rollout_dtype(tensor.dtype)
                tensors[tensor.name] = own.view(dtype).view(tensor.shape)
            yield bucket, tensors

    return layout, buckets()


_END = object()


def prefetched(items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """``items`` in order, produced on a thread of their own up to ``depth`` ahead: the next
    bucket is read (and packed) while the caller hands off the previous one. An error of
    ``items`` is raised here, at its place in the order; closing the result early stops the
    producer after its next item."""
    if depth < 1:
        raise InvariantViolation(f"a prefetch depth must be at least 1, got {depth}")
    ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                ready.put(item)
                if stop.is_set():
                    return
            ready.put(_END)
        except BaseException as error:  # re-raised by the consumer
            ready.put(error)

    producer = threading.Thread(target=produce, name="prefetch", daemon=True)
    producer.start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while producer.is_alive():  # unblock a producer waiting on a full queue
            with contextlib.suppress(queue.Empty):
                ready.get(timeout=0.05)
