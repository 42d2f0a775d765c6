"""The NCCL-broadcast shape on this machine: one rank broadcasts every tensor with gloo.

Real worker processes form a ``torch.distributed`` gloo group over loopback; rank 0 holds
the model and broadcasts each tensor to all other ranks, which keep the full model (as
NCCL-broadcast weight-update transports do). Receivers prove they got the right bytes with
a digest of everything they hold.

NIC accounting follows what gloo actually does: ``gloo::broadcast`` is a binomial tree
(round ``i``: every virtual rank ``v < 2**i`` sends to ``v + 2**i``), reproduced
exactly by :func:`binomial_tree_sends`; a send costs its sender's node the full tensor when
the receiver is on another node. A ring (what NCCL uses for broadcast) would cost every
node but the last at most one model; that figure is reported next to gloo's.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bench.common import synthetic_model
from mooncake_rl.services import free_port


def binomial_tree_sends(world: int, root: int = 0) -> tuple[tuple[int, int], ...]:
    """(sender, receiver) rank pairs of ``gloo::broadcast`` (gloo/broadcast.cc), in order."""
    if world < 1 or not 0 <= root < world:
        raise ValueError(f"bad broadcast group: world {world}, root {root}")
    sends = []
    for bit in range((world - 1).bit_length()):  # gloo's log2ceil(world) rounds
        for vrank in range(1 << bit):  # round ``bit``: ranks below 2**bit hold the data
            vpeer = vrank | (1 << bit)
            if vpeer < world:
                sends.append(((vrank + root) % world, (vpeer + root) % world))
    return tuple(sends)


def broadcast_accounting(nodes_by_rank: Sequence[str], model_bytes: int) -> dict[str, Any]:
    """Bytes each node's ranks send to other nodes, for gloo's tree and for a ring."""
    nodes = sorted(set(nodes_by_rank))
    tree = dict.fromkeys(nodes, 0)
    sends = binomial_tree_sends(len(nodes_by_rank))
    for sender, receiver in sends:
        if nodes_by_rank[sender] != nodes_by_rank[receiver]:
            tree[nodes_by_rank[sender]] += model_bytes
    ring = dict.fromkeys(nodes, 0)
    for sender, receiver in itertools.pairwise(nodes_by_rank):
        if sender != receiver:
            ring[sender] += model_bytes
    return {
        "pushed_bytes": len(sends) * model_bytes,
        "node_nic_bytes": tree,
        "max_node_nic_bytes": max(tree.values()),
        "ring_node_nic_bytes": ring,
        "ring_max_node_nic_bytes": max(ring.values()),
    }


def _digest(tensors: Sequence[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.contiguous().view(-1).view(torch.int16).numpy().data)
    return digest.hexdigest()


def _rank(
    rank: int,
    world: int,
    port: int,
    total_bytes: int,
    tensors: int,
    shapes: Sequence[tuple[int, ...]],
    timeout_s: float,
    out: Any,
) -> None:
    try:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        if rank == 0:
            held = [t for _, t in synthetic_model(total_bytes, tensors)]
        else:
            held = [torch.empty(shape, dtype=torch.bfloat16) for shape in shapes]
        dist.barrier()
        started = time.perf_counter()
        for tensor in held:
            dist.broadcast(tensor, src=0)
        dist.barrier()
        seconds = time.perf_counter() - started
        received = 0 if rank == 0 else sum(t.numel() * t.element_size() for t in held)
        out.put((rank, "ok", {"seconds": seconds, "received": received, "digest": _digest(held)}))
    except BaseException as error:  # report every failure to the parent, which reaps us
        out.put((rank, "error", f"{type(error).__name__}: {error}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_broadcast(
    nodes_by_rank: Sequence[str],
    total_bytes: int,
    tensors: int,
    shapes: Sequence[tuple[int, ...]],
    timeout_s: float = 600,
) -> dict[str, Any]:
    """Rank 0 broadcasts ``synthetic_model(total_bytes, tensors)`` to every other rank.

    One spawned process per rank; every process is joined, or killed, before returning.
    """
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    world = len(nodes_by_rank)
    processes = [
        context.Process(
            target=_rank,
            args=(rank, world, port, total_bytes, tensors, tuple(shapes), timeout_s, out),
        )
        for rank in range(world)
    ]
    try:
        for process in processes:
            process.start()
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < world:
            try:
                rank, status, value = out.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty as error:
                raise RuntimeError(f"broadcast ranks silent after {timeout_s}s") from error
            if status != "ok":
                raise RuntimeError(f"broadcast rank {rank} failed: {value}")
            results[rank] = value
    finally:
        for process in processes:
            if process.pid is None:  # never started
                continue
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    digests = {r["digest"] for r in results.values()}
    if len(digests) != 1:
        raise RuntimeError("broadcast receivers hold different bytes than the sender")
    return {
        "seconds": max(r["seconds"] for r in results.values()),
        "received_bytes": sum(r["received"] for r in results.values()),
    }
