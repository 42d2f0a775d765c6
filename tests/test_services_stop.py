"""``mooncake-rl master`` and ``mooncake-rl holder`` stop cleanly on SIGTERM/SIGINT (issue 14).

The real CLI runs as a subprocess. While a test runs, pytest is a child subreaper, so a child
the CLI failed to reap is reparented to pytest instead of vanishing into init: leftovers are
then visible (running or zombie) and are killed and reaped in ``finally``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from mooncake_rl.errors import StoreFull
from mooncake_rl.services import EmbeddedMaster, ManagedProcess, MasterConfig, free_port
from mooncake_rl.store import StoreClient
from tests.conftest import settings_for

PR_SET_CHILD_SUBREAPER = 36
STOP_WITHIN_S = 8.0


@contextlib.contextmanager
def subreaper() -> Iterator[list[psutil.Process]]:
    """Adopt orphans while the block runs; kill and reap the recorded processes after it."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    tracked: list[psutil.Process] = []
    try:
        yield tracked
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for process in tracked:
            with contextlib.suppress(psutil.Error):
                process.kill()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(process.pid, 0)


def start_cli(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mooncake_rl.cli", *args],
        stdout=subprocess.PIPE,
        stderr=log.open("wb"),
        text=True,
        env={**os.environ, **(env or {})},
    )


