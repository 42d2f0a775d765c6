"""Child processes of the Store's services: started in their own group, stopped always.

    ManagedProcess.spawn (own process group, SIGTERM if the parent dies) --wait_until-->
    ready (or its log named) ... stop (SIGTERM, then SIGKILL, the whole group)

Foreground commands stop on SIGTERM/SIGINT through :class:`StopSignals` and
:func:`serve_until_stopped`: the signal handler only records the signal, and the main thread
stops the children outside it, so neither a failed test nor a killed CLI leaves one behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Self

from mooncake_rl.errors import ConfigurationError, ServiceError

SYSTEM_LIBRARIES = ("libibverbs.so.1", "librdmacm.so.1", "libnuma.so.1")
INSTALL_HINT = "apt-get install -y libibverbs1 librdmacm1 libnuma1"


def free_ports(count: int, host: str = "127.0.0.1") -> tuple[int, ...]:
    """``count`` distinct TCP ports nobody listens on right now (the kernel picks them).

    Every socket stays bound until all are picked. The kernel picks each port at random
    from about 14,000, so three picked one after another repeat one for about 1 master
    start in 5,000, and that master then dies binding it.
    """
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return tuple(int(sock.getsockname()[1]) for sock in sockets)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    return free_ports(1, host)[0]


def master_binary() -> Path:
    """The ``mooncake_master`` shipped in the Mooncake wheel, else one on ``PATH``."""
    try:
        import mooncake
    except ImportError as error:  # pragma: no cover - exercised only without the wheel
        raise ConfigurationError(
            "the Mooncake wheel is not installed: pip install mooncake-transfer-engine-non-cuda"
        ) from error
    shipped = Path(mooncake.__file__).parent / "mooncake_master"
    found = shipped if shipped.exists() else shutil.which("mooncake_master")
    if found is None:
        raise ConfigurationError("mooncake_master not found in the Mooncake wheel or on PATH")
    binary = Path(found)
    if not os.access(binary, os.X_OK):
        raise ConfigurationError(f"{binary} is not executable: chmod +x {binary}")
    return binary


def missing_system_libraries() -> list[str]:
    """Libraries Mooncake's native code links against that the loader cannot find."""
    missing = []
    for name in SYSTEM_LIBRARIES:
        try:
            ctypes.CDLL(name)
        except OSError:
            missing.append(name)
    return missing


def check_system_libraries() -> None:
    missing = missing_system_libraries()
    if missing:
        raise ConfigurationError(
            f"Mooncake needs {', '.join(missing)} even for TCP; install them: {INSTALL_HINT}"
        )


def _die_with_parent() -> None:
    """Runs in the child before exec: its own process group, SIGTERM when the parent dies.

    A process group, not a new session: Linux gives every session its own scheduling
    autogroup, and a group's CPU share is split across cores by where its load runs. A
    pinned engine rank in a session whose load sits on other cores then gets almost no time
    on its own core beside another session's busy pinned worker (seen as a TP rank runnable
    but starved for tens of seconds mid-update). Children share the caller's session, so
    threads compete one to one.
    """
    os.setpgid(0, 0)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class ManagedProcess:
    """A child in its own process group that dies with its parent; ``stop`` always reaps.

    Construct it, keep the reference, then :meth:`spawn` inside the ``try`` whose handler
    calls ``stop``: whatever fails after the fork, the child is recorded here and reaped.
    """

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.returncode: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        if self._process is not None or self.returncode is not None:
            raise ServiceError(f"{self.args[0]} already spawned")
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
                env=self.env,
            )

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Poll ``ready``; raise :class:`Stopped` once a stop signal was recorded."""
        wait_for(ready, what, timeout_s, [self])

    def poll(self) -> int | None:
        """The exit code once the child has exited (it is then reaped), else ``None``."""
        return self._process.poll() if self._process is not None else self.returncode

    def wait(self, timeout_s: float | None = None) -> int:
        """Poll until the child exits; ``TimeoutError`` after ``timeout_s``.

        Polling instead of a blocking ``Popen.wait`` means this frame never sits inside
        ``waitpid`` holding subprocess's waitpid lock, so nothing that interrupts it (a signal
        handler, another thread) can deadlock on that lock while reaping the same child.
        """
        process = self._process
        if process is None:
            raise ServiceError("process not started")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (code := process.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"pid {process.pid} still running after {timeout_s}s")
            time.sleep(0.05)
        return code

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the process group; escalate to SIGKILL; always reap.

        Every wait here is bounded, so a stop can never hang on a child or on the waitpid lock.
        """
        process = self._process
        if process is None:
            return
        try:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            raise ServiceError(
                f"pid {process.pid} survived SIGKILL for {timeout_s}s; see {self.log_path}"
            ) from error
        finally:
            if process.returncode is not None:
                self.returncode, self._process = process.returncode, None


