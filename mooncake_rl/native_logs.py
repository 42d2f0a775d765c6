"""Mooncake's native log on a healthy run: kept, but off the terminal unless asked for.

Mooncake logs through glog to stderr and never initializes glog, so glog's own file and
threshold flags do nothing. Setting up a client logs normal steps at E and W level (the
first lookup of its own segment answers "metadata not found" before the segment is
published), which a newcomer reads as failures. So a client's setup runs with the level
``MC_LOG_LEVEL`` (read at setup) from ``MOONCAKE_RL_LOG_LEVEL``, and, below ``info``, with
the process's stderr pointed at ``mooncake-native.log`` in the log directory: what it logs
is kept there, not shown. After setup, native lines at that level or above reach stderr
again (a real failure must be seen).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from mooncake_rl.settings import Settings

_SETUP = threading.Lock()
"""The environment and fd 2 are process-wide: two setups at once could each restore the
other's file or level, leaving them in place for good."""

MC_LEVELS = {"debug": "INFO", "info": "INFO", "warning": "WARNING", "error": "ERROR"}
"""``MOONCAKE_RL_LOG_LEVEL`` -> Mooncake's ``MC_LOG_LEVEL`` (it has no DEBUG)."""


def native_log_path(settings: Settings) -> Path:
    directory = settings.log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory / "mooncake-native.log"


@contextlib.contextmanager
def native_setup(settings: Settings) -> Iterator[None]:
    """Run a native client's setup at the configured level, its log kept in a file unless
    the level is ``info`` or ``debug``. The caller's ``MC_LOG_LEVEL`` wins if it set one."""
    with _SETUP:
        level = os.environ.get("MC_LOG_LEVEL") or MC_LEVELS[settings.log_level]
        with _environment("MC_LOG_LEVEL", level):
            if settings.log_level in ("debug", "info"):
                yield
                return
            with native_stderr_to(native_log_path(settings)):
                yield


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``name=value`` for the block only: children started later (a master, whose readiness
    is read from its INFO lines) must not inherit it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def native_stderr_to(path: Path) -> Iterator[None]:
    """File descriptor 2 appends to ``path`` for the block (native code writes to the fd,
    not to ``sys.stderr``); restored even if the block raises."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with path.open("ab") as log:
            os.dup2(log.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
