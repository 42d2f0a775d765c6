"""The broadcast sender: reads a generation from the Store once and broadcasts it.

It is rank 0 of the broadcast group and hosts the group's TCP store. The CLI's coordinator
runs it as a child process (``python -m mooncake_rl.transport.sender SPEC_JSON``), so that a
wedged sender can be killed, and so that its port claim can stay held exactly as long as the
process (and with it the TCP store) is alive. The child exits when its parent dies: an
orphaned sender would keep a live TCP store under a claim nobody renews.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from mooncake_rl.errors import MooncakeRLError
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.group import BroadcastGroup, GroupSpec, backend_for, sender_device
from mooncake_rl.transport.source import Source, read_buckets


class SenderFailed(MooncakeRLError):
    """The broadcast sender exited without sending the whole generation."""


@dataclass(frozen=True)
class SenderSpec:
    """What to send and where: the generation (by its manifest digest) and the group."""

    source: Source
    host: str
    port: int
    world_size: int
    group_name: str
    timeout_s: float
    device: str = "cpu"

    def group(self) -> GroupSpec:
        return GroupSpec(
            self.host,
            self.port,
            self.world_size,
            0,
            self.group_name,
            backend_for(torch.device(self.device)),
            self.timeout_s,
        )


def send(spec: SenderSpec, settings: Settings) -> dict[str, Any]:
    """Broadcast every bucket of the generation to the group; returns byte and time figures."""
    started = time.perf_counter()
    device = torch.device(spec.device)
    if device.type == "cuda" and device.index is None:  # the sending process's own GPU
        device = torch.device("cuda", torch.cuda.current_device())
    # The group first: once its TCP store is up, any failure of this process (the Store
    # unreachable, an object missing) closes the receivers' connections and fails them at
    # once, instead of leaving them to wait out the group timeout.
    group = BroadcastGroup(spec.group(), settings.hostname)
    joined = time.perf_counter()
    try:
        with StoreClient(settings.with_overrides(segment_bytes=0)) as store:
            layout, buckets = read_buckets(store, spec.source)
            for bucket, tensors in buckets:
                staged = torch.empty(bucket.nbytes, dtype=torch.uint8)
                for tensor in layout.bucket_tensors(bucket):
                    start = tensor.offset - bucket.start
                    raw = tensors[tensor.name].reshape(-1).view(torch.uint8)
                    staged[start : start + tensor.nbytes].copy_(raw)
                group.broadcast(staged.to(device))
    except BaseException:
        group.abort()
        raise
    group.close()
    return {
        "sent_bytes": layout.total_bytes,
        "read_bytes": sum(t.nbytes for t in layout.tensors),
        "buckets": len(layout.buckets),
        "join_seconds": joined - started,
        "seconds": time.perf_counter() - started,
    }


class Sender(Protocol):
    """A running sender: ``future`` resolves when it is done (its teardown acknowledged)."""

    future: Future[dict[str, Any]]

    def alive(self) -> bool:
        """Whether it may still host the group's TCP store (its port claim stays held)."""
        ...

    def kill(self) -> None: ...


class SenderLauncher(Protocol):
    """Where the sender runs: a child of the coordinator, or a trainer rank."""

    @property
    def host(self) -> str:
        """The address the sender's TCP store listens at (receivers dial it)."""
        ...

    def device(self, receivers_on_cuda: bool) -> str:
        """The device it sends from (NCCL when CUDA, gloo otherwise)."""
        ...

    def start(self, spec: SenderSpec) -> Sender: ...


@dataclass(frozen=True)
class ChildLauncher:
    """The CLI's sender: a child process of the coordinator, sending from a train-pool GPU
    of this host when the receivers are on CUDA."""

    settings: Settings
    train_pool: tuple[str, ...]

    @property
    def host(self) -> str:
        return self.settings.hostname

    def device(self, receivers_on_cuda: bool) -> str:
        local = sender_device(self.train_pool)
        return str(local) if receivers_on_cuda and local is not None else "cpu"

    def start(self, spec: SenderSpec) -> Sender:
        return SenderProcess(spec, self.settings.client_env())


class SenderProcess:
    """The sender as a child process; ``future`` resolves when it exits."""

    def __init__(self, spec: SenderSpec, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self._process = subprocess.Popen(
            [sys.executable, "-m", "mooncake_rl.transport.sender", json.dumps(asdict(spec))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
            text=True,
        )
        self.future: Future[dict[str, Any]] = Future()
        threading.Thread(target=self._wait, name="sender-wait", daemon=True).start()

    def _wait(self) -> None:
        out, err = self._process.communicate()
        if self._process.returncode == 0:
            self.future.set_result(json.loads(out.strip().splitlines()[-1]))
        else:
            self.future.set_exception(
                SenderFailed(
                    f"broadcast sender exited with status {self._process.returncode}: "
                    f"{err.strip()[-2000:]}"
                )
            )

    def alive(self) -> bool:
        return self._process.poll() is None

    def kill(self) -> None:
        """Stop a wedged sender; its TCP store dies with it."""
        if self.alive():
            self._process.kill()
        self._process.wait()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m mooncake_rl.transport.sender SPEC_JSON", file=sys.stderr)
        return 2
    try:
        fields = json.loads(argv[0])
        spec = SenderSpec(**{**fields, "source": Source(**fields["source"])})
    except (ValueError, TypeError) as error:
        print(f"malformed sender spec: {error}", file=sys.stderr)
        return 2
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    try:
        report = send(spec, Settings())
    except (MooncakeRLError, RuntimeError) as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
