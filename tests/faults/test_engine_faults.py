"""Master loss, holder loss and a corrupted payload with a real vLLM engine (issue 14).

One engine (tiny Llama, ``--load-format mooncake``) on its own master with fixed ports and
two segment holders. The tests run in order and share that world (``make faults``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator, UpdateFailed
from mooncake_rl.errors import ServiceError
from mooncake_rl.generations import GenerationRegistry
from mooncake_rl.generations.commands import generation_status, publish_checkpoint
from mooncake_rl.generations.registry import NoActiveGeneration
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, hf_greedy, make_tiny_llama, perturbed_copy
from tests.faults.test_master_and_holder_loss import (
    Services,
    assert_lost_state_error,
    kill_and_restart,
    wait_until_writable,
)
from tests.test_cli_generations import run_cli

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]
MODEL = "tiny-faults"


class World:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.services = Services(root / "logs")
        self.dirs = [make_tiny_llama(root / "g0")]
        self.dirs += [perturbed_copy(self.dirs[0], root / f"g{i}", i) for i in (1, 2)]
        self.refs = [hf_greedy(d) for d in self.dirs]
        assert len({tuple(r) for r in self.refs}) == 3
        self.engine: VllmServer | None = None

    def store(self, node: str = "node-a") -> StoreClient:
        return StoreClient(self.services.client(node))

    def publish(self, index: int, node: str = "node-a") -> int:
        with self.store(node) as store:
            return publish_checkpoint(store, MODEL, self.dirs[index], "float32").generation

    def start_engine(self) -> VllmServer:
        if self.engine is not None:
            self.engine.stop()
        self.engine = VllmServer(
            self.dirs[0],
            self.services.client("node-e").with_overrides(lease_ttl_s=6.0),
            name=MODEL,
            log_dir=self.root / "logs",
        )
        return self.engine.start()

    def status(self) -> dict:
        assert self.engine is not None
        return self.engine.mooncake("GET", "status").json()

    def restart_master(self) -> None:
        self.services.master = kill_and_restart(self.services.master)
        with self.store() as store:
            wait_until_writable(store)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.services.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    made = World(tmp_path_factory.mktemp("engine-faults"))
    try:
        yield made
    finally:
        made.close()


def test_master_restart_between_generations(world: World) -> None:
    assert world.publish(0) == 1
    engine = world.start_engine()
    assert engine.complete(PROMPT) == world.refs[0]
    old = world.status()
    assert (old["state"], old["generation"]) == ("serving", 1)

    world.restart_master()
    segment = world.services.holder("node-a").segment
    for args in (("status", "--name", MODEL), ("verify", "--name", MODEL)):
        ran = run_cli(world.services.master, segment, *args)
        assert "active generation None" in ran.stdout or ran.returncode != 0, ran
    with world.store() as store:
        assert_lost_state_error(str(generation_status(store, MODEL).get("problem")))
        with (
            Coordinator(store, [engine.url]) as coordinator,
            pytest.raises(NoActiveGeneration) as failed,
        ):
            coordinator.update(MODEL)
    assert_lost_state_error(str(failed.value))
    # The engine keeps serving what it holds.
    assert engine.complete(PROMPT) == world.refs[0]
    assert world.status()["state"] == "serving"

    assert world.publish(1) == 1  # numbering restarts with the new incarnation
    with world.store() as store:
        record = GenerationRegistry(store, MODEL).active()
        assert record.incarnation != old["incarnation"]
        with Coordinator(store, [engine.url]) as coordinator:
            result = coordinator.update(MODEL, batch_bytes=64 << 10)
    assert result.skipped == [] and result.generation == 1 and result.error is None
    now = world.status()
    assert (now["state"], now["generation"], now["incarnation"]) == (
        "serving",
        1,
        record.incarnation,
    )
    assert engine.complete(PROMPT) == world.refs[1]


def test_master_killed_during_an_update(world: World) -> None:
    """The master dies once every engine prepared: the update fails, and the engine serves the
    old generation whole, or reports itself for rebuild; never a mix."""
    engine = world.engine
    assert engine is not None and world.publish(2) == 2
    killed: list[str] = []

    def progress(phase: str) -> None:
        if phase == "prepare":  # every engine drained and prepared; apply comes next
            world.restart_master()
            killed.append(phase)

    with (
        world.store() as store,
        Coordinator(store, [engine.url], progress=progress) as coord,
        pytest.raises(UpdateFailed) as failed,
    ):
        coord.update(MODEL, batch_bytes=64 << 10)
    assert killed == ["prepare"], "the update never reached apply"
    result = failed.value.result
    assert result.error, result
    status = world.status()
    if result.rebuild:
        assert result.rebuild == [engine.url] and status["state"] != "serving", status
        with pytest.raises(Exception):  # noqa: B017 - a drained engine admits nothing
            engine.complete(PROMPT, timeout=20)
    else:
        assert status["state"] == "serving" and status["generation"] == 1, status
        assert engine.complete(PROMPT) == world.refs[1]


def test_lost_holder_refuses_update_before_drain_and_activate_serves_older(world: World) -> None:
    # A clean state: the master lost everything above; generation 1 in holder A.
    assert world.publish(0) == 1
    engine = world.start_engine()
    assert engine.complete(PROMPT) == world.refs[0]
    b = world.services.holder("node-b")
    assert world.publish(1, node="node-b") == 2
    with world.store() as store:
        keys = [f.object_key for f in GenerationRegistry(store, MODEL).load_manifest(2).fragments]
    b.stop()
    with world.store() as store:
        deadline = time.monotonic() + 30
        while any(store.exists(keys)):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        with (
            Coordinator(store, [engine.url]) as coordinator,
            pytest.raises(UpdateFailed) as refused,
        ):
            coordinator.update(MODEL)
        status = generation_status(store, MODEL)
    message = str(refused.value)
    assert "not fully readable" in message and "no engine was drained" in message
    assert any(k in message for k in keys), message
    assert "drain" not in refused.value.result.phase_seconds
    assert (world.status()["state"], world.status()["generation"]) == ("serving", 1)
    assert engine.complete(PROMPT) == world.refs[0]
    rows = {row["generation"]: row["readable"] for row in status["generations"]}
    assert rows == {1: True, 2: False}

    segment = world.services.holder("node-a").segment
    activated = run_cli(
        world.services.master, segment, "activate", "--name", MODEL, "--generation", "1"
    )
    assert activated.returncode == 0, activated.stderr
    restarted = world.start_engine()
    assert world.status()["generation"] == 1
    assert restarted.complete(PROMPT) == world.refs[0]


def test_corrupted_payload_fails_a_restarting_engine_naming_the_object(world: World) -> None:
    with world.store() as store:
        manifest = GenerationRegistry(store, MODEL).load_active_manifest()
        key = max(manifest.fragments, key=lambda f: f.nbytes).object_key
        size = store.size(key)
        assert not store.remove([key], force=True)
        store.put_bytes(key, np.random.default_rng(3).bytes(size))
        assert store.size(key) == size
    with pytest.raises(ServiceError, match="exited early"):
        world.start_engine()
    assert world.engine is not None
    log = world.engine.log_path.read_text(errors="replace")
    world.engine = None
    assert key in log and "does not match" in log, log[-3000:]
