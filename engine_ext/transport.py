"""A worker's side of the non-Store transports: broadcast and CPU serialization.

Both deliver the generation's full tensors into one receive buffer laid out by
:func:`mooncake_rl.transport.layout.receive_layout`, which the worker derives from the
manifest itself. Every tensor is checked against the generation's published checksums as it
lands in the buffer, so neither a rogue group member nor a stale bucket file can put bytes
into the model that its publisher did not write. Live weights change only at commit, through
the same landing as the Store's compat mode (:meth:`engine_ext.landing.LandingWorker._commit`).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from engine_ext.admission import RequestRefused
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.checksums import ObjectChecksum
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.protocol import BucketWire, PrepareRequest, ReceiveWire
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.buckets import MalformedBucket, read_shm, unpack_into
from mooncake_rl.transport.group import BroadcastGroup, GroupSpec
from mooncake_rl.transport.layout import ReceivedTensor, ReceiveLayout, receive_layout

RECEIVED_REGION = "received"
PROCESS = uuid.uuid4().hex
"""This process's identity in placement: the coordinator keeps a broadcast group only while
every member's process is the one that joined it."""


@dataclass
class Reception:
    """One worker's pending delivery: what arrives, where, and what was checked."""

    wire: ReceiveWire
    layout: ReceiveLayout
    buffer: torch.Tensor
    checksums: dict[str, ObjectChecksum]
    rank: int = 0
    landed: set[int] = field(default_factory=set)

    @property
    def stages(self) -> int:
        """Apply stages: broadcast receives everything in one; CPU takes a bucket each."""
        return 1 if self.wire.transport == "broadcast" else len(self.layout.buckets)

    def rows(self) -> list[dict[str, Any]]:
        return self.layout.rows(RECEIVED_REGION)


def prepare_reception(
    store: StoreClient,
    request: PrepareRequest,
    tp_rank: int,
    reuse: torch.Tensor | None,
    device: torch.device,
) -> Reception:
    """Check the delivery against the generation and allocate its buffer; touches nothing
    live. ``reuse``: the previous delivery's buffer, kept while the size fits."""
    wire = request.receive
    assert wire is not None
    registry = GenerationRegistry(store, request.model)
    manifest = registry.load_manifest(request.generation, request.manifest_digest)
    record = registry.fence_record(request.fence) if request.fence else None
    digest = record.checksums_digest if record is not None else None
    if digest is None:
        raise RequestRefused(
            409,
            "unknown_generation",
            f"generation {request.generation} has no active record naming its checksums",
        )
    checksums = dict(registry.load_checksums(request.generation, digest).objects)
    try:
        layout = receive_layout(manifest, wire.bucket_bytes)
    except InvariantViolation as error:
        raise RequestRefused(422, "unsupported_generation", str(error)) from error
    reception = Reception(wire, layout, torch.empty(0, dtype=torch.uint8), checksums)
    if request.stages != reception.stages:
        raise RequestRefused(
            422,
            "stage_count_mismatch",
            f"a {wire.transport} delivery of generation {request.generation} in buckets of "
            f"{wire.bucket_bytes} bytes takes {reception.stages} stages, the update declares "
            f"{request.stages}: sender and engine disagree on the layout",
        )
    if wire.group is not None:
        reception.rank = wire.group.rank_offset + tp_rank
        if reception.rank >= wire.group.world_size:
            raise RequestRefused(
                422,
                "rank_outside_group",
                f"TP rank {tp_rank} joins at rank {reception.rank}, outside a group of "
                f"{wire.group.world_size}: the group was sized for fewer ranks per engine",
            )
    fits = reuse is not None and reuse.numel() == layout.total_bytes and reuse.device == device
    reception.buffer = (
        reuse if fits else torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    )
    return reception


KEPT_GROUPS = 8
"""Groups a worker keeps at most (one per live sender it serves; the oldest goes first)."""


