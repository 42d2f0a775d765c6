"""What an update reports, and the errors that carry that report out.

Each wave's steps (:mod:`.survey`, :mod:`.session`) fill one :class:`UpdateResult`; a rolling
update adds each wave into one total (:meth:`UpdateResult.absorb`). An update that ends short
of ``min_engines`` raises :class:`UpdateFailed` with the result so far; one that synced but
left engines out of a router's rotation raises :class:`ReadmitFailed`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mooncake_rl.errors import MooncakeRLError
from mooncake_rl.transport.modes import TransportMode

if TYPE_CHECKING:
    from mooncake_rl.coordinator.client import EngineRequestFailed
    from mooncake_rl.plan.update import UpdatePlan


@dataclass
class UpdateResult:
    model: str
    generation: int
    mode: str
    engines: list[str]
    phase_seconds: dict[str, float] = field(default_factory=dict)
    store_read_bytes: int = 0
    store_reread_bytes: int = 0  # repeated after LEASE_EXPIRED (see StoreClient.read_ranges)
    pushed_bytes: int = 0
    planned_read_bytes: int = 0
    planned_pushed_bytes: int = 0
    unique_demand_bytes: int = 0
    cross_node_pushed_bytes: int = 0
    received_bytes: dict[str, int] = field(default_factory=dict)
    # Of received_bytes, what each worker lands through load_weights (direct mode's fallback)
    fallback_bytes: dict[str, int] = field(default_factory=dict)
    # Of received_bytes (all engines): bytes received straight into live parameters, and
    # bytes received into staging and landed at commit (every byte in compat mode).
    in_place_bytes: int = 0
    staged_bytes: int = 0
    # Per engine, each worker's staging place as its prepare chose it
    # (``engine_ext.staging.StagingPlace``: device or host, and why).
    staging: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    node_nic_bytes: dict[str, int] = field(default_factory=dict)
    # The post-landing check per worker: {"checked", "unchecked", "mismatched", "seconds"}.
    verified: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)
    # Engines left out, and why; each serves its old generation (or rebuilds itself).
    failed: dict[str, str] = field(default_factory=dict)
    # The same engines' error codes: the engine's ``error``; ``unreachable`` when no reply
    # came, ``http_<status>`` for a reply without one, ``delivery_failed`` for a lost leg.
    failure_codes: dict[str, str] = field(default_factory=dict)
    # Engines that rebuild themselves from the Store's active generation: their commit
    # failed, or their update ended otherwise after receiving into live parameters.
    rebuild: list[str] = field(default_factory=list)
    session: str | None = None
    # The transport mode, and per engine its transport, the bytes its ranks received and
    # the seconds its delivery took.
    transport: str = TransportMode.STORE.value
    # How the Store was read: once for the fleet ("single") or once per rollout node
    # ("node": store_read_bytes is then unique_demand_bytes times the consuming nodes).
    pull: str = "single"
    # How the engines paused to land: "abort" in-flight requests, "wait" for them to end,
    # or "keep" them (frozen, then resumed on the new weights).
    drain_mode: str = "abort"
    # Per engine, its pause to land and the landing's parts (seconds): ``pause_s`` (the
    # drain mode's pause), ``land_and_check_s`` (of it, the slowest rank's ``land_s``, the
    # engine's reload, and ``check_s``, the post-landing check), ``reset_cache_s``,
    # ``weight_version_s``, ``resume_s``.
    landing: dict[str, dict[str, float]] = field(default_factory=dict)
    legs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # With a router: per engine taken out, "readmitted", "retired" (removed meanwhile, so
    # not re-added) or "failed: <why>" (still out of rotation).
    rotation: dict[str, str] = field(default_factory=dict)
    waves: int = 0
    # Engines whose boxes this update read (``GET /mooncake/placement`` in full): none when
    # the coordinator held the plan for what every worker reported without them.
    described: list[str] = field(default_factory=list)
    # A delta generation (``generations.chain``): the engines that took it in place, the
    # delta bytes they read, and the bytes rebuilt from the chain for the full path.
    delta: list[str] = field(default_factory=list)
    delta_refused: dict[str, str] = field(default_factory=dict)
    """Targets that took a delta generation whole, and why (at another generation, a
    parameter processed after loading, a shard no checksum covers alone, compat mode)."""
    delta_bytes: int = 0
    realized_bytes: int = 0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def absorb(self, wave: UpdateResult) -> None:
        """Add one wave of a rolling update (same model and generation) to this result."""
        self.waves += 1
        for name, seconds in wave.phase_seconds.items():
            self.phase_seconds[name] = round(self.phase_seconds.get(name, 0.0) + seconds, 4)
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(wave, name))
        for name in _MERGED:
            getattr(self, name).update(getattr(wave, name))
        for name in ("skipped", "committed", "rebuild", "described", "delta"):
            getattr(self, name).extend(getattr(wave, name))
        self.session = wave.session or self.session
        self.error = wave.error or self.error


_SUMMED = (
    "store_read_bytes",
    "store_reread_bytes",
    "pushed_bytes",
    "planned_read_bytes",
    "planned_pushed_bytes",
    "unique_demand_bytes",
    "cross_node_pushed_bytes",
    "in_place_bytes",
    "staged_bytes",
    "delta_bytes",
    "realized_bytes",
)
_MERGED = (
    "received_bytes",
    "fallback_bytes",
    "node_nic_bytes",
    "verified",
    "failed",
    "failure_codes",
    "legs",
    "rotation",
    "landing",
    "staging",
    "delta_refused",
)


class UpdateFailed(MooncakeRLError):
    def __init__(self, result: UpdateResult) -> None:
        self.result = result
        super().__init__(result.error or "update failed")


class ReadmitFailed(MooncakeRLError):
    """The engines synced, but some could not be put back in the router's rotation: they
    serve the new generation and receive no traffic until re-added (``mooncake-rl router
    add``)."""

    def __init__(self, result: UpdateResult, stuck: Mapping[str, str]) -> None:
        self.result = result
        self.stuck = dict(stuck)
        result.error = "synced but out of rotation: " + "; ".join(
            f"{url}: {why}" for url, why in sorted(stuck.items())
        )
        super().__init__(result.error)


def left_out(result: UpdateResult, failed: Mapping[str, EngineRequestFailed]) -> None:
    """Report the engines whose call failed in ``result.failed`` and ``failure_codes``."""
    result.failed.update({url: str(error) for url, error in failed.items()})
    result.failure_codes.update(
        {
            url: error.code or ("unreachable" if error.status == 0 else f"http_{error.status}")
            for url, error in failed.items()
        }
    )


def require_enough(result: UpdateResult, members: Sequence[str], needed: int, step: str) -> None:
    """Raise unless ``members`` plus the engines already serving reach ``needed``."""
    if len(members) + len(result.skipped) >= needed:
        return
    result.error = (
        f"{step}: only {len(members) + len(result.skipped)} of {len(result.engines)} engines "
        f"can serve generation {result.generation}, {needed} needed (--min-engines); "
        + "; ".join(result.failed.values())
    )
    raise UpdateFailed(result)


def planned(result: UpdateResult, plan: UpdatePlan) -> None:
    """Record what ``plan`` (the Store transport's) reads, pushes and delivers."""
    result.planned_read_bytes = plan.store_read_bytes
    result.planned_pushed_bytes = plan.pushed_bytes
    result.unique_demand_bytes = plan.unique_demand_bytes
    result.cross_node_pushed_bytes = plan.routing.cross_node_pushed_bytes
    result.received_bytes = plan.routing.received_bytes()
    result.fallback_bytes = plan.routing.fallback_bytes()
    result.node_nic_bytes = dict(plan.routing.node_nic_bytes)
