"""What is checked before any engine leaves rotation or drains: versions and waves (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.protocol import PROTOCOL_VERSION


class VersionSkew(ConfigurationError):
    """An engine runs a plugin whose ``/mooncake/*`` contract differs from this package's."""


def require_compatible(statuses: Mapping[str, Mapping[str, Any] | None]) -> None:
    """Refuse engines whose status reports another protocol version, or none (``None``: the
    engine has no ``/mooncake/*`` routes at all)."""
    skewed = []
    for url, status in sorted(statuses.items()):
        if status is None:
            skewed.append(f"{url} has no /mooncake routes (plugin not loaded)")
        elif status.get("protocol") != PROTOCOL_VERSION:
            skewed.append(
                f"{url} speaks protocol {status.get('protocol')!r} "
                f"(plugin {status.get('plugin_version', 'unknown')})"
            )
    if skewed:
        raise VersionSkew(
            f"version skew, no engine was touched: this coordinator speaks protocol "
            f"{PROTOCOL_VERSION}; " + "; ".join(skewed) + ". Install the same mooncake-rl "
            "version on the engines and the coordinator"
        )


def waves(engines: Sequence[str], max_unavailable: int | None) -> list[list[str]]:
    """Engines in groups of at most ``max_unavailable`` (``None``: one group, all at once)."""
    if max_unavailable is None:
        return [list(engines)]
    if not 1 <= max_unavailable <= len(engines):
        raise ConfigurationError(
            f"--max-unavailable must lie in 1..{len(engines)} (the engines given), "
            f"got {max_unavailable}"
        )
    return [list(engines[i : i + max_unavailable]) for i in range(0, len(engines), max_unavailable)]
