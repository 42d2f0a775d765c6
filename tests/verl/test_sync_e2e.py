"""VeRL weight syncs through ``mooncake_store``, driven by VeRL's own ``CheckpointEngineManager``.

Ray runs locally on CPU. The job is ``docs/verl.md``'s configuration composed by hydra; the
machinery around the manager is VeRL's own wherever it runs here (``tests/verl/standins.py``
names the stand-ins and why). Two trainer ranks on two node labels (a gloo group, each
preferring its node's segment holder) publish; one rollout replica receives: a
``CheckpointEngineWorker`` and a live vLLM CPU engine, started from the Store, whose worker
extension is ``verl_bridge.ext.VerlMooncakeExt``; rollout rank 0 finds it through Ray.
"""

from __future__ import annotations

import asyncio
import copy
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("vllm")

import httpx
import ray
from omegaconf import DictConfig, open_dict
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.checkpoint_engine.base import CheckpointEngineManager
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig

from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import UpdateResult
from mooncake_rl.generations import TrainerTopology, assign_publishers, load_manifest
from mooncake_rl.generations.commands import checkpoint_tensors, publish_checkpoint
from mooncake_rl.generations.keys import group_id
from mooncake_rl.generations.registry import active_generation
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, hf_greedy, make_tiny_llama, perturbed_copy
from mooncake_rl.transport.rendezvous import slot_key
from tests.conftest import fragment_bytes, payload_keys, repo_root, settings_for
from tests.engine.test_receiver_routes import by_label, samples_of
from tests.verl.docs_config import compose_docs
from tests.verl.standins import EngineReplica, TrainerWorker, server_name, vllm_alias
from verl_bridge.publish import sync_key, wait_outcome

MODEL = "my-policy"  # the docs' model name
TOKEN = "verl-s3cret"
NODES = ("node-a", "node-b")
KV = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.mooncake_store"


@dataclass
class World:
    """One live engine, the job's config, and the Ray side of the job around it."""

    holders: Any
    dirs: list[Path]
    refs: list[list[int]]
    store: StoreClient
    engine: VllmServer
    config: DictConfig
    textfile: Path  # the bridge's metrics_textfile
    replica: EngineReplica | None = None
    trainer_wg: RayWorkerGroup | None = None

    def build_job(self) -> None:
        """The rollout replica (its worker and server actor) and the trainer ranks."""
        self.replica = EngineReplica(0, self.rollout(), self.engine.url, TOKEN)
        asyncio.run(self.replica.init_colocated(pool(1)))
        self.trainer_wg = self.trainers(self.checkpoint_engine())

    def rollout(self, **kwargs: Any) -> DictConfig:
        """The job's rollout config, with ``kwargs`` added to our ``engine_kwargs``."""
        rollout = copy.deepcopy(self.config.actor_rollout_ref.rollout)
        with open_dict(rollout):
            rollout.checkpoint_engine.engine_kwargs.mooncake_store.update(kwargs)
        return rollout

    def checkpoint_engine(self, **kwargs: Any) -> CheckpointEngineConfig:
        return omega_conf_to_dataclass(self.rollout(**kwargs).checkpoint_engine)

    def trainers(self, checkpoint: CheckpointEngineConfig) -> RayWorkerGroup:
        """Two trainer ranks, one per node label (VeRL's actor worker group)."""
        envs = [
            {"MOONCAKE_RL_NODE": node, "MOONCAKE_RL_LOCAL_SEGMENT": self.holders(node).segment}
            for node in NODES
        ]
        return RayWorkerGroup(
            pool(len(NODES)),
            RayClassWithInitArgs(cls=ray.remote(TrainerWorker), config=checkpoint, envs=envs),
            device_name="cpu",
        )

    def calls(self) -> list[dict[str, Any]]:
        return ray.get(ray.get_actor(server_name(0)).calls.remote())


