"""Which bearer tokens guard ``/mooncake/*``, decided once at engine startup.

The routes drain, rewrite and break a serving engine, so an engine whose HTTP server is
reachable beyond this host must not serve them open by accident: without a token it refuses
to start unless the operator says ``MOONCAKE_RL_INSECURE=1``. The engine's own API key
(vLLM's and SGLang's ``--api-key``) counts as a token, so a server already guarded by one
needs nothing more; ``MOONCAKE_RL_AUTH_TOKEN``, when set, is the only token the routes take.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.settings import Settings


def is_loopback(host: str | None) -> bool:
    """True only for addresses nothing off this host can reach.

    ``None``, ``""``, ``0.0.0.0`` and ``::`` bind every interface; a host name other than
    ``localhost`` may resolve anywhere, so it counts as reachable.
    """
    if not host:
        return False
    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def route_tokens(
    host: str | None, settings_token: str | None, api_keys: Sequence[str], insecure: bool
) -> tuple[str, ...]:
    """The tokens any one of which opens the routes; ``()`` leaves them open.

    ``settings_token`` (``MOONCAKE_RL_AUTH_TOKEN``) wins over the engine's ``api_keys``;
    empty strings count as unset. Raises :class:`ConfigurationError` when the routes would
    be open on an address other hosts reach and ``insecure`` does not allow it.
    """
    if settings_token:
        return (settings_token,)
    tokens = tuple(key for key in api_keys if key)
    if tokens or insecure or is_loopback(host):
        return tokens
    where = f"{host!r}" if host else "all interfaces"
    raise ConfigurationError(
        f"refusing to serve /mooncake/* without a token: the engine's HTTP server binds "
        f"{where}, which other hosts can reach, and these routes drain and rewrite the "
        "engine. Set MOONCAKE_RL_AUTH_TOKEN (or give the engine --api-key), bind a loopback "
        "--host, or set MOONCAKE_RL_INSECURE=1 to accept an open route"
    )


def guard_tokens(
    host: str | None,
    settings: Settings,
    api_keys: Sequence[str],
    *,
    tls: bool,
    log: logging.Logger,
) -> tuple[str, ...]:
    """:func:`route_tokens` for an engine adapter, warning on ``log`` (one the engine's log
    shows) what the choice exposes."""
    secret = settings.auth_token.get_secret_value() if settings.auth_token else None
    tokens = route_tokens(host, secret, api_keys, settings.insecure)
    if not is_loopback(host):
        if not tokens:
            log.warning("mooncake: /mooncake/* open on %s (MOONCAKE_RL_INSECURE=1)", host)
        elif not tls:
            log.warning(
                "mooncake: the /mooncake/* bearer token crosses plain HTTP on %s; "
                "use TLS or a private network",
                host,
            )
    return tokens
