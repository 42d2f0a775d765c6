"""The backend's ``engine_kwargs``, checked once when VeRL constructs the engine.

VeRL passes ``checkpoint_engine.engine_kwargs.mooncake_store`` as keyword arguments to every
engine it builds (trainer ranks and rollout ranks alike). Unknown keys are refused so a typo
fails at start-up instead of silently falling back to a default. Store addresses that differ
per node (``node``, ``local_segment``) normally come from ``MOONCAKE_RL_*`` environment
variables, which :class:`~mooncake_rl.settings.Settings` reads; keys given here override them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mooncake_rl.errors import ConfigurationError, InvariantViolation
from mooncake_rl.generations.catalog import publish_format
from mooncake_rl.generations.chain import DEFAULT_DELTA_FRACTION, DeltaPolicy
from mooncake_rl.generations.keys import check_model_name
from mooncake_rl.generations.packing import DEFAULT_PACK_BYTES, check_pack_bytes
from mooncake_rl.metrics import MetricsExport
from mooncake_rl.plan.params import PULLS
from mooncake_rl.protocol import PAUSE_MODES
from mooncake_rl.router import RouterSpec
from mooncake_rl.settings import Settings
from mooncake_rl.transport.modes import (
    TransportMode,
    parse_gpu_ids,
    require_store_path,
    resolve_mode,
)

MODES = ("compat", "direct")
DRAIN_MODES = PAUSE_MODES


def _items(value: Any) -> list[str]:
    """A list (or OmegaConf ListConfig) of strings, or one comma-separated string."""
    items: Iterable[Any] = value.split(",") if isinstance(value, str) else value
    return [str(item).strip() for item in items if str(item).strip()]


def _urls(value: Any) -> tuple[str, ...]:
    """A list (or OmegaConf ListConfig) of URLs, or one comma-separated string."""
    urls = tuple(url.rstrip("/") for url in _items(value))
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigurationError(f"engine URL {url!r} must start with http:// or https://")
    return urls


@dataclass(frozen=True)
class BridgeConfig:
    """What the backend needs besides VeRL's own ``bucket_size`` and ``is_master``."""

    model: str
    master: str | None = None
    metadata: str | None = None
    protocol: str | None = None
    hostname: str | None = None
    node: str | None = None
    local_segment: str | None = None
    dtype: str = "bfloat16"
    mode: str = "compat"
    engine_urls: tuple[str, ...] = ()
    token: str | None = None
    timeout_s: float = 600.0
    replica_num: int = 1
    """Copies of every published object (Mooncake ``replica_num``), each in another segment."""
    pack_bytes: int = DEFAULT_PACK_BYTES
    """Size of the Store objects small tensors are packed into (``mooncake-rl publish
    --pack-bytes``; docs/generations.md, "Packed objects")."""
    delta_every: int | None = None
    """Publish each generation as a delta against the previous one (only what changed),
    with a full keyframe at least every this many (``mooncake-rl publish --delta-every``;
    docs/delta.md); ``None``: every generation full."""
    delta_max_fraction: float = DEFAULT_DELTA_FRACTION
    """A keyframe once the chain's deltas would weigh over this fraction of a full one."""
    keep: int | None = 2
    """Generations retention keeps after each announce (plus the active and leased ones);
    ``None``: no retention at announce (run ``mooncake-rl gc`` instead)."""
    retire_grace_s: float | None = None
    """How long retention spares a generation after it stopped being active (default
    ``MOONCAKE_RL_RETIRE_GRACE_S``, 10 s): engines that read the old record meanwhile still
    find its objects."""
    min_engines: int | None = None
    """Engines that must end on each new generation (default all); the rest are reported and
    catch up from the Store when they restart."""
    session_ttl_s: float = 30.0
    """How long engines stay held when the trainer stops renewing an update session."""
    batch_bytes: int | None = None
    """Bytes per pipeline batch of each update's plan (default ``MOONCAKE_RL_BATCH_BYTES``);
    every engine worker's staging watermark must hold two."""
    drain_mode: str = "abort"
    """How an engine's in-flight requests fare when it pauses to land an update: ``abort``,
    ``wait`` or ``keep`` (frozen, then resumed on the new weights). Engines VeRL's manager
    already aborted have none left."""
    pull: str = "single"
    """``single`` reads each published byte from the Store once for the fleet; ``node`` once
    per rollout node (``mooncake-rl update --pull``), for trainers with NIC headroom."""
    transport: str | None = None
    """store, broadcast, cpu_serialize or auto (default: ``MOONCAKE_RL_TRANSPORT``, store)."""
    train_gpus: tuple[str, ...] = ()
    """The train pool's GPU ids where trainer ranks cannot report CUDA UUIDs (CPU runs)."""
    router: str | None = None
    """The request router in front of the engines (``mooncake-rl update --router``)."""
    router_kind: str = "vllm"
    max_unavailable: int | None = None
    """Rolling updates: engines out of rotation at a time (default all at once)."""
    metrics_textfile: str | None = None
    """A node-exporter textfile (``*.prom``) rollout rank 0 rewrites after every update with
    the ``mooncake_rl_update_*`` metrics (docs/metrics.md)."""

    def delta_policy(self) -> DeltaPolicy | None:
        """The publishers' delta policy (checked), or None: every generation full."""
        if self.delta_every is None:
            return None
        return DeltaPolicy(self.delta_every, self.delta_max_fraction)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> BridgeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigurationError(
                f"unknown mooncake_store engine_kwargs {unknown}; known: {sorted(known)}"
            )
        if not kwargs.get("model"):
            raise ConfigurationError(
                "mooncake_store needs engine_kwargs.mooncake_store.model (the Store model name)"
            )
        values = dict(kwargs)
        values["engine_urls"] = _urls(values.get("engine_urls") or ())
        values["train_gpus"] = parse_gpu_ids(
            _items(values.get("train_gpus") or ()), "engine_kwargs.mooncake_store.train_gpus"
        )
        if values.get("transport") is not None:
            values["transport"] = resolve_mode(str(values["transport"])).value
        config = cls(**values)
        try:
            check_model_name(config.model)
            publish_format(config.dtype)
            check_pack_bytes(config.pack_bytes)
            config.delta_policy()
        except InvariantViolation as error:
            raise ConfigurationError(str(error)) from error
        if config.mode not in MODES:
            raise ConfigurationError(f"mode must be one of {MODES}, got {config.mode!r}")
        if config.timeout_s <= 0:
            raise ConfigurationError("timeout_s must be positive")
        if type(config.replica_num) is not int or config.replica_num < 1:
            raise ConfigurationError(
                f"replica_num must be an integer >= 1, got {config.replica_num!r}"
            )
        if config.keep is not None and (type(config.keep) is not int or config.keep < 1):
            raise ConfigurationError(
                f"keep must be an integer >= 1 (or unset: no retention), got {config.keep!r}"
            )
        if config.retire_grace_s is not None and (
            type(config.retire_grace_s) not in (int, float) or config.retire_grace_s < 0
        ):
            raise ConfigurationError(
                f"retire_grace_s must be a number of seconds >= 0, got {config.retire_grace_s!r}"
            )
        if config.drain_mode not in DRAIN_MODES:
            raise ConfigurationError(
                f"drain_mode must be one of {DRAIN_MODES}, got {config.drain_mode!r}"
            )
        if config.pull not in PULLS:
            raise ConfigurationError(f"pull must be one of {PULLS}, got {config.pull!r}")
        if config.transport is not None:  # unset: the coordinator checks the environment's
            require_store_path(TransportMode(config.transport), config.mode, config.pull, "{}")
        if config.batch_bytes is not None and (
            type(config.batch_bytes) is not int or config.batch_bytes < 1
        ):
            raise ConfigurationError(
                f"batch_bytes must be a positive integer (or unset: MOONCAKE_RL_BATCH_BYTES), "
                f"got {config.batch_bytes!r}"
            )
        if config.min_engines is not None and (
            type(config.min_engines) is not int or config.min_engines < 1
        ):
            raise ConfigurationError(
                f"min_engines must be an integer >= 1 (or unset: all), got {config.min_engines!r}"
            )
        if config.router is not None:
            RouterSpec(config.router, config.router_kind)  # type: ignore[arg-type]
        if config.max_unavailable is not None and (
            type(config.max_unavailable) is not int or config.max_unavailable < 1
        ):
            raise ConfigurationError(
                f"max_unavailable must be an integer >= 1 (or unset: all at once), got "
                f"{config.max_unavailable!r}"
            )
        if not 1 <= config.session_ttl_s <= 3600:
            raise ConfigurationError(
                f"session_ttl_s must lie in 1..3600 seconds, got {config.session_ttl_s!r}"
            )
        config.metrics_export()
        return config

    def metrics_export(self) -> MetricsExport:
        textfile = self.metrics_textfile
        return MetricsExport(textfile=Path(textfile) if textfile is not None else None)

    def router_spec(self) -> RouterSpec | None:
        """The router, with the key of its worker API from ``MOONCAKE_RL_ROUTER_API_KEY``
        (as ``mooncake-rl update --router`` takes it): a secret stays out of the config."""
        if self.router is None:
            return None
        key = self.settings().router_api_key
        return RouterSpec(
            self.router,
            self.router_kind,  # type: ignore[arg-type]
            token=key.get_secret_value() if key is not None else None,
            timeout_s=self.timeout_s,
        )

    def settings(self) -> Settings:
        """Store client settings: environment first, these keys on top; lends no memory.

        Trainer and rollout-side clients are short-lived next to the Store, so they lend
        nothing; trainer ranks prefer their node's segment holder (``local_segment``).
        """
        try:
            return Settings().with_overrides(
                master=self.master,
                metadata=self.metadata,
                protocol=self.protocol,
                hostname=self.hostname,
                node=self.node,
                local_segment=self.local_segment,
                auth_token=self.token,
                batch_bytes=self.batch_bytes,
                retire_grace_s=self.retire_grace_s,
                segment_bytes=0,
            )
        except ValidationError as error:
            raise ConfigurationError(f"invalid Store settings: {error}") from error
