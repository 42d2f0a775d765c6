"""The deadline on worker calls (``rpc_timeout_s``): a hung rank must not hold the receiver."""

from __future__ import annotations

import asyncio

import pytest

from engine_ext.rpc import timeout_message, within


async def answer(after_s: float, value: object) -> object:
    await asyncio.sleep(after_s)
    return value


async def fail(after_s: float) -> None:
    await asyncio.sleep(after_s)
    raise RuntimeError("rank 1: TransferFailed")


def test_a_reply_in_time_is_returned() -> None:
    assert asyncio.run(within(answer(0.01, ["ok"]), "status", 5.0)) == ["ok"]


def test_a_call_past_the_deadline_names_the_method_and_the_setting() -> None:
    with pytest.raises(TimeoutError) as raised:
        asyncio.run(within(answer(5.0, None), "apply", 0.05))
    assert str(raised.value) == timeout_message("apply", 0.05)
    assert str(raised.value).startswith(
        "worker call 'apply' got no reply from every rank within 0.05s"
    )
    assert "rpc_timeout_s, env MOONCAKE_RL_RPC_TIMEOUT_S" in str(raised.value)


def test_a_failure_in_time_is_not_a_timeout() -> None:
    with pytest.raises(RuntimeError, match="rank 1: TransferFailed"):
        asyncio.run(within(fail(0.01), "apply", 5.0))
