"""A LoRA adapter generation onto the engines, in the same session as weights.

    the active record of an adapter (``generations.lora``) + every engine's status --refused
    before any drain where an engine serves another base or keeps no adapter of this name;
    skipped where its newest landed adapter is this record--> drain (nothing pauses)
    --> prepare (every rank reads, checks and builds the adapter while its engine serves)
    --> commit (a short pause: resident, compared with a fresh build, named; resume)

The base weights are never touched (``engine_ext.adapting``), so a failed adapter update
leaves every engine serving its base and the adapters it had.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mooncake_rl.coordinator.result import UpdateFailed, UpdateResult, left_out, require_enough
from mooncake_rl.coordinator.session import SessionLease, prepare_body
from mooncake_rl.coordinator.survey import Phases, target_of
from mooncake_rl.generations.lora import AdapterRecord, load_adapter_record
from mooncake_rl.generations.registry import ActiveRecord

if TYPE_CHECKING:
    from mooncake_rl.coordinator.orchestration import Coordinator


def adapter_refusal(status: Mapping[str, Any], adapter: AdapterRecord, policy: str) -> str | None:
    """Why an engine (its status) cannot take generation of adapter ``policy``."""
    kept = status.get("adapter")
    if kept is None or kept.get("model") != policy:
        return (
            f"it keeps no LoRA adapter named {policy!r}: start it with --enable-lora and "
            f'"lora": "{policy}" in --model-loader-extra-config (docs/lora.md)'
        )
    return adapter.refusal(str(status.get("model")), int(status.get("generation") or 0))


def serves_adapter(status: Mapping[str, Any], record: ActiveRecord) -> bool:
    """The engine's newest landed adapter is this record's generation (one loaded at
    start, outside a session, knows no fence)."""
    kept = status.get("adapter") or {}
    return (kept.get("model"), kept.get("generation")) == (record.model, record.generation)


def sync_adapter(
    coordinator: Coordinator, record: ActiveRecord, needed: int, drain_mode: str = "wait"
) -> UpdateResult:
    """A LoRA generation (``generations.lora``) in the same session as weights: refused
    before any drain where an engine serves another base or keeps no adapter of this
    name; then drain (nothing pauses), prepare (every rank reads and checks the
    adapter and builds it while serving), commit (a short pause: resident, compared
    with a fresh build, named). The base is never touched (``engine_ext.adapting``)."""
    result = UpdateResult(record.model, record.generation, "lora", list(coordinator.engines))
    result.drain_mode = drain_mode
    phase = Phases(result, coordinator._progress)
    adapter = load_adapter_record(coordinator.store, record.model, record.generation)
    assert adapter is not None
    statuses, failed = coordinator._all(coordinator.engines, "GET", "status")
    left_out(result, failed)
    refused = {
        url: why
        for url, status in statuses.items()
        if (why := adapter_refusal(status, adapter, record.model))
    }
    if refused:
        result.error = "adapter refused before any drain: " + "; ".join(
            f"{url}: {why}" for url, why in sorted(refused.items())
        )
        raise UpdateFailed(result)
    result.skipped = [
        u for u in coordinator.engines if u in statuses and serves_adapter(statuses[u], record)
    ]
    targets = [u for u in coordinator.engines if u in statuses and u not in result.skipped]
    require_enough(result, [*targets, *result.skipped], needed, "status")
    phase("status")
    if not targets:
        return result
    session = SessionLease(coordinator, coordinator.session_ttl_s)
    result.session = session.id
    body = prepare_body(session, record, mode="compat", stages=0, workers={}, adapter=True)
    with session.holding(result):
        still = max(1, needed - len(result.skipped))
        members = session.drain(targets, drain_mode, still, result, target_of(record))
        phase("drain")
        members, _, prepared = session.prepare(
            members, lambda urls: None, lambda url, plan: body, still, result, phase
        )
        result.store_read_bytes = sum(
            w.get("adapter_bytes", 0) for reply in prepared.values() for w in reply["workers"]
        )
        session.commit(members, record, still, result)
        phase("commit")
    return result
