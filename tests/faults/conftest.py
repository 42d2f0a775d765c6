"""Prints the update fault matrix's table after a run that produced one (``make faults``)."""

from __future__ import annotations

import pytest

from tests.faults.harness import TABLE


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
