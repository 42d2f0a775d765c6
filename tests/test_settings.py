from __future__ import annotations

import pytest
from pydantic import ValidationError

from mooncake_rl.settings import Settings


def test_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "MOONCAKE_RL_MASTER": "10.1.2.3:50051",
        "MOONCAKE_RL_METADATA": "http://10.1.2.3:8080/metadata",
        "MOONCAKE_RL_PROTOCOL": "rdma",
        "MOONCAKE_RL_HOSTNAME": "10.1.2.4",
        "MOONCAKE_RL_NODE": "rack1-node7",
        "MOONCAKE_RL_AUTH_TOKEN": "s3cret",
    }.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert (settings.master, settings.protocol, settings.node) == (
        "10.1.2.3:50051",
        "rdma",
        "rack1-node7",
    )
    assert settings.metadata == "http://10.1.2.3:8080/metadata"
    assert settings.hostname == "10.1.2.4"
    assert settings.auth_token is not None and settings.auth_token.get_secret_value() == "s3cret"


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_RL_NODE", "from-env")
    settings = Settings().with_overrides(node="from-flag", master=None)
    assert settings.node == "from-flag"
    assert settings.master == Settings().master


@pytest.mark.parametrize(
    "field,value",
    [
        ("master", "no-port"),
        ("master", "host:99999"),
        ("protocol", "udp"),
        ("segment_bytes", -1),
        ("rpc_timeout_s", 0),
    ],
)
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError):
        Settings(**{field: value})


def test_a_batch_is_not_checked_against_the_same_clients_watermark() -> None:
    """The batch is the coordinator's and the watermark the engine's: the coordinator checks
    the plan's batch against each engine's reported watermark (tests/test_batch_bytes.py)."""
    settings = Settings(batch_bytes=512 << 20, staging_watermark_bytes=12 << 20)
    assert (settings.batch_bytes, settings.staging_watermark_bytes) == (512 << 20, 12 << 20)


def test_rpc_timeout_defaults_to_ten_minutes_and_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().rpc_timeout_s == 600.0
    monkeypatch.setenv("MOONCAKE_RL_RPC_TIMEOUT_S", "42.5")
    assert Settings().rpc_timeout_s == 42.5
