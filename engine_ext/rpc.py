"""A deadline on the API process's calls to its worker ranks.

Every worker call waits for a reply from every rank; a rank that hangs (a stuck Transfer
Engine write, a deadlocked collective) would otherwise hold the receiver's lock, and with it
the engine and its update session, forever. ``rpc_timeout_s`` bounds each call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


def timeout_message(method: str, timeout_s: float) -> str:
    return (
        f"worker call {method!r} got no reply from every rank within {timeout_s:g}s "
        "(rpc_timeout_s, env MOONCAKE_RL_RPC_TIMEOUT_S): a rank is hung or far slower than "
        "that; its engine log names it. Raise the setting only for updates that need longer"
    )


async def within(call: Awaitable[T], method: str, timeout_s: float) -> T:
    """``call``'s result, or :class:`TimeoutError` naming the method and the setting."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except TimeoutError as error:
        raise TimeoutError(timeout_message(method, timeout_s)) from error