def wait_for(
    ready: Callable[[], bool], what: str, timeout_s: float, needed: Sequence[ManagedProcess]
) -> None:
    """Poll ``ready`` while every ``needed`` child runs; :class:`Stopped` on a stop signal."""
    deadline = time.monotonic() + timeout_s
    logs = ", ".join(str(process.log_path) for process in needed)
    while time.monotonic() < deadline:
        StopSignals.raise_if_stopped()
        for process in needed:
            if not process.is_running():
                raise ServiceError(
                    f"{what}: {process.args[0]} exited early; see {process.log_path}"
                )
        if ready():
            return
        time.sleep(0.05)
    raise ServiceError(f"{what} not healthy after {timeout_s}s; see {logs}")


def accepts_connections(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


def service_log_dir(configured: Path | None) -> Path:
    directory = configured or Path(os.environ.get("TMPDIR", "/tmp"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class Lifecycle:
    """``with`` starts what is not started yet and always stops it: the one context-manager
    shape of every embedded service and of the durable Store made of them."""

    @property
    def started(self) -> bool:
        raise NotImplementedError

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self if self.started else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


class Service(Lifecycle):
    """One embedded service: a managed child process."""

    name = "service"
    _process: ManagedProcess | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def is_running(self) -> bool:
        return self._process is not None and self._process.is_running()

    def poll(self) -> int | None:
        """The child's exit code if it exited on its own, ``None`` while it runs."""
        if self._process is None:
            raise ServiceError("service not started")
        return self._process.poll()

    @property
    def log_path(self) -> Path | None:
        return self._process.log_path if self._process is not None else None

    def wait(self, timeout_s: float | None = None) -> int:
        if self._process is None:
            raise ServiceError("service not started")
        return self._process.wait(timeout_s)

    @property
    def started(self) -> bool:
        return self._process is not None

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.stop()


class Stopped(BaseException):
    """A stop signal arrived while services were still starting (like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGTERM and SIGINT as a flag that ordinary code polls.

    The handler never raises or stops anything: a Python handler runs on the main thread
    between any two bytecodes, for example inside ``Popen`` between fork and exec (the child
    is then lost, unkilled and unreaped) or inside a ``Popen.wait`` that holds subprocess's
    waitpid lock (stopping children from there deadlocked ``mooncake-rl master``, issue 14).
    It records the signal; a start in progress sees it in :meth:`ManagedProcess.wait_until`,
    which raises :class:`Stopped` so the caller's ``with`` blocks stop what did start, and a
    running service sees it in :func:`serve_until_stopped`.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    _recorded: int | None = None
    """The signal recorded by the active instance (there is one per process: the CLI's)."""

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}

    @property
    def signum(self) -> int | None:
        return StopSignals._recorded

    @staticmethod
    def _handle(signum: int, frame: FrameType | None) -> None:
        StopSignals._recorded = signum

    @staticmethod
    def raise_if_stopped() -> None:
        if StopSignals._recorded is not None:
            raise Stopped(StopSignals._recorded)

    def __enter__(self) -> Self:
        StopSignals._recorded = None
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        StopSignals._recorded = None
        return exc_type is Stopped  # a stop during startup is a clean stop


def serve_until_stopped(
    services: Sequence[Service],
    stop: StopSignals,
    poll_s: float = 0.1,
    tick: Callable[[], None] | None = None,
) -> int:
    """Keep services in the foreground until a stop signal (returns 0).

    Polls with a short sleep instead of blocking in ``waitpid``, so a signal is seen within
    ``poll_s`` and the caller stops the services in ordinary code. A service that exits on its
    own raises :class:`ServiceError` naming its log; the caller's ``with`` stops the others.
    ``tick`` runs every poll (a durable Store replaces its dead masters there).
    """
    while stop.signum is None:
        if tick is not None:
            tick()
        for service in services:
            code = service.poll()
            if code is not None:
                raise ServiceError(
                    f"{service.name} exited with code {code}; see {service.log_path}"
                )
        time.sleep(poll_s)
    return 0
