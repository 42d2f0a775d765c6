"""The broadcast sender: reads a generation from the Store once and broadcasts it.

It is rank 0 of the broadcast group and hosts the group's TCP store. The CLI's coordinator
runs it as a child process (``python -m mooncake_rl.transport.sender SPEC_JSON``), so that a
wedged sender can be killed, and so that its port claim can stay held exactly as long as the
process (and with it the TCP store) is alive. The child exits when its parent dies: an
orphaned sender would keep a live TCP store under a claim nobody renews. It keeps its group
and sends one generation per request line: a coordinator keeps it per engine set
(:class:`SenderKeeper`), since a new process and group cost seconds per update.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TextIO

import torch

from mooncake_rl.errors import InvariantViolation, MooncakeRLError
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.buckets import read_shm, unpack
from mooncake_rl.transport.claims import PortClaim
from mooncake_rl.transport.group import BroadcastGroup, GroupSpec, backend_for, sender_device
from mooncake_rl.transport.layout import Bucket, ReceiveLayout
from mooncake_rl.transport.source import Source, read_buckets

TEARDOWN_S = 30.0
"""How long the sender may take to tear its group down after the last bucket."""


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
    fed: bool = False
    """The coordinator feeds the buckets it read for its CPU leg (shared memory on its host,
    see :func:`fed_buckets`) instead of this sender reading the Store again."""

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


def _device(spec: SenderSpec) -> torch.device:
    device = torch.device(spec.device)
    if device.type == "cuda" and device.index is None:  # the sending process's own GPU
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Feed(Protocol):
    """A fed sender's end of the coordinator's CPU leg (:attr:`SenderSpec.fed`): each
    bucket the coordinator read is offered as a shared-memory file, and answered once read,
    so the coordinator can remove it."""

    def offered(self) -> object:
        """The next offer, ``{"index", "shm"}`` (anything else is refused)."""
        ...

    def taken(self, index: int) -> None: ...


@dataclass(frozen=True)
class PipedFeed:
    """The child sender's feed: offers are lines on its stdin, answers lines on its stdout."""

    requests: TextIO
    replies: TextIO

    def offered(self) -> object:
        return json.loads(self.requests.readline() or "null")

    def taken(self, index: int) -> None:
        print(json.dumps({"taken": index}), file=self.replies, flush=True)


def fed_buckets(
    layout: ReceiveLayout, feed: Feed
) -> Iterator[tuple[Bucket, dict[str, torch.Tensor]]]:
    """The buckets the coordinator read (and checked) for its CPU leg, in order; each file
    is answered as soon as it is read."""
    for bucket in layout.buckets:
        offer = feed.offered()
        if not isinstance(offer, dict) or offer.get("index") != bucket.index:
            raise SenderFailed(f"expected bucket {bucket.index} from the coordinator, got {offer}")
        data = read_shm(offer["shm"])
        feed.taken(bucket.index)
        yield bucket, unpack(data, layout, bucket)


def broadcast_generation(
    group: BroadcastGroup,
    store: StoreClient,
    source: Source,
    device: torch.device,
    fed: Feed | None = None,
) -> dict[str, Any]:
    """Broadcast every bucket of ``source`` to the group, then wait for every member's last
    byte (the returned figures acknowledge it). ``fed``: where the coordinator offers the
    buckets it read, when it feeds them (:func:`fed_buckets`)."""
    started = time.perf_counter()
    layout, buckets = read_buckets(store, source)
    if fed is not None:
        buckets = fed_buckets(layout, fed)
    for bucket, tensors in buckets:
        staged = torch.empty(bucket.nbytes, dtype=torch.uint8)
        for tensor in layout.bucket_tensors(bucket):
            start = tensor.offset - bucket.start
            raw = tensors[tensor.name].reshape(-1).view(torch.uint8)
            staged[start : start + tensor.nbytes].copy_(raw)
        group.broadcast(staged.to(device))
    group.barrier()
    return {
        "sent_bytes": layout.total_bytes,
        "read_bytes": 0 if fed is not None else sum(t.nbytes for t in layout.tensors),
        "buckets": len(layout.buckets),
        "seconds": time.perf_counter() - started,
    }


