"""Transport selection at the command line: invalid values fail at start, listing the valid."""

from __future__ import annotations

import pytest

from mooncake_rl.cli import build_parser, main

UPDATE = ["update", "--name", "m", "--engine", "http://127.0.0.1:9"]


def test_an_invalid_transport_flag_lists_the_valid_ones(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*UPDATE, "--transport", "nccl"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "invalid choice: 'nccl'" in error
    assert "'store', 'broadcast', 'cpu_serialize', 'auto'" in error


def test_an_invalid_transport_variable_fails_before_anything_is_touched(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOONCAKE_RL_TRANSPORT", "nccl")
    assert main(UPDATE) == 2
    error = capsys.readouterr().err
    assert "invalid MOONCAKE_RL_* setting" in error and "transport" in error
    assert "'store', 'broadcast', 'cpu_serialize' or 'auto'" in error


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_bound_on_calls_in_flight_fails_at_start(
    value: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*UPDATE, "--max-connections", value])
    assert exited.value.code == 2
    assert "--max-connections" in capsys.readouterr().err


def test_the_bound_on_calls_in_flight_defaults_to_none() -> None:
    assert build_parser().parse_args(UPDATE).max_connections is None
    assert build_parser().parse_args([*UPDATE, "--max-connections", "64"]).max_connections == 64
