"""Deterministic Store keys. Every generation gets its own group, so no key is ever reused."""

from __future__ import annotations

import re

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.store import regex_literal

NAMESPACE = "mooncake-rl"
_PLANS = f"{NAMESPACE}/_plans/"  # routing tables, by source layout (no model's prefix)
_SESSIONS = f"{NAMESPACE}/sessions/"  # update sessions' records, by session
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SESSION = re.compile(r"^[0-9a-f]{32}$")


def check_model_name(model: str) -> str:
    if not _MODEL_NAME.match(model):
        raise InvariantViolation(
            f"model name {model!r} must be 1-128 characters of letters, digits, '.', '_', '-'"
        )
    return model


def check_generation(generation: int) -> int:
    if type(generation) is not int or not 0 < generation < 10**12:
        raise InvariantViolation(f"generation must be an integer in [1, 10^12), got {generation!r}")
    return generation


def model_prefix(model: str) -> str:
    return f"{NAMESPACE}/{check_model_name(model)}"


def group_id(model: str, generation: int) -> str:
    return f"{model_prefix(model)}/g{check_generation(generation):012d}"


def manifest_key(group: str) -> str:
    return f"{group}/manifest"


def payload_prefix(group: str) -> str:
    return f"{group}/payload/"


def payload_key(group: str, object_name: str) -> str:
    return payload_prefix(group) + object_name


def claim_key(group: str) -> str:
    """Created exclusively by the one publish attempt that owns the group; never reused."""
    return f"{group}/claim"


def checksums_key(group: str) -> str:
    return f"{group}/checksums"


def adapter_key(group: str) -> str:
    """A LoRA generation's adapter record (:mod:`.lora`): its base and PEFT config."""
    return f"{group}/adapter"


def delta_prefix(group: str) -> str:
    """A delta generation's delta objects, one per payload object (:mod:`.chain`)."""
    return f"{group}/delta/"


def deltas_key(group: str) -> str:
    """A delta generation's delta table (:mod:`.chain`): its base, keyframe and entries."""
    return f"{group}/deltas"


def segments_key(group: str) -> str:
    """The announce's record of which Store segment holds each payload (locality hints)."""
    return f"{group}/segments"


def report_key(group: str, rank: int) -> str:
    return report_prefix(group) + str(rank)


def report_prefix(group: str) -> str:
    return f"{group}/report/"


def aborted_key(group: str) -> str:
    """Written before an abort sweeps the group: a late publisher sees it and cleans up."""
    return f"{group}/aborted"


def active_key(model: str) -> str:
    """A copy of the newest active record: where readers start probing fence records."""
    return f"{model_prefix(model)}/active"


def fence_key(model: str, fence: int) -> str:
    """Active record number ``fence``: created exclusively, so each number has one writer."""
    return f"{model_prefix(model)}/fence/{fence:012d}"


def routing_tables_prefix(source_digest: str) -> str:
    """The routing tables planned from one source layout: GC removes them together once no
    generation it keeps has that layout. ``_`` starts no model name, so no model prefix
    covers them."""
    return f"{_PLANS}{source_digest}/"


def legacy_routing_tables_pattern() -> str:
    """Routing tables of releases before issue 51, named by their plan key's digest alone
    (``mooncake-rl/_plans/<64 hex>``): no release reads them, and no GC knew their layout."""
    return f"^{regex_literal(_PLANS)}[0-9a-f]{{64}}$"


def routing_table_key(source_digest: str, digest: str) -> str:
    """A routing table kept for later processes (``mooncake_rl.plan.stored``), named by the
    digest of its plan key, under its source layout."""
    return routing_tables_prefix(source_digest) + digest


INCARNATION_KEY = f"{NAMESPACE}/incarnation"
"""Created once per master lifetime: a master that lost its state lost this record too."""


def index_key(model: str) -> str:
    return f"{model_prefix(model)}/index"


def lease_key(model: str, engine_id: str) -> str:
    return f"{model_prefix(model)}/lease/{engine_id}"


def etcd_leases_prefix(cluster_id: str, model: str) -> str:
    """Where a durable Store's serving leases live in its etcd (keys, not Store objects)."""
    return f"{NAMESPACE}/{cluster_id}/{check_model_name(model)}/leases/"


def engines_key(model: str) -> str:
    return f"{model_prefix(model)}/engines"


def check_session(session: str) -> str:
    if not isinstance(session, str) or not _SESSION.match(session):
        raise InvariantViolation(f"update session must be 32 lowercase hex digits, got {session!r}")
    return session


def session_prefix(session: str) -> str:
    """Records of one update session; nothing outside the session reads them."""
    return f"{_SESSIONS}{check_session(session)}/"


def advert_key(session: str, worker_id: str) -> str:
    """Where a worker advertises, for one session, the regions peers may write into."""
    return session_prefix(session) + worker_id


def adverts_pattern(worker_id: str) -> str:
    """Every advertisement of ``worker_id``, whatever its session."""
    return f"^{regex_literal(_SESSIONS)}[0-9a-f]{{32}}/{regex_literal(worker_id)}$"


def pack_order_key(model: str) -> str:
    """How the engines last cut ``model``'s tensors: publishers lay packs out by it."""
    return f"{model_prefix(model)}/pack-order"