def send(spec: SenderSpec, settings: Settings, fed: Feed | None = None) -> dict[str, Any]:
    """Form the group, broadcast the generation once, drop the group; byte and time
    figures. ``fed``: where the buckets are offered, for a fed spec."""
    started = time.perf_counter()
    # The group first: once its TCP store is up, any failure of this process (the Store
    # unreachable, an object missing) closes the receivers' connections and fails them at
    # once, instead of leaving them to wait out the group timeout.
    group = BroadcastGroup(spec.group(), settings.hostname)
    joined = time.perf_counter()
    try:
        with StoreClient(settings.with_overrides(segment_bytes=0)) as store:
            report = broadcast_generation(group, store, spec.source, _device(spec), fed)
    finally:
        group.abort()
    return {**report, "join_seconds": joined - started, "seconds": time.perf_counter() - started}


class Sender(Protocol):
    """A running sender: ``future`` resolves with this update's report (every member's last
    byte acknowledged); ``ended`` once its TCP store is gone, which frees its port."""

    future: Future[dict[str, Any]]
    ended: Future[Any]

    def alive(self) -> bool:
        """Whether it may still host the group's TCP store (its port claim stays held)."""
        ...

    def offer(self, index: int, shm: str) -> Future[None]:
        """Feed bucket ``index`` (a shared-memory file) to a fed sender; resolves once the
        sender read it."""
        ...

    def kill(self) -> None: ...


class SenderLauncher(Protocol):
    """Where the sender runs: a child of the coordinator, or a trainer rank."""

    @property
    def host(self) -> str:
        """The address the sender's TCP store listens at (receivers dial it)."""
        ...

    @property
    def keeper(self) -> SenderKeeper | None:
        """Where senders are kept across updates, or None: one sender per update."""
        ...

    @property
    def same_host(self) -> bool:
        """Whether it shares this host's shared memory (the CPU leg can feed it)."""
        ...

    def device(self, receivers_on_cuda: bool) -> str:
        """The device it sends from (NCCL when CUDA, gloo otherwise)."""
        ...

    def start(self, spec: SenderSpec) -> Sender: ...


@dataclass(frozen=True)
class GroupKey:
    """What a kept group was formed for; any change (an engine joins, leaves or restarts,
    another TP size, another sending device) needs a new group."""

    members: tuple[tuple[str, tuple[str, ...]], ...]
    """Per engine in set order: its URL and the process of each of its ranks."""
    per_engine: int
    device: str

    def __post_init__(self) -> None:
        if not self.members or self.per_engine < 1:
            raise InvariantViolation(f"a broadcast group of no receivers: {self}")


@dataclass(frozen=True)
class KeptSender:
    """A sender kept for its engine set, with the claim on its port."""

    key: GroupKey
    sender: SenderProcess
    claim: PortClaim
    name: str

    def end(self) -> None:
        """Stop the sender (the members drop the group when they next join another) and
        free its port once its TCP store is gone."""
        self.sender.kill()
        self.claim.release_after(self.sender.ended, teardown_timeout_s=TEARDOWN_S)


KEPT_SENDERS = 8
"""Senders a coordinator keeps at most (engines keep as many groups; the oldest goes)."""


class SenderKeeper:
    """A coordinator's senders, one per engine set, kept across its updates: a new sender
    process and group cost seconds per update (a new interpreter, imports, the group's
    rendezvous), as much as the bytes of a model of hundreds of MB."""

    def __init__(self) -> None:
        self._kept: OrderedDict[GroupKey, KeptSender] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: GroupKey) -> KeptSender | None:
        """The live sender kept for ``key``, which the caller now owns; senders whose group
        holds an engine process that ``key`` does not (it restarted) are ended."""
        processes = dict(key.members)
        with self._lock:
            kept = self._kept.pop(key, None)
            stale = [
                k
                for k in self._kept
                if any(u in processes and processes[u] != p for u, p in k.members)
            ]
            ended = [self._kept.pop(k) for k in stale]
        for other in ended:
            other.end()
        if kept is not None and not kept.sender.alive():
            kept.end()
            return None
        return kept

    def keep(self, kept: KeptSender) -> None:
        with self._lock:
            self._kept[kept.key] = kept
            ended = [
                self._kept.popitem(last=False)[1] for _ in range(len(self._kept) - KEPT_SENDERS)
            ]
        for oldest in ended:
            oldest.end()

    def close(self) -> None:
        """End every kept sender (the coordinator is closing)."""
        with self._lock:
            ended, self._kept = list(self._kept.values()), OrderedDict()
        for kept in ended:
            kept.end()


