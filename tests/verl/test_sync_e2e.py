"""VeRL weight syncs through ``mooncake_store`` with real verl, Mooncake and vLLM.

The test plays VeRL's ``CheckpointEngineManager.update_weights``: ``prepare`` on every rank,
``build_topology`` in the driver, ``init_process_group``, then trainer ``send_weights`` and
rollout ``receive_weights`` concurrently, then ``finalize``. Trainer ranks are separate
processes in a gloo group on two node labels, each preferring its node's segment holder;
the rollout engine is a live vLLM server started from the Store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("vllm")

from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

from engine_ext.vllm.server import VllmServer
from mooncake_rl.errors import MooncakeRLError
from mooncake_rl.generations import TrainerTopology, assign_publishers, load_manifest
from mooncake_rl.generations.commands import checkpoint_tensors, publish_checkpoint
from mooncake_rl.generations.keys import group_id, payload_key
from mooncake_rl.generations.publisher import PublishFailed
from mooncake_rl.generations.registry import active_generation
from mooncake_rl.services import EmbeddedMaster, free_port
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, hf_greedy, make_tiny_llama, perturbed_copy
from mooncake_rl.transport.rendezvous import slot_key
from tests.conftest import settings_for
from tests.procs import ProcessGroup
from tests.verl.trainer import BUCKET_BYTES, TIMEOUT_S, serve_trainer
from verl_bridge.publish import sync_key

MODEL = "verl-tiny"
TOKEN = "verl-s3cret"
NODES = ("node-a", "node-b")


@dataclass
class Rollout:
    """The rollout side: one live engine and VeRL's rollout-rank checkpoint engine."""

    holders: Any
    dirs: list[Path]
    refs: list[list[int]]
    store: StoreClient
    engine: VllmServer
    backend: Any
    kwargs: dict[str, Any]


@dataclass
class SyncRun:
    sync_id: str
    trainers: list[tuple[str, Any]]
    received: int
    finalize_error: MooncakeRLError | None


@pytest.fixture(scope="module")
def rollout(
    master: EmbeddedMaster, holders, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Rollout]:
    root = tmp_path_factory.mktemp("verl")
    dirs = [make_tiny_llama(root / "g1")]
    dirs += [perturbed_copy(dirs[0], root / f"g{seed + 1}", seed) for seed in (1, 2)]
    refs = [hf_greedy(d) for d in dirs[:2]]
    segments = {node: holders(node).segment for node in NODES}  # one holder per trainer node
    settings = settings_for(master, "rollout", segment_bytes=0, local_segment=segments["node-a"])
    store = StoreClient(settings)
    engine: VllmServer | None = None
    backend: Any = None
    try:
        assert publish_checkpoint(store, MODEL, dirs[0], "float32").generation == 1
        engine = VllmServer(
            dirs[0],
            settings,
            name=MODEL,
            log_dir=root / "logs",
            token=TOKEN,
            extra_env={"MOONCAKE_RL_GPU_IDS": "gpu-rollout-0"},  # declared topology (no CUDA)
            extra_args=["--enforce-eager"],  # half the start; e2e keeps compiled covered
        ).start()
        kwargs = {
            "model": MODEL,
            "master": master.master_address,
            "metadata": master.metadata_url,
            "dtype": "float32",
            "mode": "compat",
            "engine_urls": [engine.url],
            "token": TOKEN,
            "timeout_s": 120.0,
        }
        import_external_libs("verl_bridge.backend")
        # The rollout worker's call shape (CheckpointEngineWorker): no is_master.
        backend = CheckpointEngineRegistry.new("mooncake_store", bucket_size=BUCKET_BYTES, **kwargs)
        yield Rollout(holders, dirs, refs, store, engine, backend, kwargs)
    finally:
        if backend is not None:
            backend.close()
        if engine is not None:
            engine.stop()
        store.close()


