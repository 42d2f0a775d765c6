"""What a worker checks against the Store before it stages, registers or pushes anything.

An update body is only as trustworthy as whoever could send it (a bearer token guards the
routes, nothing more), so each worker re-derives from the Store every fact that decides
where its bytes come from and where they go:

- **The generation.** ``fence`` names an active record of the model in this Store, and that
  record names exactly the request's generation, manifest digest and incarnation (without
  a fence, the manifest at that generation exists with that digest). A generation nobody
  announced has no record, which is what bounds generation numbers.
- **Reads.** Every key a slice reads is a payload object of that generation, held whole in
  the Store at the size its checksum row declares, and every read range lies inside it.
- **Pushes.** A worker writes only into peers that advertised themselves in the Store for
  this session (at prepare, once their staging was registered), inside the regions they
  advertised; the apply body's peer table must equal those advertisements. So a body cannot
  send staged bytes to an address some other Transfer Engine registered (a Store holder's
  segment, another engine's live weights).

Every refusal is a :class:`RequestRefused` and leaves everything as it was.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from mooncake_rl.apply.executor import Batch, Peer
from mooncake_rl.apply.wire import WorkerSlice
from mooncake_rl.apply.worker import peers_from, pushed_regions
from mooncake_rl.errors import InvariantViolation, MooncakeError, ObjectNotFound
from mooncake_rl.generations.keys import advert_key, adverts_pattern, group_id, payload_prefix
from mooncake_rl.generations.registry import ActiveRecord, FenceError, GenerationRegistry
from mooncake_rl.protocol import ApplyRequest, PrepareRequest
from mooncake_rl.store import StoreClient

logger = logging.getLogger(__name__)

MISSING_HINT = (
    "a segment holder was lost or the generation was collected: `mooncake-rl status` lists "
    "the readable generations; `mooncake-rl activate` one of them or republish"
)


class RequestRefused(Exception):
    """A worker call refused before anything changed: a malformed or inconsistent request
    (``status`` 422) or one that conflicts with the Store or the worker's state (409)."""

    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail


M = TypeVar("M", bound=BaseModel)


def parsed(model: type[M], request: Any) -> M:
    """The request's fields checked by the routes' own rules (workers can be called directly)."""
    try:
        return model.model_validate(request)
    except ValidationError as error:
        raise RequestRefused(
            422, "invalid_request", error.json(include_url=False, include_input=False)
        ) from error


def prepare_request(request: Any, worker_id: str) -> tuple[PrepareRequest, Mapping[str, Any]]:
    """The request's scalar fields, validated, and this worker's raw routing entry.

    Only this worker's entry is kept: its slice is parsed by ``decode_slice``, which is
    cheaper than the wire model for large slices and yields the executor's types directly.
    """
    workers = request.get("workers") if isinstance(request, Mapping) else None
    if not isinstance(workers, Mapping) or not isinstance(workers.get(worker_id), Mapping):
        raise RequestRefused(
            422,
            "no_slice",
            f"the prepare request has no routing slice for worker {worker_id}: the plan was "
            "made for another placement; re-read /mooncake/placement and plan again",
        )
    return parsed(PrepareRequest, {**request, "workers": {}}), workers[worker_id]


def apply_request(request: Any) -> ApplyRequest:
    return parsed(ApplyRequest, request)


# -- prepare ---------------------------------------------------------------------------------
def check_generation(store: StoreClient, request: PrepareRequest) -> ActiveRecord | None:
    """The request names an active record of the model in this Store, exactly: that record
    when the request gives its fence (``None`` without one, once the manifest matched)."""
    registry = GenerationRegistry(store, request.model)
    named = (
        f"generation {request.generation} of {request.model} (fence {request.fence}, "
        f"incarnation {request.incarnation}, manifest {request.manifest_digest[:16]}...)"
    )
    unknown = (
        f"{named} is not an active record of {request.model} in this Store; the coordinator "
        "reads it from `mooncake-rl status`"
    )
    if request.fence:
        record = registry.fence_record(request.fence)
        if record is None:
            raise RequestRefused(
                409, "unknown_generation", f"{unknown} (no record {request.fence})"
            )
        if (record.generation, record.manifest_digest, record.incarnation) != (
            request.generation,
            request.manifest_digest,
            request.incarnation,
        ):
            raise RequestRefused(
                409,
                "unknown_generation",
                f"{unknown} (record {request.fence} names generation {record.generation}, "
                f"incarnation {record.incarnation}, manifest {record.manifest_digest[:16]}...)",
            )
        return record
    try:
        registry.load_manifest(request.generation, request.manifest_digest)
    except FenceError as error:
        raise RequestRefused(409, "manifest_mismatch", f"{named}: {error}") from error
    except (ObjectNotFound, InvariantViolation) as error:
        raise RequestRefused(409, "unknown_generation", f"{unknown} ({error})") from error
    return None


