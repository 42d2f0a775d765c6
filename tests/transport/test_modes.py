"""Transport selection and GPU id parsing: flag, environment, default, and refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.transport import TransportMode, parse_gpu_ids, resolve_mode

VALID = "valid: store, broadcast, cpu_serialize, auto"


def test_default_is_the_store_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_RL_TRANSPORT", raising=False)
    assert resolve_mode(None) is TransportMode.STORE


@pytest.mark.parametrize("value", ["store", "broadcast", "cpu_serialize", "auto"])
def test_each_valid_value(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_mode(value) is TransportMode(value)
    monkeypatch.setenv("MOONCAKE_RL_TRANSPORT", value)
    assert resolve_mode(None) is TransportMode(value)


def test_flag_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_RL_TRANSPORT", "auto")
    assert resolve_mode("broadcast") is TransportMode.BROADCAST


@pytest.mark.parametrize("value", ["nccl", "Auto", "", " store"])
def test_invalid_value_lists_the_valid_ones(value: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        resolve_mode(value)
    assert str(raised.value) == f"unknown transport {value!r}; {VALID}"


def test_invalid_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_RL_TRANSPORT", "nccl")
    with pytest.raises(ConfigurationError) as raised:
        resolve_mode(None)
    assert str(raised.value) == f"unknown transport 'nccl' in MOONCAKE_RL_TRANSPORT; {VALID}"


def test_other_invalid_settings_are_not_blamed_on_transport(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MOONCAKE_RL_MASTER", "no-port")
    with pytest.raises(ValidationError, match="master must be host:port"):
        resolve_mode(None)


def test_gpu_ids_parse_in_order() -> None:
    uuid = "GPU-6f1c2d3e-0a1b-4c5d-9e8f-123456789abc"
    assert parse_gpu_ids(f" {uuid} , host0:3,h.1_x", "train") == (uuid, "host0:3", "h.1_x")
    assert parse_gpu_ids(["g1", " g0 "], "engine") == ("g1", "g0")
    assert parse_gpu_ids("", "train") == ()
    assert parse_gpu_ids("  ", "train") == ()
    assert parse_gpu_ids([], "train") == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("g0,,g1", "MOONCAKE_RL_GPU_IDS: empty GPU id in 'g0,,g1'"),
        ("g0,", "MOONCAKE_RL_GPU_IDS: empty GPU id in 'g0,'"),
        ("g0,g 1", "MOONCAKE_RL_GPU_IDS: bad GPU id 'g 1'"),
        ("g0,gpu/1", "MOONCAKE_RL_GPU_IDS: bad GPU id 'gpu/1'"),
        ("x" * 129, f"MOONCAKE_RL_GPU_IDS: bad GPU id '{'x' * 129}'"),
        ("g0,g1,g0", "MOONCAKE_RL_GPU_IDS: GPU id 'g0' is listed twice"),
    ],
)
def test_bad_gpu_ids_name_the_setting_and_the_item(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        parse_gpu_ids(text, "MOONCAKE_RL_GPU_IDS")
    assert str(raised.value).startswith(message)