class Membership:
    """This worker's broadcast groups, kept across updates while a coordinator names the
    same group again (its sender keeps it too): joining costs seconds, a small update less.
    One per sender port: a new group at a port replaces the old, whose sender is gone."""

    def __init__(self) -> None:
        self._groups: OrderedDict[tuple[str, int], tuple[GroupSpec, BroadcastGroup]] = OrderedDict()

    def join(self, spec: GroupSpec, local_address: str) -> tuple[BroadcastGroup, bool]:
        """The member for ``spec`` and whether it was kept from an earlier update."""
        at = (spec.host, spec.port)
        held = self._groups.get(at)
        if held is not None and held[0] == spec:
            self._groups.move_to_end(at)
            return held[1], True
        self.leave(spec)
        member = BroadcastGroup(spec, local_address)
        self._groups[at] = (spec, member)
        while len(self._groups) > KEPT_GROUPS:
            _, (_, oldest) = self._groups.popitem(last=False)
            oldest.abort()
        return member, False

    def leave(self, spec: GroupSpec) -> None:
        """Drop the group at ``spec``'s port (after a failure its peers may be gone)."""
        held = self._groups.pop((spec.host, spec.port), None)
        if held is not None:
            held[1].abort()


def receive_broadcast(
    reception: Reception, local_address: str, membership: Membership
) -> dict[str, Any]:
    """Join the group at this worker's rank (or keep the joined one), receive every bucket
    in place, check it."""
    group = reception.wire.group
    assert group is not None
    started = time.perf_counter()
    spec = GroupSpec(
        group.host,
        group.port,
        group.world_size,
        reception.rank,
        group.name,
        group.backend,
        group.timeout_s,
    )
    member, kept = membership.join(spec, local_address)
    try:
        for bucket in reception.layout.buckets:
            member.broadcast(reception.buffer[bucket.start : bucket.end])
        member.barrier()  # the sender's report acknowledges every member's last byte
    except BaseException:
        membership.leave(spec)
        raise
    received = time.perf_counter()
    for bucket in reception.layout.buckets:
        _check(reception, reception.layout.bucket_tensors(bucket))
        reception.landed.add(bucket.index)
    return {
        "received_bytes": reception.layout.total_bytes,
        "group_kept": kept,
        "receive_seconds": received - started,
        "verify_seconds": time.perf_counter() - received,
    }


def receive_bucket(reception: Reception, stage: int, bucket: BucketWire | None) -> dict[str, Any]:
    """Land CPU-serialized bucket ``stage`` from shared memory, checked."""
    if bucket is None:
        raise RequestRefused(
            422, "no_bucket", f"apply stage {stage} of a CPU-serialized delivery names no bucket"
        )
    started = time.perf_counter()
    layout_bucket = reception.layout.buckets[stage]
    try:
        data = read_shm(bucket.shm)
    except FileNotFoundError as error:
        raise RequestRefused(
            409, "bucket_missing", f"bucket file /dev/shm/{bucket.shm} does not exist"
        ) from error
    if len(data) != bucket.nbytes:
        raise RequestRefused(
            409,
            "bucket_size_mismatch",
            f"/dev/shm/{bucket.shm} holds {len(data)} bytes, the request says {bucket.nbytes}",
        )
    try:
        unpack_into(data, reception.layout, layout_bucket, reception.buffer)
    except MalformedBucket as error:
        raise RequestRefused(422, "malformed_bucket", str(error)) from error
    _check(reception, reception.layout.bucket_tensors(layout_bucket))
    reception.landed.add(stage)
    return {
        "received_bytes": layout_bucket.nbytes,
        "receive_seconds": time.perf_counter() - started,
    }


def _check(reception: Reception, tensors: tuple[ReceivedTensor, ...]) -> None:
    """Each tensor's bytes against its object's published checksum (raises CorruptObject)."""
    buffer = reception.buffer
    for tensor in tensors:
        data = buffer[tensor.offset : tensor.offset + tensor.nbytes]
        tensor.check(data.cpu(), reception.checksums)
