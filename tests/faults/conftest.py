"""The faults' shared fixture (their own master and named segment holders), and the update
fault matrix's table after a run that produced one (``make faults``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import TABLE
from tests.faults.test_master_and_holder_loss import Services


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    """A master and segment holders of their own, stopped at the end whatever happened."""
    running = Services(tmp_path)
    try:
        yield running
    finally:
        running.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TABLE:
        return
    terminalreporter.section("update fault matrix")
    terminalreporter.write_line(
        f"| {'scenario':<34} | {'outcome':<58} | {'recovered (s)':>13} | {'bound (s)':>9} |"
    )
    terminalreporter.write_line(f"|{'-' * 36}|{'-' * 60}|{'-' * 15}:|{'-' * 10}:|")
    for scenario, outcome, seconds, bound in TABLE:
        terminalreporter.write_line(
            f"| {scenario:<34} | {outcome:<58} | {seconds:>13.2f} | {bound:>9.0f} |"
        )