def first_json_line(cli: subprocess.Popen, log: Path, timeout_s: float = 60.0) -> dict[str, Any]:
    """The JSON line a foreground command prints once its services are up."""
    assert cli.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(cli.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            raise AssertionError(f"no JSON line after {timeout_s}s: {log.read_text()}")
    line = cli.stdout.readline()
    assert line, f"exited with {cli.wait()} before printing: {log.read_text()}"
    return json.loads(line)


def stop_and_check(
    cli: subprocess.Popen, signum: int, children: list[psutil.Process], log: Path
) -> None:
    """Signal the CLI: it exits 0 within seconds and none of its children is left, not even
    as a zombie."""
    started = time.monotonic()
    cli.send_signal(signum)
    code = cli.wait(timeout=STOP_WITHIN_S + 10)
    took = time.monotonic() - started
    assert code == 0, f"exit code {code}: {log.read_text()}"
    assert took < STOP_WITHIN_S, f"took {took:.1f}s to stop"
    left = [p for p in children if p.is_running()]
    assert not left, [(p.pid, p.status()) for p in left]


def cli_children(cli: subprocess.Popen, expected: int) -> list[psutil.Process]:
    children = psutil.Process(cli.pid).children(recursive=True)
    names = sorted(p.name() for p in children)
    assert len(children) == expected, names
    return children


PLAIN = ["master", "--plain", "--port", "0", "--metadata-port", "0"]


@pytest.mark.parametrize(
    "args,signum,expected",
    [
        ([*PLAIN, "--segment-bytes", str(64 << 20)], signal.SIGINT, 2),
        ([*PLAIN, "--segment-bytes", "0"], signal.SIGTERM, 1),
        (["master", "--segment-bytes", str(64 << 20)], signal.SIGTERM, 4),
    ],
    ids=["with-holder-sigint", "no-holder-sigterm", "durable-sigterm"],
)
def test_master_stops_with_its_holder(
    tmp_path: Path, args: list[str], signum: int, expected: int
) -> None:
    """The durable Store's children: etcd, two masters and the holder."""
    log = tmp_path / "cli.log"
    segment_bytes = int(args[-1])
    with subreaper() as tracked:
        cli = start_cli(args, log, {"TMPDIR": str(tmp_path)})
        try:
            line = first_json_line(cli, log)
            tracked.extend(cli_children(cli, expected))
            assert line["pid"] in {p.pid for p in tracked}
            assert ("MOONCAKE_RL_LOCAL_SEGMENT" in line) == (segment_bytes > 0)
            stop_and_check(cli, signum, tracked, log)
        finally:
            cli.kill()
            cli.wait()


def test_master_exits_when_its_master_dies(tmp_path: Path) -> None:
    """A service that dies on its own ends the command with an error; the holder stops too."""
    log = tmp_path / "cli.log"
    args = [*PLAIN, "--segment-bytes", str(64 << 20)]
    with subreaper() as tracked:
        cli = start_cli(args, log, {"TMPDIR": str(tmp_path)})
        try:
            line = first_json_line(cli, log)
            tracked.extend(cli_children(cli, 2))
            os.kill(line["pid"], signal.SIGKILL)
            assert cli.wait(timeout=STOP_WITHIN_S + 10) == 2
            assert "mooncake_master exited with code -9" in log.read_text()
            assert not [p for p in tracked if p.is_running()]
        finally:
            cli.kill()
            cli.wait()


def test_durable_master_replaces_a_killed_master_and_cleans_up(tmp_path: Path) -> None:
    """The durable Store outlives its leader: a fresh standby takes the dead one's place, and
    a stop leaves no child and no etcd data directory behind."""
    log = tmp_path / "cli.log"
    with subreaper() as tracked:
        cli = start_cli(
            ["master", "--segment-bytes", str(64 << 20)], log, {"TMPDIR": str(tmp_path)}
        )
        try:
            line = first_json_line(cli, log)
            assert line["MOONCAKE_RL_MASTER"].startswith("etcd://")
            assert line["pid"] in line["masters"] and len(line["masters"]) == 2
            tracked.extend(cli_children(cli, 4))
            os.kill(line["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 20
            while "started in its place" not in log.read_text():
                assert time.monotonic() < deadline and cli.poll() is None, log.read_text()
                time.sleep(0.1)
            tracked.extend(cli_children(cli, 4))
            assert list(tmp_path.glob("mooncake-rl-etcd-*"))
            stop_and_check(cli, signal.SIGTERM, tracked, log)
            assert not list(tmp_path.glob("mooncake-rl-etcd-*"))
        finally:
            cli.kill()
            cli.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_holder_lends_memory_to_an_external_master_and_stops(tmp_path: Path, signum: int) -> None:
    log = tmp_path / "cli.log"
    config = MasterConfig(lease_ttl_ms=500, log_dir=tmp_path)
    with EmbeddedMaster(config) as master, subreaper() as tracked:
        reader = settings_for(master, "no-memory", segment_bytes=0)
        with StoreClient(reader) as store, pytest.raises(StoreFull, match="mooncake-rl holder"):
            store.put_bytes("holder/before", b"x" * 4096)

        env = {
            "MOONCAKE_RL_MASTER": master.master_address,
            "MOONCAKE_RL_METADATA": master.metadata_url,
            "TMPDIR": str(tmp_path),
        }
        cli = start_cli(["holder", "--segment-bytes", str(32 << 20)], log, env)
        try:
            line = first_json_line(cli, log)
            tracked.extend(cli_children(cli, 1))
            assert line["pid"] == tracked[0].pid and tracked[0].name() == "mooncake_client"
            assert line["segment"] == line["MOONCAKE_RL_LOCAL_SEGMENT"]
            assert line["segment_bytes"] == 32 << 20
            writer = settings_for(master, "writer", segment_bytes=0, local_segment=line["segment"])
            with StoreClient(writer) as store:
                store.put_bytes("holder/after", b"y" * 4096)
                assert store.get_bytes("holder/after") == b"y" * 4096
            stop_and_check(cli, signum, tracked, log)
        finally:
            cli.kill()
            cli.wait()


def test_holder_refuses_a_non_positive_size(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mooncake_rl.cli", "holder", "--segment-bytes", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--segment-bytes must be positive" in done.stderr


def test_holder_stops_while_still_starting(tmp_path: Path) -> None:
    """A stop signal during a start that cannot finish (no master) is a clean stop too."""
    log = tmp_path / "cli.log"
    env = {
        "MOONCAKE_RL_MASTER": f"127.0.0.1:{free_port()}",
        "MOONCAKE_RL_METADATA": f"http://127.0.0.1:{free_port()}/metadata",
        "TMPDIR": str(tmp_path),
    }
    with subreaper() as tracked:
        cli = start_cli(["holder", "--segment-bytes", str(32 << 20)], log, env)
        try:
            deadline = time.monotonic() + 30
            while not (children := psutil.Process(cli.pid).children(recursive=True)):
                assert time.monotonic() < deadline and cli.poll() is None, log.read_text()
                time.sleep(0.05)
            tracked.extend(children)
            stop_and_check(cli, signal.SIGTERM, tracked, log)
        finally:
            cli.kill()
            cli.wait()


def _autogroup(pid: int) -> str | None:
    """The scheduling autogroup's name, or None where the kernel does not expose one."""
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()
    except OSError:
        return None
    return fields[0] if fields else None


def test_a_managed_child_leads_its_own_group_in_the_callers_session(tmp_path: Path) -> None:
    """Its own process group (``stop`` signals the whole group) but the caller's session,
    so the kernel's per-session scheduling autogroup is shared: a pinned engine rank in a
    session of its own was starved on its core by another engine's busy pinned worker."""
    child = ManagedProcess(["sleep", "60"], tmp_path / "sleep.log")
    try:
        child.spawn()
        pid = child.pid
        assert pid is not None
        assert os.getpgid(pid) == pid != os.getpgid(0)
        assert os.getsid(pid) == os.getsid(0)
        # The shared session is what matters; where the kernel exposes autogroups (some
        # sandboxes give an empty file), check the consequence too.
        childs, mine = _autogroup(pid), _autogroup(os.getpid())
        if childs is not None and mine is not None:
            assert childs == mine
    finally:
        child.stop()
    assert not child.is_running()
