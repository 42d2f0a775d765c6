"""Typed errors. Every failure names either the Mooncake error code or the violated invariant.

Mooncake's Python bindings return negative integers instead of raising; the Store and TE
wrappers turn them into :class:`MooncakeError` subclasses so callers can catch exactly the
condition they handle (for example a missing object) and let everything else propagate.
"""

from __future__ import annotations

from typing import ClassVar

# Names from mooncake-store/include/types.h (ErrorCode). The Python bindings expose only ints.
MOONCAKE_ERROR_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -2: "NOT_IMPLEMENTED",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
    -1700: "TENANT_QUOTA_EXCEEDED",
}


class MooncakeRLError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigurationError(MooncakeRLError):
    """Settings or environment that cannot work (missing binary, bad address, ...)."""


class ServiceError(MooncakeRLError):
    """An embedded service could not be started, or stopped being healthy."""


class InvariantViolation(MooncakeRLError):
    """A plan, manifest or request breaks one of the project's invariants."""


class FailoverAmbiguous(MooncakeRLError):
    """A non-idempotent Store call cut by a master failover whose outcome cannot be read."""


class EtcdOutOfSpace(MooncakeRLError):
    """A durable Store's etcd reached its quota (NOSPACE alarm): the masters can no longer
    log changes, yet Mooncake still answers puts with success, so a failover would lose them."""


class MooncakeError(MooncakeRLError):
    """A negative return code from Mooncake Store or Transfer Engine."""

    code: int
    name: str
    operation: str
    context: str
    codes: ClassVar[tuple[int, ...]] = ()
    hint: ClassVar[str] = ""
    """What the user can do about it, appended to the message (Mooncake's codes are terse)."""

    def __init__(self, code: int, operation: str, context: str = "") -> None:
        self.code = code
        self.name = MOONCAKE_ERROR_NAMES.get(code, "UNKNOWN_ERROR")
        self.operation = operation
        self.context = context
        where = f" [{context}]" if context else ""
        hint = f": {self.hint}" if self.hint else ""
        super().__init__(f"{self.name} ({code}) in {operation}{where}{hint}")


class ObjectNotFound(MooncakeError):
    codes = (-704,)


class ObjectAlreadyExists(MooncakeError):
    codes = (-705,)


class ObjectHasLease(MooncakeError):
    codes = (-706,)


class LeaseExpired(MooncakeError):
    codes = (-707,)


class StoreFull(MooncakeError):
    """The Store had no space for an allocation (NO_AVAILABLE_HANDLE).

    Seen first by new users: a bare ``mooncake_master`` has no memory, and CLI commands lend
    none, so every put fails with this code until someone mounts a segment. Say so.
    """

    codes = (-200,)
    hint = (
        "no mounted segment has room for this object, or no segment is mounted at all "
        "(the master holds no memory and `mooncake-rl` commands lend none); lend memory with "
        "`mooncake-rl holder --segment-bytes N` (or `mooncake-rl master --segment-bytes N`), "
        "or, in a long-lived library client that lends its own, raise MOONCAKE_RL_SEGMENT_BYTES"
    )


class InvalidParams(MooncakeError):
    codes = (-600,)


class TransferFailed(MooncakeError):
    """A Store transfer or a Transfer Engine write did not complete."""

    codes = (-800, -500, -1)


class RpcFailed(MooncakeError):
    codes = (-900, -901)


class NotLogged(MooncakeError):
    """UNAVAILABLE_IN_CURRENT_STATUS: seen here as a durable master's answer to a remove it
    could not log because etcd refused the write (out of space); the object is then gone
    from this leader only and returns after a failover."""

    codes = (-1010,)
    hint = (
        "a durable Store's master could not log this change in etcd: `mooncake-rl status` "
        "says whether etcd is out of space (docs/etcd-growth.md)"
    )


_BY_CODE: dict[int, type[MooncakeError]] = {
    code: cls
    for cls in (
        ObjectNotFound,
        ObjectAlreadyExists,
        ObjectHasLease,
        LeaseExpired,
        StoreFull,
        InvalidParams,
        TransferFailed,
        RpcFailed,
        NotLogged,
    )
    for code in cls.codes
}


def mooncake_error(code: int, operation: str, context: str = "") -> MooncakeError:
    """Build the most specific :class:`MooncakeError` for a negative return code."""
    if code >= 0:
        raise ValueError(f"not an error code: {code}")
    return _BY_CODE.get(code, MooncakeError)(code, operation, context)