def pool(workers: int) -> RayResourcePool:
    """CPU bundles for ``workers`` actors on this node."""
    return RayResourcePool([workers], use_gpu=False, max_colocate_count=1)


@pytest.fixture(scope="module")
def world(
    master: EmbeddedMaster, holders, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    root = tmp_path_factory.mktemp("verl")
    dirs = [make_tiny_llama(root / "g1")]
    dirs += [perturbed_copy(dirs[0], root / f"g{seed + 1}", seed) for seed in (1, 2)]
    refs = [hf_greedy(d) for d in dirs[:2]]
    for node in NODES:
        holders(node)  # one segment holder per trainer node
    settings = settings_for(master, "rollout", segment_bytes=0)
    store = StoreClient(settings)
    config = compose_docs(
        root,
        [
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            f"{KV}.master={master.master_address}",
            f"{KV}.metadata={master.metadata_url}",
            f"{KV}.protocol=tcp",
            f"{KV}.dtype=float32",
            f"+{KV}.token={TOKEN}",
            f"+{KV}.timeout_s=120",
            f"+{KV}.drain_mode=wait",
            # One engine on one node: a pull per node reads what a single pull would, and
            # the key travels VeRL's own config into the real coordinator.
            f"+{KV}.pull=node",
            f"+{KV}.metrics_textfile={root / 'verl.prom'}",
        ],
    )
    vllm = config.actor_rollout_ref.rollout.engine_kwargs.vllm
    alias = vllm_alias(root / "alias")
    engine = VllmServer(
        dirs[0],
        settings,
        log_dir=root / "logs",
        token=TOKEN,
        extension=False,  # the docs' extension instead, from the config
        extra_env={
            "PYTHONPATH": os.pathsep.join(str(p) for p in (alias, repo_root()) if p is not None),
            "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /is_paused for the replica's calls
            "MOONCAKE_RL_GPU_IDS": "gpu-rollout-0",  # declared topology (no CUDA)
        },
        extra_args=[
            "--enforce-eager",
            f"--worker-extension-cls={vllm.worker_extension_cls}",
            f"--model-loader-extra-config={vllm.model_loader_extra_config}",
        ],
    )
    ray.init(
        num_cpus=16,  # scheduling slots only: every actor here idles most of the time
        include_dashboard=False,
        namespace="mooncake-rl-verl",
        runtime_env={"env_vars": {"PYTHONPATH": str(repo_root()), "GLOG_minloglevel": "2"}},
    )
    try:
        assert publish_checkpoint(store, MODEL, dirs[0], "float32").generation == 1
        world = World(holders, dirs, refs, store, engine, config, root / "verl.prom")
        # Ray builds the job while the engine boots. The engine starts on this thread: its
        # process is signalled when the thread that started it ends (PR_SET_PDEATHSIG).
        with ThreadPoolExecutor(1) as executor:
            job = executor.submit(world.build_job)
            engine.start()
            job.result()
        yield world
    finally:
        ray.shutdown()
        engine.stop()
        store.close()


@pytest.fixture(scope="module")
def manager(world: World) -> CheckpointEngineManager:
    assert world.replica is not None and world.trainer_wg is not None
    return CheckpointEngineManager(world.checkpoint_engine(), world.trainer_wg, [world.replica])


def stored_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.to(torch.float32).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_verl_manager_syncs_the_engine_and_verl_resumes_it(
    world: World, manager: CheckpointEngineManager
) -> None:
    assert world.engine.complete(PROMPT) == world.refs[0]
    manager.actor_wg.train(world.dirs[1], {})
    metrics = manager.update_weights(global_steps=7)

    tensors = dict(checkpoint_tensors(world.dirs[1]))
    assert metrics["mooncake_store/generation"] == 2
    assert metrics["mooncake_store/tensors"] == len(tensors)
    assert metrics["mooncake_store/bytes"] == sum(t.numel() * 4 for t in tensors.values())
    store = world.store
    assert active_generation(store, MODEL).generation == 2
    assert store.remove_prefix(sync_key(MODEL, ""), force=True) == 0  # dropped at finalize
    # Each object sits in the segment holder of the node whose rank was assigned to it.
    assignment = assign_publishers(
        [(name, t.numel() * 4) for name, t in tensors.items()], TrainerTopology(NODES)
    )
    assert set(assignment.values()) == {0, 1}
    for fragment in load_manifest(store, MODEL, 2).fragments:
        node = NODES[assignment[fragment.tensor_id]]
        assert store.replica_segments(fragment.object_key) == (world.holders(node).segment,)
        assert fragment_bytes(store, fragment) == stored_bytes(tensors[fragment.tensor_id])

    # VeRL's order: abort -> release KV -> weights (our yield-nothing pass) -> finalize (the
    # engine moves to generation 2) -> resume KV -> resume. The engine, paused by VeRL's
    # abort, stays paused through finalize and runs again only at VeRL's resume.
    seen = [(c["call"], c["paused"], c["generation"], c["state"]) for c in world.calls()]
    assert seen == [
        ("abort", True, 1, "serving"),
        ("release_kv_cache", True, 1, "serving"),
        ("clear_kv_cache", True, 1, "serving"),
        ("set_global_steps:7", True, 1, "serving"),
        ("resume_kv_cache", True, 2, "serving"),
        ("resume", False, 2, "serving"),
    ]
    update = last_update(world.replica)  # the engine rollout rank 0 found through Ray
    assert update.generation == 2 and update.engines == [world.engine.url]
    assert (update.pull, update.drain_mode) == ("node", "wait")  # engine_kwargs reached it
    assert update.store_read_bytes == sum(t.numel() * 4 for t in tensors.values())
    # Rollout rank 0 rewrote its node-exporter textfile with that update's figures.
    exported = samples_of(world.textfile.read_text())
    assert by_label(exported, "updates_total") == {"committed": 1}
    assert exported[("mooncake_rl_update_store_read_bytes_total", ())] == update.store_read_bytes
    assert exported[("mooncake_rl_update_last_success", ())] == 1
    assert world.engine.complete(PROMPT) == world.refs[1]

    # VeRL's own methods run in the same extension (vLLMHttpServer calls this at launch).
    patched = httpx.post(
        f"{world.engine.url}/collective_rpc",
        json={"method": "monkey_patch_model", "kwargs": {"vocab_size": 128}},
        timeout=60,
    )
    assert patched.json() == {"results": [None]}

    import_external_libs("verl_bridge.backend")
    checkpoint = world.checkpoint_engine()
    cache = CheckpointEngineRegistry.new(
        checkpoint.backend, bucket_size=1 << 20, **checkpoint.engine_kwargs["mooncake_store"]
    )

    async def cached() -> dict[str, bytes]:
        return {name: stored_bytes(t) async for name, t in cache.get_weights()}

    try:
        assert asyncio.run(cached()) == {n: stored_bytes(t) for n, t in tensors.items()}
    finally:
        cache.close()


def test_raising_rank_keeps_the_previous_generation(
    world: World, manager: CheckpointEngineManager
) -> None:
    before = served(world)
    manager.actor_wg.train(world.dirs[2], {1: {"fail_at": 3}})
    with pytest.raises(ray.exceptions.RayTaskError, match="rank 1: weight iterator raised"):
        manager.update_weights(global_steps=8)
    assert_kept(world, manager, before)


@pytest.mark.faults
def test_dying_rank_keeps_the_previous_generation(world: World) -> None:
    checkpoint = world.checkpoint_engine()
    trainers = world.trainers(checkpoint)
    dying = CheckpointEngineManager(checkpoint, trainers, [world.replica])
    before = served(world)
    trainers.train(world.dirs[2], {1: {"exit_at": 3}})
    try:
        with pytest.raises(ray.exceptions.RayError):
            dying.update_weights(global_steps=9)
        (sync_id,) = ray.get(trainers.workers[0].sync_ids.remote())  # rank 1 is gone
        # VeRL raised at rank 1's death; rank 0 decides once its collective fails, and
        # rollout rank 0 reads that outcome.
        outcome = wait_outcome(world.store, MODEL, sync_id, timeout_s=90)
    finally:
        for worker in trainers.workers:
            ray.kill(worker)
    assert not outcome.ok and "all_gather_object on rank 0" in str(outcome.error)
    world.store.remove([sync_key(MODEL, sync_id)], force=True)  # its rank 0 is gone
    assert_kept(world, dying, before)


@dataclass(frozen=True)
class Served:
    generation: int
    output: list[int]


def served(world: World) -> Served:
    """The active generation and the engine's greedy output on it."""
    return Served(active_generation(world.store, MODEL).generation, world.engine.complete(PROMPT))


def assert_kept(world: World, manager: CheckpointEngineManager, before: Served) -> None:
    """Nothing of the generation the failed sync claimed remains, and the engine, never
    drained, serves what it served: VeRL's manager skips its own resume steps when a sync
    raises, and the backend's wrapper (``verl_bridge.manager``) runs them."""
    store = world.store
    assert active_generation(store, MODEL).generation == before.generation
    claimed = group_id(MODEL, before.generation + 1)
    names = [name for name, _ in checkpoint_tensors(world.dirs[2])]
    assert not any(store.exists(payload_keys(claimed, names)))
    assert not httpx.get(f"{world.engine.url}/is_paused", timeout=30).json()["is_paused"]
    status = world.engine.mooncake("GET", "status").json()
    assert (status["state"], status["generation"]) == ("serving", before.generation)
    assert world.engine.complete(PROMPT) == before.output


def last_update(replica: EngineReplica) -> UpdateResult:
    """What rollout rank 0's coordinator did in the replica's last sync."""
    return ray.get(
        replica.workers[0].__ray_call__.remote(lambda w: w.checkpoint_engine.last_update)
    )


@pytest.mark.faults  # make faults; make test keeps the Store-path sync and vLLM's broadcast
def test_trainer_rank_0_is_the_broadcast_sender_when_the_bridge_selects_broadcast(
    world: World,
) -> None:
    """``transport: broadcast`` (the train pool from the config: trainer ranks on CPU report
    no CUDA UUID): the trainer publishes as always; in ``finalize``, which VeRL's manager
    runs on both sides at once, trainer rank 0 sends the announced generation to the
    engine's group."""
    rollout = world.rollout(  # the job's pull=node is a Store-path option: back to single
        transport="broadcast",
        pull="single",
        train_gpus="gpu-train-0",
        engine_urls=[world.engine.url],
    )
    checkpoint = omega_conf_to_dataclass(rollout.checkpoint_engine)
    replica = EngineReplica(1, rollout, world.engine.url, TOKEN)  # its own server actor name
    asyncio.run(replica.init_colocated(pool(1)))
    trainers = world.trainers(checkpoint)
    try:
        trainers.train(world.dirs[2], {})
        CheckpointEngineManager(checkpoint, trainers, [replica]).update_weights(global_steps=10)
        update = last_update(replica)
        (sync_id,) = trainers.sync_ids()[0]
    finally:
        for worker in [*trainers.workers, *replica.workers, *replica.servers]:
            ray.kill(worker)
    assert update.transport == "broadcast" and update.committed == [world.engine.url]
    manifest = load_manifest(world.store, MODEL, update.generation)
    row = update.legs[world.engine.url]
    assert row["transport"] == "broadcast" and row["port"] >= 29600
    assert row["bytes"] == sum(f.nbytes for f in manifest.fragments)
    assert world.engine.complete(PROMPT) == hf_greedy(world.dirs[2])
    records = ("spec", "beat", "outcome", "closed")
    assert not any(world.store.exists([slot_key(sync_id, r) for r in records]))