class Trainers:
    """Two trainer ranks on two node labels, alive across syncs like VeRL's actor workers."""

    def __init__(self, group: ProcessGroup, world: Rollout) -> None:
        self.group, self.world = group, world
        self.boxes = [(group.queue(), group.queue()) for _ in NODES]
        init_method = f"tcp://127.0.0.1:{free_port()}"
        for rank, (node, (inbox, outbox)) in enumerate(zip(NODES, self.boxes, strict=True)):
            env = {
                "MOONCAKE_RL_NODE": node,
                "MOONCAKE_RL_LOCAL_SEGMENT": world.holders(node).segment,
            }
            group.start(
                serve_trainer, rank, len(NODES), init_method, env, world.kwargs, inbox, outbox
            )
        self.alive = list(range(len(NODES)))

    def sync(self, model_dir: Path, **faults: int) -> SyncRun:
        """One ``update_weights`` as VeRL's manager runs it; ``faults`` hit rank 1."""
        backend, world = CheckpointEngineRegistry.get("mooncake_store"), self.world
        for rank, (inbox, _) in enumerate(self.boxes):
            own = faults if rank == 1 else {}
            inbox.put(("sync", model_dir, own.get("fail_at"), own.get("exit_at")))
        metadata = [outbox.get(timeout=TIMEOUT_S) for _, outbox in self.boxes]
        metadata.append(world.backend.prepare())
        actor_kwargs, rollout_kwargs = backend.build_topology(len(NODES), 1, metadata)
        for rank, (inbox, _) in enumerate(self.boxes):
            inbox.put({key: values[rank] for key, values in actor_kwargs.items()})
        world.backend.init_process_group(**{key: value[0] for key, value in rollout_kwargs.items()})

        async def receive() -> int:
            return len([item async for item in world.backend.receive_weights(global_steps=7)])

        received = asyncio.run(receive())
        if "exit_at" in faults:
            self.alive = [0]
        live = [self.boxes[rank] for rank in self.alive]
        trainers = [outbox.get(timeout=TIMEOUT_S) for _, outbox in live]
        for inbox, _ in live:  # VeRL finalizes trainer and rollout ranks at once
            inbox.put("finalize")
        finalize_error = None
        try:
            world.backend.finalize()
        except MooncakeRLError as error:
            finalize_error = error
        for _, outbox in live:
            assert outbox.get(timeout=TIMEOUT_S) == "finalized"
        return SyncRun(rollout_kwargs["sync_id"][0], trainers, received, finalize_error)

    def stop(self) -> None:
        for rank in self.alive:
            self.boxes[rank][0].put(("stop",))
        if len(self.alive) == len(NODES):
            self.group.results()
        else:
            (rank,) = self.alive
            self.group.results_of(rank)


@pytest.fixture(scope="module")
def trainers(rollout: Rollout) -> Iterator[Trainers]:
    with ProcessGroup() as group:
        made = Trainers(group, rollout)
        yield made
        made.stop()


def stored_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.to(torch.float32).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_trainer_ranks_publish_and_the_engine_switches(
    rollout: Rollout, trainers: Trainers
) -> None:
    assert rollout.engine.complete(PROMPT) == rollout.refs[0]
    run = trainers.sync(rollout.dirs[1])
    assert run.finalize_error is None and run.received == 0
    (status_a, metrics_a), (status_b, metrics_b) = run.trainers
    assert status_a == status_b == "ok" and metrics_a == metrics_b
    tensors = dict(checkpoint_tensors(rollout.dirs[1]))
    assert metrics_a["mooncake_store/generation"] == 2
    assert metrics_a["mooncake_store/tensors"] == len(tensors)
    assert metrics_a["mooncake_store/bytes"] == sum(t.numel() * 4 for t in tensors.values())

    store = rollout.store
    assert active_generation(store, MODEL).generation == 2
    assert not store.exists([sync_key(MODEL, run.sync_id)])[0]  # dropped at finalize
    # Each object sits in the segment holder of the node whose rank was assigned to it.
    assignment = assign_publishers(
        [(name, t.numel() * 4) for name, t in tensors.items()], TrainerTopology(NODES)
    )
    assert set(assignment.values()) == {0, 1}
    manifest = load_manifest(store, MODEL, 2)
    for fragment in manifest.fragments:
        node = NODES[assignment[fragment.tensor_id]]
        assert store.replica_segments(fragment.object_key) == (rollout.holders(node).segment,)
        assert store.get_bytes(fragment.object_key) == stored_bytes(tensors[fragment.tensor_id])

    update = rollout.backend.last_update
    assert update.generation == 2 and update.engines == [rollout.engine.url]
    assert update.store_read_bytes == sum(f.nbytes for f in manifest.fragments)
    status = rollout.engine.mooncake("GET", "status").json()
    assert (status["state"], status["generation"]) == ("serving", 2)
    assert rollout.engine.complete(PROMPT) == rollout.refs[1]

    async def cached() -> dict[str, bytes]:
        return {name: stored_bytes(t) async for name, t in rollout.backend.get_weights()}

    assert asyncio.run(cached()) == {n: stored_bytes(t) for n, t in tensors.items()}


