"""Updates and loads across a leader SIGKILL on the durable Store (issue 50, ``make faults``).

One real vLLM engine (tiny Llama, ``--load-format mooncake``) on a durable Store: etcd, two
HA masters with the operation log, one segment holder. Each scenario publishes the next
generation, then SIGKILLs the leading master at one point of an update (as the coordinator
reports the phase before it) or of an engine's load from the Store, and starts a fresh
standby afterwards so the next scenario has one. Each ends the same way: the update or load
completed, or failed with a clear error and a plain rerun completed; the engine serves the
Store's active generation, complete and checksum-verified, with that generation's reference
output; and nothing was republished (the active generation is the one published before the
kill). The scenarios share one world and run in order; each records a row of the fault table.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator, UpdateFailed
from mooncake_rl.errors import MooncakeRLError
from mooncake_rl.generations import GenerationRegistry
from mooncake_rl.generations.commands import publish_checkpoint, verify_generation
from mooncake_rl.generations.registry import ActiveRecord
from mooncake_rl.services import DurableConfig, DurableStore, SegmentHolder
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, hf_greedy, make_tiny_llama, perturbed_copy
from tests.conftest import TEST_LEASE_TTL_MS, trainer_settings
from tests.faults.harness import TABLE

pytestmark = [pytest.mark.faults, pytest.mark.timeout(1200)]
MODEL = "tiny-durable-faults"
BATCH = 16 << 10  # several apply stages, so that "stage 0" lies inside the apply
FAILOVER_BOUND_S = 60.0
"""Kill to the engine serving the target: one failover (~10 s here), the update riding it
or a rerun after a clear failure, and the engine's lease on a failed session lapsing."""


class World:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirs = [make_tiny_llama(root / "d0")]
        self.dirs += [perturbed_copy(self.dirs[0], root / f"d{i}", i) for i in (1, 2)]
        self.refs = [hf_greedy(d) for d in self.dirs]
        assert len({tuple(r) for r in self.refs}) == 3
        self.content: dict[int, int] = {}  # generation -> index into dirs
        config = DurableConfig(masters=2, lease_ttl_ms=TEST_LEASE_TTL_MS, log_dir=root / "logs")
        self.durable = DurableStore(config).start()
        try:
            self.holder = SegmentHolder(
                self.durable.master_address,
                self.durable.metadata_url,
                64 << 20,
                log_dir=root / "logs",
                cluster_id=self.durable.cluster_id,
            ).start()
            self.store = StoreClient(trainer_settings(self.durable, self.holder, "node-a"))
        except BaseException:
            self.durable.stop()
            raise
        self.engine: VllmServer | None = None

    def publish(self) -> ActiveRecord:
        index = len(self.content) % len(self.dirs)
        record = publish_checkpoint(self.store, MODEL, self.dirs[index], "float32")
        self.content[record.generation] = index
        return record

    def new_engine(self) -> VllmServer:
        if self.engine is not None:
            self.engine.stop()
        self.engine = VllmServer(
            self.dirs[0],
            trainer_settings(self.durable, self.holder, "node-e").with_overrides(lease_ttl_s=6.0),
            name=MODEL,
            log_dir=self.root / "logs",
        )
        return self.engine

    def kill_leader(self) -> float:
        leader = self.durable.leader()
        assert leader is not None and leader.pid is not None, "no master leads"
        os.kill(leader.pid, signal.SIGKILL)
        return time.monotonic()

    def assert_serves(self, target: ActiveRecord, since: float) -> float:
        """The engine serves ``target`` (the Store's active generation, verified, never
        republished), with its reference output; seconds since the kill."""
        assert self.engine is not None
        status = self.engine.mooncake("GET", "status").json()
        assert status["state"] == "serving" and status["session"] is None, status
        assert (status["generation"], status["incarnation"]) == (
            target.generation,
            target.incarnation,
        ), status
        assert self.engine.complete(PROMPT) == self.refs[self.content[target.generation]]
        assert GenerationRegistry(self.store, MODEL).active() == target
        assert verify_generation(self.store, MODEL)["ok"]
        return time.monotonic() - since

    def restore_standby(self) -> None:
        """A fresh master in the killed leader's place, so the next kill has a standby."""
        assert self.durable.replace_dead_masters(), "the killed master was not found dead"
        self.durable.wait_for_leader()

    def close(self) -> None:
        try:
            if self.engine is not None:
                self.engine.stop()
            self.store.close()
            self.holder.stop()
        finally:
            self.durable.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    made = World(tmp_path_factory.mktemp("durable-faults"))
    try:
        yield made
    finally:
        made.close()


