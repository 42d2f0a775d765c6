"""Transport selection at the command line: invalid values fail at start, listing the valid."""

from __future__ import annotations

import pytest

from mooncake_rl.cli import main

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
