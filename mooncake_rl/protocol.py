"""The typed bodies of the ``/mooncake/*`` routes: the contract between coordinator and engines.

Every field is bounded and checked here, before the receiver looks at its state: a body
that does not validate is answered 422 and changes nothing. Models are strict (no string
to number coercion) and refuse unknown fields. What can only be checked against the Store
(that a generation has an active record, that read keys belong to it, that push targets
were advertised in this session) is checked by the workers at prepare and apply, still
before anything is staged or written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

PROTOCOL_VERSION = 6
"""The ``/mooncake/*`` contract's version, reported in every engine's status; bumped on any
change a coordinator of the previous version could misread (2: direct mode receives in
place, so an aborted update may leave the engine rebuilding; 3: a direct slice names the
placement digest it was planned for, which a version-2 engine refuses as an unknown
field; 4: a slice's read or push may be a strided run, ``count, src_stride, dst_stride``
appended, which a version-3 engine refuses as malformed; 5: a slice lists its strings once
in ``names``, its arrays carry indices and its regions their stored dtypes, which a
version-4 engine refuses as malformed; 6: a drain names the record the update brings,
``target``, which a version-5 engine refuses as an unknown field). A coordinator refuses
engines of another version before any leaves rotation or drains: its router probe reads
every engine's status, and each wave's survey the version its placement replies report
(see :mod:`mooncake_rl.router.probe`)."""
PLACEMENT_DIGEST = "placement_digest"
PLANNED_FIELDS = ("tp_rank", "tp_size", "regions", "shards")
"""What a direct-mode plan reads of a worker's placement. Not its node (the topology's) nor
its id (the demand's digest pairs each id with its report), so the same rank of identical
engines reports one digest, and a coordinator reads one placement per distinct engine."""


def placement_digest(worker: Mapping[str, Any]) -> str:
    """SHA-256 of the planned fields of one worker's placement (canonical JSON).

    Each engine worker reports it with its placement; a coordinator keys its routing table
    on the reports (:func:`mooncake_rl.plan.demand.declared_digest`) instead of hashing
    every fragment of a 1T MoE, and checks them against the descriptions before it plans."""
    canonical = json.dumps(_planned(worker), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def reports_own_placement(worker: Mapping[str, Any]) -> bool:
    """Whether a worker's reported ``placement_digest`` (if any) is that of its description.

    A coordinator checks every description it plans from, and a 1T MoE engine's 32 ranks
    describe 50 MB of JSON: the standard library's canonical form costs 0.6 s, orjson's
    0.1 s. For what a description holds (ASCII names, integers, lists, mappings) the two are
    the same bytes; for anything else (a float, a non-ASCII name) they may differ, so a
    mismatch is confirmed with the canonical form before a report is called false."""
    reported = worker.get(PLACEMENT_DIGEST)
    if reported is None:
        return True
    try:
        fast = orjson.dumps(_planned(worker), option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # e.g. an integer past 64 bits: the canonical form decides
        fast = None
    if fast is not None and hashlib.sha256(fast).hexdigest() == reported:
        return True
    return placement_digest(worker) == reported


def _planned(worker: Mapping[str, Any]) -> dict[str, Any]:
    return {name: worker.get(name) for name in PLANNED_FIELDS}


def reported_placement(worker: Mapping[str, Any]) -> dict[str, Any]:
    """A worker's placement description as it is served: with its ``placement_digest``."""
    return {**worker, PLACEMENT_DIGEST: placement_digest(worker)}


BOXES = ("regions", "shards")
"""What ``GET /mooncake/placement?boxes=false`` leaves out of each worker's description: a
1T MoE's TP8 worker describes some 140k boxes (megabytes of JSON), and a coordinator that
holds the plan for the reported digests needs none of them."""


def without_boxes(worker: Mapping[str, Any]) -> dict[str, Any]:
    """A served placement description without its boxes (its digest still names them)."""
    return {name: value for name, value in worker.items() if name not in BOXES}


def has_boxes(worker: Mapping[str, Any]) -> bool:
    return all(name in worker for name in BOXES)


class PlacementQuery(BaseModel):
    """The query of ``GET /mooncake/placement``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    boxes: bool = Field(True, description="false: each worker's description without its boxes")


MAX_GENERATION = 2**53
"""Above any generation a Store will hand out; the workers bound it by the active record."""
MAX_STAGES = 1 << 16
MAX_TTL_S = 3600.0

Count = Annotated[int, Field(ge=0, lt=2**63)]
Length = Annotated[int, Field(gt=0, lt=2**63)]
Name = Annotated[str, Field(min_length=1, max_length=1024)]
WorkerId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\w.:@/-]+$")]
SessionId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Generation = Annotated[int, Field(gt=0, lt=MAX_GENERATION)]
DtypeName = Annotated[str, Field(pattern=r"^[a-z0-9_]{1,32}$")]
Hex32 = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
Hex16 = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
Fence = Annotated[int, Field(ge=0, lt=10**12, description="the active record's fence (0: none)")]
Incarnation = Annotated[
    Hex16 | None, Field(description="the Store incarnation of the active record")
]
Host = Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9.:\[\]-]+$")]


class Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# -- a worker's routing slice (mooncake_rl.apply.wire encodes it) --------------------------
class BatchWire(Wire):
    """Reads and pushes, their strings as indices into the slice's ``names``; either may end
    in a strided run, ``count, src_stride, dst_stride``."""

    reads: list[
        tuple[Count, Count, Count, Count, Length]
        | tuple[Count, Count, Count, Count, Length, Length, Length, Length]
    ] = Field(
        max_length=1 << 24,
        description="[key, src_offset, region, dst_offset, length(, count, src_stride, "
        "dst_stride)]",
    )
    pushes: list[
        tuple[Count, Count, Count, Count, Count, Length]
        | tuple[Count, Count, Count, Count, Count, Length, Length, Length, Length]
    ] = Field(
        max_length=1 << 24,
        description="[peer, src_region, src_offset, dst_region, dst_offset, length(, count, "
        "src_stride, dst_stride)]",
    )


class SliceWire(Wire):
    names: list[Name] = Field(
        max_length=1 << 24, description="every string the slice names, once; arrays index it"
    )
    regions: list[tuple[Count, Length] | tuple[Count, Length, Count]] = Field(
        max_length=1 << 24, description="[name, bytes(, stored dtype: direct mode)]"
    )
    stages: list[list[BatchWire]] = Field(max_length=MAX_STAGES)
    checksums: (
        list[
            tuple[Count, Length, Hex32, list[Hex16]]
            | tuple[Count, Length, Hex32, list[Hex16], list[Length]]
        ]
        | None
    ) = Field(
        None,
        max_length=1 << 24,
        description="[key, nbytes, whole, [block, ...](, [cut, ...]: a rank-major pack's)]",
    )


class TensorRow(Wire):
    """Where one full tensor sits in a receive region (compat layout, direct fallback)."""

    name: Name
    region: Name
    offset: Count
    shape: list[Count] = Field(max_length=16)
    dtype: DtypeName
    nbytes: Length | None = None


class WorkerRouting(Wire):
    slice: SliceWire
    layout: list[TensorRow]
    fallback: list[TensorRow]
    placement_digest: Digest | None = Field(
        None, description="direct mode: the worker's placement the slice was planned for"
    )


class RegionWire(Wire):
    base: Count
    size: Length


class PeerWire(Wire):
    """A worker as its prepare reply advertised it: where peers may write."""

    worker_id: WorkerId
    node: Name
    endpoint: Name
    regions: dict[Name, RegionWire]


# -- non-Store transports (mooncake_rl.transport) -------------------------------------------
class GroupWire(Wire):
    """The broadcast group an engine joins: the sender's TCP store and the engine's ranks."""

    host: Host
    port: int = Field(gt=1024, lt=65536)
    world_size: int = Field(ge=2, le=1 << 20)
    rank_offset: int = Field(ge=1, lt=1 << 20, description="rank of the engine's TP rank 0")
    name: Hex32
    backend: Literal["gloo", "nccl"]
    timeout_s: float = Field(gt=0, le=MAX_TTL_S)

    @model_validator(mode="after")
    def _inside(self) -> GroupWire:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} outside world {self.world_size}")
        return self


class ReceiveWire(Wire):
    """Full tensors a non-Store transport delivers; the layout follows from the generation's
    manifest and ``bucket_bytes`` (:func:`mooncake_rl.transport.layout.receive_layout`)."""

    transport: Literal["broadcast", "cpu_serialize"]
    bucket_bytes: int = Field(gt=0, le=1 << 40)
    group: GroupWire | None = None

    @model_validator(mode="after")
    def _group_iff_broadcast(self) -> ReceiveWire:
        if (self.group is not None) != (self.transport == "broadcast"):
            raise ValueError("a broadcast delivery names its group; CPU serialization none")
        return self


class AdapterRequest(Wire):
    """``POST /mooncake/adapter``: make a generation of the engine's LoRA adapter resident
    (``engine_ext.lora``); none named: the Store's active one."""

    generation: Generation | None = None


class DeltaWire(Wire):
    """A delta generation taken in place (``mooncake_rl.apply.delta``): only by an engine
    serving exactly ``base``, whose every box is a live, checksummed unit."""

    base: Generation


class BucketWire(Wire):
    """A CPU-serialized bucket in shared memory (``/dev/shm/<shm>``, safetensors)."""

    shm: str = Field(pattern=r"^mooncake-rl-[0-9a-f]{32}-[0-9]{1,6}$")
    nbytes: Length


# -- requests -------------------------------------------------------------------------------
class SessionRequest(Wire):
    """Names the update session a call belongs to (abort, renew)."""

    session: SessionId


class UpdateTarget(Wire):
    """The active record an update brings an engine to, as its prepare names it."""

    model: Name
    generation: Generation
    fence: Fence = 0
    incarnation: Incarnation = None


PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
"""How in-flight requests fare when an engine pauses to land: ``abort`` ends them (finish
reason ``abort``), ``wait`` lets them finish on the served generation first, ``keep``
freezes them and resumes them on the new one."""


class DrainRequest(SessionRequest):
    """Opens (or renews) an update session: its holder owns the engine until the lease ends.

    The engine keeps serving while the session stages; it pauses (``mode``, within
    ``timeout_s`` for ``wait``) only to land at commit, or before the first apply stage
    when its prepare receives into live parameters.

    ``target``: the record the update brings. An engine that serves another model, or this
    record or a newer one, refuses the drain and keeps serving: a coordinator that surveyed
    before a rival finished never pauses an engine the rival already brought up to date."""

    holder: str = Field(min_length=1, max_length=256, pattern=r"^[\x20-\x7e]+$")
    ttl_s: float = Field(30.0, ge=1.0, le=MAX_TTL_S)
    mode: PauseMode = "abort"
    timeout_s: float = Field(60.0, gt=0, le=MAX_TTL_S)
    target: UpdateTarget | None = None


class PrepareRequest(SessionRequest):
    model: Name
    generation: Generation
    manifest_digest: Digest
    mode: Literal["compat", "direct"]
    stages: int = Field(ge=0, le=MAX_STAGES, description="apply stages of this update")
    workers: dict[WorkerId, WorkerRouting] = Field(max_length=4096)
    fence: Fence = 0
    incarnation: Incarnation = None
    receive: ReceiveWire | None = Field(
        None, description="a non-Store transport delivers full tensors (workers: empty)"
    )
    in_place: bool = Field(
        True,
        description="direct mode: receive into live parameters that need no post-load "
        "processing (no staging copy; an update that then fails costs a rebuild)",
    )
    adapter: bool = Field(
        False,
        description="a LoRA adapter generation (model: the adapter's name), made resident "
        "beside the base at commit: no slices, no stages",
    )
    delta: DeltaWire | None = Field(
        None,
        description="a delta generation's changes, written into live parameters (workers: "
        "each one's planned fetch of entries, mooncake_rl.plan.delta)",
    )

    @model_validator(mode="after")
    def _one_transport(self) -> PrepareRequest:
        if self.receive is not None and (self.workers or self.mode != "compat"):
            raise ValueError(
                "a broadcast or CPU-serialized delivery carries no routing slices and lands "
                "full tensors (mode compat)"
            )
        if self.adapter and (
            self.workers or self.receive is not None or self.delta is not None or self.stages
        ):
            raise ValueError(
                "an adapter generation carries no routing slices, transport or delta, and "
                "runs no apply stage (stages: 0)"
            )
        if self.delta is not None and (
            self.receive is not None
            or self.mode != "direct"
            or not self.in_place
            or self.stages != 1
            or self.delta.base >= self.generation
        ):
            raise ValueError(
                "a delta is one stage, direct and in place, against an older generation"
            )
        return self


class ApplyRequest(SessionRequest):
    generation: Generation
    stage: int = Field(ge=0, lt=MAX_STAGES)
    peers: dict[WorkerId, PeerWire] = Field(max_length=1 << 16)
    bucket: BucketWire | None = Field(None, description="CPU serialization: this stage's bucket")


class BucketUpload(SessionRequest):
    """The query of ``POST /mooncake/bucket`` (its body is the bucket itself)."""

    generation: Generation
    stage: int = Field(ge=0, lt=MAX_STAGES)


class CommitRequest(SessionRequest):
    generation: Generation


def stage_refusal(stage: int, stages: int, done: int) -> tuple[int, str, str] | None:
    """Why stage ``stage`` may not run now (status, code, detail): stages run in order,
    ``0 .. stages - 1``, and ``done`` of them ran. Receiver and workers both enforce it."""
    if stage >= stages:
        return 422, "stage_out_of_range", f"stage {stage} of an update with {stages} stages"
    if stage != done:
        return (
            409,
            "stage_out_of_order",
            f"stage {stage} sent; stages run in order and {done} is next",
        )
    return None