def test_raising_rank_keeps_the_previous_generation(rollout: Rollout, trainers: Trainers) -> None:
    run = trainers.sync(rollout.dirs[2], fail_at=3)
    assert len({message for _, message in run.trainers}) == 1  # every rank says the same
    assert "rank 1: weight iterator raised RuntimeError" in run.trainers[0][1]
    assert_previous_generation_kept(rollout, run)


def test_dying_rank_keeps_the_previous_generation(rollout: Rollout) -> None:
    with ProcessGroup() as group:
        dying = Trainers(group, rollout)
        run = dying.sync(rollout.dirs[2], exit_at=3)
        dying.stop()
    assert len(run.trainers) == 1 and "all_gather_object on rank 0" in run.trainers[0][1]
    assert_previous_generation_kept(rollout, run)


def assert_previous_generation_kept(rollout: Rollout, run: SyncRun) -> None:
    assert all(status == "PublishFailed" for status, _ in run.trainers)
    assert isinstance(run.finalize_error, PublishFailed) and run.received == 0

    store = rollout.store
    assert active_generation(store, MODEL).generation == 2
    names = [name for name, _ in checkpoint_tensors(rollout.dirs[2])]
    assert not any(store.exists([payload_key(group_id(MODEL, 3), n) for n in names]))
    status = rollout.engine.mooncake("GET", "status").json()
    assert (status["state"], status["generation"]) == ("serving", 2)
    assert rollout.engine.complete(PROMPT) == rollout.refs[1]


def test_trainer_rank_0_is_the_broadcast_sender_when_the_bridge_selects_broadcast(
    rollout: Rollout,
) -> None:
    """``transport: broadcast`` (the train pool from the config: trainer ranks on CPU report
    no CUDA UUID): the trainer publishes as always; in ``finalize``, which VeRL runs on both
    sides at once, trainer rank 0 sends the announced generation to the engine's group."""
    import_external_libs("verl_bridge.backend")
    kwargs = {**rollout.kwargs, "transport": "broadcast", "train_gpus": "gpu-train-0"}
    backend = CheckpointEngineRegistry.new("mooncake_store", bucket_size=BUCKET_BYTES, **kwargs)
    world = replace(rollout, backend=backend, kwargs=kwargs)
    try:
        with ProcessGroup() as group:
            trainers = Trainers(group, world)
            run = trainers.sync(rollout.dirs[2])
            trainers.stop()
    finally:
        backend.close()
    assert run.finalize_error is None
    update = backend.last_update
    assert update.transport == "broadcast" and update.committed == [rollout.engine.url]
    manifest = load_manifest(rollout.store, MODEL, update.generation)
    row = update.legs[rollout.engine.url]
    assert row["transport"] == "broadcast" and row["port"] >= 29600
    assert row["bytes"] == sum(f.nbytes for f in manifest.fragments)
    assert rollout.engine.complete(PROMPT) == hf_greedy(rollout.dirs[2])
    records = ("spec", "beat", "outcome", "closed")
    assert not any(rollout.store.exists([slot_key(run.sync_id, r) for r in records]))
