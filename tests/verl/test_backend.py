"""The ``mooncake_store`` engine as VeRL builds it: config, registry, topology, guards."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verl")

from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.checkpoint_engine.base import CheckpointEngineWithCache
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig

from mooncake_rl.errors import ConfigurationError, InvariantViolation
from mooncake_rl.generations import load_manifest
from mooncake_rl.generations.keys import group_id, manifest_key
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.services import EmbeddedMaster
from tests.conftest import READ_LEASE_S, fragment_bytes, repo_root
from tests.verl.docs_config import compose_docs
from tests.verl.standins import vllm_alias
from verl_bridge.discovery import discover_engine_urls, policy_server_names, server_url


def test_docs_config_builds_the_engine_like_verl(tmp_path: Path) -> None:
    config = compose_docs(tmp_path)
    rollout = config.actor_rollout_ref.rollout
    assert rollout.engine_kwargs.vllm.worker_extension_cls == "verl_bridge.ext.VerlMooncakeExt"
    checkpoint = omega_conf_to_dataclass(rollout.checkpoint_engine)
    assert isinstance(checkpoint, CheckpointEngineConfig)

    # The three places VeRL 0.9.1 resolves a backend: manager (driver), trainer, rollout.
    import_external_libs(checkpoint.custom_backend_module or None)
    backend_cls = CheckpointEngineRegistry.get(checkpoint.backend)
    assert issubclass(backend_cls, CheckpointEngineWithCache)
    assert not backend_cls.__abstractmethods__
    bucket_size = checkpoint.update_weights_bucket_megabytes << 20
    kwargs = checkpoint.engine_kwargs.get(checkpoint.backend, {})
    trainer = CheckpointEngineRegistry.new(
        checkpoint.backend, is_master=True, bucket_size=bucket_size, **kwargs
    )
    rollout_rank = CheckpointEngineRegistry.new(
        checkpoint.backend, bucket_size=bucket_size, **kwargs
    )
    positional = CheckpointEngineRegistry.new(checkpoint.backend, bucket_size, False, **kwargs)
    assert [type(e) for e in (trainer, rollout_rank, positional)] == [backend_cls] * 3
    assert (trainer.is_master, rollout_rank.is_master, positional.is_master) == (
        True,
        False,
        False,
    )
    assert trainer.config.model == "my-policy" and trainer.config.mode == "compat"
    assert trainer.config.master == "10.0.0.1:50051" and trainer.config.protocol == "rdma"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"model": "m", "master_address": "x:1"}, "unknown mooncake_store engine_kwargs"),
        ({}, "needs engine_kwargs.mooncake_store.model"),
        ({"model": "bad name"}, "model name"),
        ({"model": "m", "mode": "fast"}, "mode must be one of"),
        ({"model": "m", "dtype": "int8"}, "unknown rollout dtype"),
        ({"model": "m", "engine_urls": ["127.0.0.1:8000"]}, "must start with http"),
        ({"model": "m", "replica_num": 0}, "replica_num must be an integer >= 1, got 0"),
        ({"model": "m", "keep": "2"}, r"keep must be an integer >= 1 \(or unset: no retention\)"),
        ({"model": "m", "keep": 0}, "keep must be an integer >= 1"),
        ({"model": "m", "retire_grace_s": -1}, "retire_grace_s must be a number of seconds >= 0"),
        ({"model": "m", "transport": "nccl"}, "unknown transport 'nccl'; valid: store"),
        (
            {"model": "m", "drain_mode": "drop"},
            r"drain_mode must be one of \('abort', 'wait', 'keep'\)",
        ),
        ({"model": "m", "pull": "gpu"}, r"pull must be one of \('single', 'node'\)"),
        (
            {"model": "m", "pull": "node", "transport": "broadcast"},
            "pull node chooses how the Store is read; the broadcast transport does not read it",
        ),
        (
            {"model": "m", "mode": "direct", "transport": "cpu_serialize"},
            "mode direct is a Store-path mode; the cpu_serialize transport delivers full",
        ),
        ({"model": "m", "min_engines": 0}, "min_engines must be an integer >= 1"),
        ({"model": "m", "session_ttl_s": 0.5}, "session_ttl_s must lie in 1..3600 seconds"),
        ({"model": "m", "router": "router:30000"}, "must start with http"),
        ({"model": "m", "router": "http://r:1", "router_kind": "nginx"}, "not one of vllm"),
        ({"model": "m", "max_unavailable": 0}, "max_unavailable must be an integer >= 1"),
        ({"model": "m", "delta_every": 0}, r"delta_every must be an integer >= 1"),
        ({"model": "m", "delta_every": 4, "delta_max_fraction": 2}, "delta_max_fraction"),
    ],
)
def test_bad_engine_kwargs_fail_at_construction(kwargs: dict, message: str) -> None:
    import_external_libs("verl_bridge.backend")
    with pytest.raises(ConfigurationError, match=message):
        CheckpointEngineRegistry.new("mooncake_store", bucket_size=1 << 20, **kwargs)


def test_retention_keys_decide_what_the_syncs_leave_in_the_store(
    master: EmbeddedMaster, holders
) -> None:
    """The real publisher, through the backend's trainer calls, retires as the keys say.

    The defaults (keep 2, a 10 s grace) would leave other sets, so each key is seen to
    arrive. ``drain_mode`` and ``pull`` reach the real coordinator in ``test_sync_e2e``,
    ``transport`` in its broadcast test, each read back from the update it made."""
    import_external_libs("verl_bridge.backend")
    left = {(1, 0): [4], (None, 0): [1, 2, 3, 4]}
    engines = {
        keys: CheckpointEngineRegistry.new(
            "mooncake_store",
            bucket_size=1,
            is_master=True,
            model=f"kept-{keys[0]}",
            master=master.master_address,
            metadata=master.metadata_url,
            local_segment=holders("node-retention").segment,
            dtype="float32",
            engine_urls="http://e:1",
            keep=keys[0],
            retire_grace_s=keys[1],
        )
        for keys in left
    }

    def sync(engine: Any, step: int) -> None:
        engine.init_process_group(role="trainer", rank=0, world_size=1, sync_id=f"s{step}")
        weights = iter([("w", torch.full((4,), float(step)))])
        metrics = asyncio.run(engine.send_weights(weights, global_steps=step))
        engine.finalize()
        assert metrics["mooncake_store/generation"] == step

    try:
        for step in (1, 2, 3):
            for engine in engines.values():
                sync(engine, step)
        # Each announce's completeness check leaves a read lease on what it checked, and
        # Mooncake refuses to remove an object under one: syncs come minutes apart in a job.
        time.sleep(READ_LEASE_S)
        for keys, engine in engines.items():
            sync(engine, 4)
            store, model = engine.store, engine.config.model
            listed = [info.generation for info in GenerationRegistry(store, model).generations()]
            assert listed == left[keys]
            manifests = [manifest_key(group_id(model, g)) for g in (1, 2, 3, 4)]
            assert store.exists(manifests) == [g in left[keys] for g in (1, 2, 3, 4)]
            fragment = load_manifest(store, model, 4).fragments[0]
            assert fragment_bytes(store, fragment) == torch.full((4,), 4.0).numpy().tobytes()
    finally:
        for engine in engines.values():
            engine.close()


def test_delta_every_publishes_each_sync_as_a_delta_of_the_last(
    master: EmbeddedMaster, holders
) -> None:
    """``delta_every``: the trainer keeps what it published and sends only what changed;
    a keyframe first, then deltas of it, each reading back exactly."""
    import_external_libs("verl_bridge.backend")
    engine = CheckpointEngineRegistry.new(
        "mooncake_store",
        bucket_size=1,
        is_master=True,
        model="delta-sync",
        master=master.master_address,
        metadata=master.metadata_url,
        local_segment=holders("node-delta").segment,
        dtype="float32",
        engine_urls="http://e:1",
        delta_every=4,
    )
    weights = torch.arange(4096, dtype=torch.float32)
    try:
        for step in (1, 2, 3):
            weights = weights.clone()
            weights[::100] += step  # 41 of 4096 elements change per step
            engine.init_process_group(role="trainer", rank=0, world_size=1, sync_id=f"d{step}")
            asyncio.run(engine.send_weights(iter([("w", weights)]), global_steps=step))
            engine.finalize()
        record = GenerationRegistry(engine.store, "delta-sync").active()
        assert record is not None
        assert (record.generation, record.base, record.keyframe, record.chain_length) == (
            3,
            2,
            1,
            2,
        )
        assert record.chain_bytes < record.bytes / 10
        _, tensors = active_weights(engine.store, "delta-sync")
        assert torch.equal(dict(tensors)["w"], weights)
        assert engine._last_published.generation == 3  # the next base, kept in host memory
    finally:
        engine.close()


def test_engine_urls_accept_a_list_or_a_comma_separated_string() -> None:
    import_external_libs("verl_bridge.backend")
    listed = CheckpointEngineRegistry.new(
        "mooncake_store", bucket_size=1, model="m", engine_urls=["http://a:1/", "http://b:2"]
    )
    joined = CheckpointEngineRegistry.new(
        "mooncake_store", bucket_size=1, model="m", engine_urls="http://a:1, http://b:2"
    )
    assert listed.config.engine_urls == joined.config.engine_urls == ("http://a:1", "http://b:2")


def test_the_router_key_comes_from_the_environment_as_for_the_cli(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import_external_libs("verl_bridge.backend")
    kwargs = {"bucket_size": 1, "model": "m", "router": "http://r:1"}
    monkeypatch.delenv("MOONCAKE_RL_ROUTER_API_KEY", raising=False)
    unkeyed = CheckpointEngineRegistry.new("mooncake_store", **kwargs).config.router_spec()
    assert unkeyed is not None and unkeyed.token is None
    monkeypatch.setenv("MOONCAKE_RL_ROUTER_API_KEY", "router-secret")
    spec = CheckpointEngineRegistry.new("mooncake_store", **kwargs).config.router_spec()
    assert spec is not None and (spec.url, spec.token) == ("http://r:1", "router-secret")
    assert "router-secret" not in repr(spec)


def test_topology_shares_one_fresh_sync_id_and_checks_the_master() -> None:
    import_external_libs("verl_bridge.backend")
    backend_cls = CheckpointEngineRegistry.get("mooncake_store")
    metadata = [{"is_master": rank == 0} for rank in range(2)] + [{"is_master": False}] * 3
    actor, rollout = backend_cls.build_topology(2, 3, metadata)
    assert actor["role"] == ["trainer"] * 2 and rollout["role"] == ["rollout"] * 3
    assert actor["rank"] == [0, 1] and rollout["rank"] == [0, 1, 2]
    assert actor["world_size"] == [2, 2] and rollout["world_size"] == [3] * 3
    assert len(set(actor["sync_id"] + rollout["sync_id"])) == 1
    assert backend_cls.build_topology(2, 3, metadata)[0]["sync_id"] != actor["sync_id"]
    with pytest.raises(InvariantViolation, match="exactly trainer rank 0 must be master"):
        backend_cls.build_topology(2, 3, list(reversed(metadata)))


def test_calls_out_of_order_are_refused() -> None:
    import_external_libs("verl_bridge.backend")
    engine = CheckpointEngineRegistry.new("mooncake_store", bucket_size=1, model="m")
    with pytest.raises(InvariantViolation, match="needs init_process_group"):
        asyncio.run(engine.send_weights(iter([])))

    async def receive() -> None:
        async for _ in engine.receive_weights():
            pass

    with pytest.raises(InvariantViolation, match="needs init_process_group"):
        asyncio.run(receive())
    # A trainer rank 1 of 2 without torch.distributed would think it is rank 0: refused.
    with pytest.raises(InvariantViolation, match="initialize the trainer's process group"):
        engine.init_process_group(role="trainer", rank=1, world_size=2, sync_id="s")


def test_policy_servers_are_found_by_verl_actor_names() -> None:
    names = [
        "vllm_server_10_0",
        "vllm_server_2_0",
        "vllm_server_2_1",  # node 1 of replica 2: not the replica's address
        "vllm_server_reward_0_0",
        "vllm_server_teacher_0_0",
        "rollout_standalone_0CheckpointEngineWorker_0:0",
        "sglang_server_3_0",
    ]
    expected = ["vllm_server_2_0", "sglang_server_3_0", "vllm_server_10_0"]
    assert policy_server_names(names) == expected
    assert server_url("10.0.0.5", 8000) == "http://10.0.0.5:8000"
    assert server_url("fd00::5", 8000) == "http://[fd00::5]:8000"
    assert server_url("node-7", 8000) == "http://node-7:8000"


def test_discovery_outside_a_ray_job_says_what_to_set() -> None:
    import ray

    assert not ray.is_initialized()
    with pytest.raises(ConfigurationError, match="no engine_urls configured"):
        discover_engine_urls()


def test_core_and_bridge_package_do_not_import_verl() -> None:
    code = (
        "import sys, verl_bridge, verl_bridge.config, verl_bridge.publish, "
        "verl_bridge.discovery, mooncake_rl.coordinator, mooncake_rl.generations, "
        "engine_ext.vllm.loader\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('verl', 'ray', 'vllm'))\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root(), timeout=120)


def test_docs_worker_extension_has_verl_methods_and_ours(tmp_path: Path) -> None:
    """vLLM takes one ``--worker-extension-cls``: the docs' class is both VeRL's extension and
    ours (our endpoint plugin accepts it), and neither shadows a method of the other."""
    vllm = compose_docs(tmp_path).actor_rollout_ref.rollout.engine_kwargs.vllm
    code = f"""
import importlib
from engine_ext.vllm.plugins import require_worker_extension
from engine_ext.vllm.worker import MooncakeWorkerExtension as Ours
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension as Verl
module, _, name = {vllm.worker_extension_cls!r}.rpartition(".")
assert issubclass(getattr(importlib.import_module(module), name), Verl)
require_worker_extension({vllm.worker_extension_cls!r})
shared = {{n for n in vars(Ours) if not n.startswith("__")}} & set(vars(Verl))
assert not shared, shared
"""
    path = [str(p) for p in (vllm_alias(tmp_path / "alias"), repo_root()) if p is not None]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root(), env=env, timeout=300)