def check_reads(store: StoreClient, model: str, generation: int, worker_slice: WorkerSlice) -> None:
    """Every read is of a whole payload object of this generation, inside its bytes."""
    prefix = payload_prefix(group_id(model, generation))
    keys = sorted(worker_slice.read_keys)
    foreign = [key for key in keys if not key.startswith(prefix)]
    if foreign:
        raise RequestRefused(
            422,
            "foreign_key",
            f"the routing slice reads {foreign[0]!r}, which is not an object of generation "
            f"{generation} of {model} (those lie under {prefix!r})",
        )
    if not keys:
        return
    checksums = worker_slice.checksums or {}
    unchecked = [key for key in keys if key not in checksums]
    if unchecked:
        raise RequestRefused(
            422,
            "unchecked_slice",
            f"the routing slice reads {unchecked[0]!r} without its checksum row; refusing to "
            "land unchecked bytes (the coordinator sends them with every update)",
        )
    whole: dict[str, int] = {}
    for key, size in zip(keys, store.complete_sizes(keys), strict=True):
        declared = checksums[key].nbytes
        if size is None:
            raise RequestRefused(
                409,
                "object_missing",
                f"{key} is not held whole in the Store (absent or incomplete); {MISSING_HINT}",
            )
        if size != declared:
            raise RequestRefused(
                409,
                "object_missing",
                f"{key} holds {size} bytes in the Store, its checksum row says {declared}",
            )
        whole[key] = size
    for stage in worker_slice.stages:
        for batch in stage:
            for op in batch.reads:
                if op.src_offset + op.length > whole[op.key]:
                    raise RequestRefused(
                        409,
                        "object_missing",
                        f"the slice reads bytes [{op.src_offset}, {op.src_offset + op.length}) "
                        f"of {op.key}, which holds {whole[op.key]} bytes",
                    )


# -- advertisements --------------------------------------------------------------------------
def disagreement(
    advert: Mapping[str, Any], body: Mapping[str, Any], pushed: Collection[str]
) -> list[str]:
    """Where an apply body's description of a peer departs from its advertisement: fields
    that differ, regions named otherwise than advertised, and pushed-into regions the body
    leaves out (as ``regions.<name>``)."""
    differ = sorted(k for k in {*advert, *body} - {"regions"} if advert.get(k) != body.get(k))
    advertised, named = advert.get("regions") or {}, body.get("regions") or {}
    return differ + sorted(
        f"regions.{name}"
        for name in {*named, *pushed}
        if name not in named or advertised.get(name) != named[name]
    )


def advertise(store: StoreClient, session: str, description: Mapping[str, Any]) -> None:
    """Publish where peers may write into this worker, for this session only.

    A worker is in one session at a time, so its advertisements of any other session are
    over (a crashed worker or a failed :func:`withdraw` left them): they are swept first.
    An upsert, not a put: a re-prepare in the same session may have moved the arena, and a
    put to an existing key would silently keep the old advertisement.
    """
    store.remove_matching(adverts_pattern(description["worker_id"]), force=True)
    key = advert_key(session, description["worker_id"])
    store.upsert_bytes(key, json.dumps(description, sort_keys=True).encode())


def withdraw(store: StoreClient, session: str, worker_id: str) -> None:
    """Best effort: a left-over advertisement names staging that is no longer registered,
    and nobody outside its session reads it."""
    try:
        failed = store.remove([advert_key(session, worker_id)], force=True)
    except MooncakeError as error:
        failed = {advert_key(session, worker_id): error.code}
    if failed:
        logger.warning("mooncake: advertisement of %s left in the Store: %s", worker_id, failed)


class PeerBook:
    """The advertisements of one session's peers, read once each from the Store."""

    def __init__(self, store: StoreClient, session: str) -> None:
        self.store = store
        self.session = session
        self._adverts: dict[str, dict[str, Any]] = {}

    def _advert(self, worker_id: str, fresh: bool) -> dict[str, Any]:
        if fresh or worker_id not in self._adverts:
            try:
                data = self.store.get_bytes(advert_key(self.session, worker_id))
            except ObjectNotFound as error:
                raise RequestRefused(
                    422,
                    "untrusted_peer",
                    f"the stage pushes to {worker_id}, which advertised nothing in session "
                    f"{self.session}: only workers prepared in this session can be written",
                ) from error
            self._adverts[worker_id] = json.loads(data)
        return self._adverts[worker_id]

    def trusted(
        self, batches: Sequence[Batch], given: Mapping[str, Any], own_id: str
    ) -> dict[str, Peer]:
        """The peers these batches push to, as they advertised themselves in the Store.

        ``given`` (the apply body's peer table) must agree with every advertisement: the
        body names each peer the stage pushes to, with at least the regions it pushes into
        (the coordinator sends only those), each as advertised. Every push must lie inside
        the region it targets. A mismatch against a cached advertisement is re-read once:
        the peer may have re-prepared in this session. Pushes to ``own_id`` (this worker)
        are local copies, checked against its own regions when it prepared.
        """
        targets = pushed_regions(batches, own_id)
        adverts: dict[str, dict[str, Any]] = {}
        for worker_id, regions in sorted(targets.items()):
            body = given.get(worker_id)
            if body is None:
                raise RequestRefused(
                    422,
                    "untrusted_peer",
                    f"the stage pushes to {worker_id}, which the apply body's peers do not name",
                )
            advert = self._advert(worker_id, fresh=False)
            if disagreement(advert, body, regions):
                advert = self._advert(worker_id, fresh=True)
            differ = disagreement(advert, body, regions)
            if differ:
                raise RequestRefused(
                    422,
                    "untrusted_peer",
                    f"the apply body describes {worker_id} otherwise than it advertised itself "
                    f"in session {self.session} (differing: {', '.join(differ)})",
                )
            adverts[worker_id] = advert
        peers = peers_from(list(adverts.values()), targets)
        for batch in batches:
            for op in batch.pushes:
                if op.peer == own_id:
                    continue
                region = peers[op.peer].regions.get(op.dst_region)
                if region is None or op.dst_offset + op.length > region.size:
                    size = "no such region" if region is None else f"{region.size} bytes"
                    raise RequestRefused(
                        422,
                        "untrusted_peer",
                        f"a push writes bytes [{op.dst_offset}, {op.dst_offset + op.length}) of "
                        f"region {op.dst_region!r} of {op.peer}, which advertised {size} there",
                    )
        return peers