def update(world: World, progress: Callable[[str], None] = lambda phase: None) -> str:
    """One plain update of the engine: "completed", or the clear error it failed with."""
    assert world.engine is not None
    try:
        with Coordinator(world.store, [world.engine.url], progress=progress) as coordinator:
            result = coordinator.update(MODEL, batch_bytes=BATCH)
    except UpdateFailed as failed:
        return f"failed: {failed.result.error}"
    except MooncakeRLError as error:
        return f"failed: {type(error).__name__}: {error}"
    assert result.error is None and result.skipped == [], result.to_json()
    return "completed"


def rerun_until_served(world: World, target: ActiveRecord, since: float) -> float:
    """Plain reruns (the engine's lease on a failed session lapses first) until it serves."""
    deadline = since + FAILOVER_BOUND_S
    while (outcome := update(world)) != "completed":
        assert time.monotonic() < deadline, f"no rerun completed: {outcome}"
        time.sleep(1.0)
    return world.assert_serves(target, since)


def record(scenario: str, outcome: str, seconds: float) -> None:
    TABLE.append((scenario, outcome[:58], round(seconds, 2), FAILOVER_BOUND_S))


def test_a_new_engine_loads_across_a_leader_kill(world: World) -> None:
    """The leader dies as the engine's loader starts reading: the load rides the failover."""
    target = world.publish()
    engine = world.new_engine().spawn()
    log = engine.log_path
    deadline = time.monotonic() + 300
    while b"Starting to load model" not in (log.read_bytes() if log.exists() else b""):
        assert time.monotonic() < deadline, f"the engine never started loading; see {log}"
        time.sleep(0.02)
    killed = world.kill_leader()
    engine.wait_healthy()
    seconds = world.assert_serves(target, killed)
    record("leader killed as an engine loads", "load completed", seconds)
    world.restore_standby()


@pytest.mark.parametrize(
    ("after", "during"),
    [
        ("bodies", "during drain"),
        ("drain", "during prepare"),
        ("stage 0", "during apply"),
        ("apply", "during commit"),
        ("commit", "between updates"),
    ],
)
def test_an_update_across_a_leader_kill(world: World, after: str, during: str) -> None:
    """The leader dies when the coordinator reports ``after``, so ``during``: the
    update completes, or fails with a clear error and a plain rerun completes."""
    target = world.publish()
    killed: list[float] = []

    def progress(phase: str) -> None:
        if phase == after and not killed:
            killed.append(world.kill_leader())

    outcome = update(world, progress)
    assert killed, f"the update never reported {after!r}"
    if outcome == "completed":
        seconds = world.assert_serves(target, killed[0])
    else:
        assert "failover" in outcome or "leader" in outcome, outcome
        seconds = rerun_until_served(world, target, killed[0])
    record(f"leader killed {during}", outcome, seconds)
    world.restore_standby()


def test_every_master_killed_and_restarted_between_updates(world: World) -> None:
    """Both masters SIGKILLed, fresh ones started against the same etcd: they replay the
    operation log, and an update to a generation published before the loss completes."""
    target = world.publish()
    killed = time.monotonic()
    for master in world.durable.masters:
        assert master.pid is not None
        os.kill(master.pid, signal.SIGKILL)
    for master in world.durable.masters:
        master.wait(10)
    world.restore_standby()
    seconds = rerun_until_served(world, target, killed)
    record("every master killed, restarted", "update completed after the replay", seconds)
