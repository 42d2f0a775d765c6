"""Progress of long CLI work, always on stderr so stdout (``--json``) stays machine-clean.

On a terminal a rich progress bar; otherwise (logs, CI, pipes) one plain line per step and
per tenth of a byte total, so a log shows where a run got to without redraw noise.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal, Protocol, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


class Steps(Protocol):
    def step(self, text: str) -> None:
        """The previous step is done; ``text`` names the one now running."""

    def advance(self, amount: int) -> None:
        """``amount`` more bytes of the total are done (``unit="bytes"``)."""


@contextmanager
def progress(
    description: str,
    total: int | None = None,
    unit: Literal["steps", "bytes"] = "steps",
    stream: TextIO | None = None,
) -> Iterator[Steps]:
    """One piece of work: ``total`` steps (each :meth:`Steps.step` ends the previous one)
    or bytes (counted by :meth:`Steps.advance`); ``None`` when not known up front."""
    out = stream or sys.stderr
    plain = _Plain(description, total, unit, out)
    if not out.isatty():
        yield plain
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn(f"[bold]{description}[/] {{task.description}}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=Console(file=out),
    ) as bar:
        task = bar.add_task("", total=total)
        yield _Rich(bar, task, unit)
        bar.update(task, completed=total or plain.done, description="done")


class _Rich:
    def __init__(self, bar: Progress, task: TaskID, unit: str) -> None:
        self.bar, self.task, self.unit = bar, task, unit
        self.started = False

    def step(self, text: str) -> None:
        ended = 1 if self.unit == "steps" and self.started else 0
        self.started = True
        self.bar.update(self.task, description=text, advance=ended)

    def advance(self, amount: int) -> None:
        self.bar.advance(self.task, amount)


class _Plain:
    def __init__(self, description: str, total: int | None, unit: str, out: TextIO) -> None:
        self.description, self.total, self.unit, self.out = description, total, unit, out
        self.done = 0
        self.shown_tenths = 0
        self.started = time.monotonic()

    def _line(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"{self.description}: {text} ({elapsed:.1f}s)", file=self.out, flush=True)

    def step(self, text: str) -> None:
        self._line(text)

    def advance(self, amount: int) -> None:
        self.done += amount
        if not self.total:
            return
        tenths = min(10, self.done * 10 // self.total)
        if tenths > self.shown_tenths:
            self.shown_tenths = tenths
            self._line(f"{tenths * 10}% of {self.total:,} {self.unit}")
