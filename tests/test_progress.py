"""Progress on stderr: a rich bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import io

from mooncake_rl.progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_name_each_step_and_each_tenth_of_the_bytes() -> None:
    log = io.StringIO()
    with progress("publish", 1000, unit="bytes", stream=log) as steps:
        steps.step("reading")
        for _ in range(40):
            steps.advance(25)
    lines = [line.rsplit(" (", 1)[0] for line in log.getvalue().splitlines()]
    assert lines == ["publish: reading"] + [
        f"publish: {tenth}0% of 1,000 bytes" for tenth in range(1, 11)
    ]


def test_a_terminal_gets_a_rich_bar_that_ends_done() -> None:
    terminal = Terminal()
    with progress("update", stream=terminal) as steps:
        steps.step("drain done")
        steps.step("commit done")
    shown = terminal.getvalue()
    assert "update" in shown and "done" in shown
    assert "drain done (" not in shown  # no plain lines on a terminal