@dataclass(frozen=True)
class ChildLauncher:
    """The CLI's sender: a child process of the coordinator, sending from a train-pool GPU
    of this host when the receivers are on CUDA; kept by ``keeper`` across updates."""

    settings: Settings
    train_pool: tuple[str, ...]
    keeper: SenderKeeper | None = None
    same_host: bool = True

    @property
    def host(self) -> str:
        return self.settings.hostname

    def device(self, receivers_on_cuda: bool) -> str:
        local = sender_device(self.train_pool)
        return str(local) if receivers_on_cuda and local is not None else "cpu"

    def start(self, spec: SenderSpec) -> SenderProcess:
        return SenderProcess(spec, self.settings.client_env())


class SenderProcess:
    """The sender as a child process that keeps its group: it sends ``spec.source`` at
    once, then one more generation per :meth:`send`. ``future`` resolves with the current
    update's report; ``ended`` when the process exits."""

    def __init__(self, spec: SenderSpec, env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self._process = subprocess.Popen(
            [sys.executable, "-m", "mooncake_rl.transport.sender", json.dumps(asdict(spec))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
            text=True,
        )
        self.future: Future[dict[str, Any]] = Future()
        self.ended: Future[int] = Future()
        self._taken: dict[int, Future[None]] = {}
        self._lock = threading.Lock()
        self._writing = threading.Lock()
        threading.Thread(target=self._read, name="sender-read", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def _read(self) -> None:
        assert self._process.stdout is not None and self._process.stderr is not None
        for line in self._process.stdout:
            reply = json.loads(line)
            with self._lock:
                if "taken" in reply:
                    self._taken.pop(reply["taken"]).set_result(None)
                else:
                    self.future.set_result(reply["report"])
        err = self._process.stderr.read()
        code = self._process.wait()
        with self._lock:
            failure = SenderFailed(f"broadcast sender exited with status {code}: {err[-2000:]}")
            if not self.future.done():
                self.future.set_exception(failure)
            for taken in self._taken.values():
                taken.set_exception(failure)
            self._taken.clear()
            self.ended.set_result(code)

    def send(self, source: Source, fed: bool) -> None:
        """Broadcast another generation over the kept group; ``future`` is its report.
        ``fed``: its buckets come through :meth:`offer`."""
        with self._lock:
            if not self.future.done():
                raise InvariantViolation("the previous generation is still being sent")
            self.future = Future()
            if self.ended.done():
                self.future.set_exception(SenderFailed("the broadcast sender has exited"))
                return
        self._write({"source": asdict(source), "fed": fed})

    def offer(self, index: int, shm: str) -> Future[None]:
        """Feed bucket ``index`` (a shared-memory file); resolves once the sender read it."""
        taken: Future[None] = Future()
        with self._lock:
            if self.ended.done():
                taken.set_exception(SenderFailed("the broadcast sender has exited"))
                return taken
            self._taken[index] = taken
        self._write({"index": index, "shm": shm})
        return taken

    def _write(self, request: dict[str, Any]) -> None:
        assert self._process.stdin is not None
        try:
            with self._writing:
                self._process.stdin.write(json.dumps(request) + "\n")
                self._process.stdin.flush()
        except OSError:
            self.kill()  # its exit fails what waits on it

    def alive(self) -> bool:
        return self._process.poll() is None

    def kill(self) -> None:
        """Stop the sender; its TCP store dies with it."""
        if self.alive():
            self._process.kill()
        self._process.wait()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)


def serve(spec: SenderSpec, settings: Settings, requests: TextIO, replies: TextIO) -> None:
    """The child's loop: form the group, send ``spec.source``, then each generation named on
    ``requests`` (a ``{"source", "fed"}`` line each) over the same group, a ``{"report"}``
    line each; ends at the end of ``requests``. Raises (the group dropped) on the first
    failure."""
    started = time.perf_counter()
    group = BroadcastGroup(spec.group(), settings.hostname)
    joined = {"join_seconds": time.perf_counter() - started}
    try:
        with StoreClient(settings.with_overrides(segment_bytes=0)) as store:
            request: dict[str, Any] | None = {"source": asdict(spec.source), "fed": spec.fed}
            while request is not None:
                source = Source(**request["source"])
                fed = PipedFeed(requests, replies) if request["fed"] else None
                report = broadcast_generation(group, store, source, _device(spec), fed)
                print(json.dumps({"report": {**report, **joined}}), file=replies, flush=True)
                joined = {"join_seconds": 0.0}
                line = requests.readline()
                request = json.loads(line) if line.strip() else None
    finally:
        group.abort()


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
        serve(spec, Settings(), sys.stdin, sys.stdout)
    except (MooncakeRLError, RuntimeError, ValueError, TypeError) as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
