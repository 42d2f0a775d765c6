"""Transports beside the Store path: how an update reaches each engine.

Selection (:func:`resolve_mode`), classification of target engines into broadcast and
CPU-serialized legs from their declared GPUs (:func:`classify`), the broadcast group's rank
cursor (:func:`broadcast_group`) and rendezvous port claims in the Store
(:class:`PortClaims`). Everything here but the claims is pure and runs before any engine is
drained; the engine-side receive lives in ``engine_ext/``.
"""

from mooncake_rl.transport.claims import (
    Claim,
    ClaimRecord,
    KeyClaims,
    NoFreePort,
    PortClaim,
    PortClaims,
    port_key,
)
from mooncake_rl.transport.cursor import GroupLayout, broadcast_group
from mooncake_rl.transport.modes import TransportMode, parse_gpu_ids, resolve_mode
from mooncake_rl.transport.topology import (
    Classification,
    MixedTransportInvalid,
    TopologyError,
    classify,
    require_mixed,
    require_mixed_ran,
)

__all__ = [
    "Claim",
    "ClaimRecord",
    "Classification",
    "GroupLayout",
    "KeyClaims",
    "MixedTransportInvalid",
    "NoFreePort",
    "PortClaim",
    "PortClaims",
    "TopologyError",
    "TransportMode",
    "broadcast_group",
    "classify",
    "parse_gpu_ids",
    "port_key",
    "require_mixed",
    "require_mixed_ran",
    "resolve_mode",
]
