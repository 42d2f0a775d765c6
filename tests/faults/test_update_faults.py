"""The update fault matrix (issue 15): each fault caused for real during an update of two
real vLLM engines (``a``: TP=1 on node a, ``b``: TP=2 on node b) on their own master.

Every scenario ends with every engine serving one complete generation whose greedy output
matches that generation's reference, within the bound it states, and then a plain update
brings every engine to the Store's active generation (nothing lost). Each records a row of
the table ``make faults`` prints (scenario, outcome, seconds to recover), the table in
docs/reliability.md. The scenarios share one world and run in order.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator, UpdateFailed
from mooncake_rl.generations import GenerationRegistry
from mooncake_rl.generations.commands import publish_checkpoint
from mooncake_rl.generations.keys import advert_key
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import hf_greedy, make_tiny_llama, perturbed_copy
from tests.faults.harness import (
    TABLE,
    DroppingProxy,
    Traffic,
    kill_engine,
    start_coordinator,
    wait_converged,
)
from tests.faults.test_master_and_holder_loss import (
    Services,
    kill_and_restart,
    wait_until_writable,
)
from tests.procs import CTX

pytestmark = [pytest.mark.faults, pytest.mark.timeout(1200)]
MODEL = "tiny-update-faults"
FAULTS = Path(__file__).parents[1] / "engine" / "faults"
SESSION_TTL_S = 8.0
"""Short, so that recovery is quick to watch, yet far above a stage's length here: renewals
come every third of it, and a lease that ran out during a slow stage would free the engines
before the coordinator is killed (safe, but not the fault under test)."""
LEASE_BOUND_S = SESSION_TTL_S + 12.0
"""A coordinator's death frees its engines within the session TTL, plus one watchdog tick
and vLLM's resume; the slack covers a loaded 2-core machine."""
RESTART_BOUND_S = 300.0
"""A killed engine is back once restarted: vLLM's start, reading the active generation."""
BATCH = 16 << 10  # several apply stages, so that "mid-apply" lies between two of them


class World:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.services = Services(root / "logs")
        self.dirs = [make_tiny_llama(root / "c0")]
        self.dirs += [perturbed_copy(self.dirs[0], root / f"c{i}", i) for i in (1, 2)]
        self.refs = [hf_greedy(d) for d in self.dirs]
        assert len({tuple(r) for r in self.refs}) == 3
        self.content: dict[tuple[str | None, int], int] = {}
        self.published = 0
        self.write_fault = root / "fail-te-write"
        self.engines: dict[str, VllmServer] = {}

    @property
    def settings(self) -> Settings:
        return self.services.client("node-a")

    def store(self) -> StoreClient:
        return StoreClient(self.settings)

    def publish(self) -> int:
        index = self.published % len(self.dirs)
        self.published += 1
        with self.store() as store:
            record = publish_checkpoint(store, MODEL, self.dirs[index], "float32")
            incarnation = GenerationRegistry(store, MODEL).active().incarnation
        self.content[(incarnation, record.generation)] = index
        return record.generation

    def reference(self, status: dict[str, Any]) -> list[int]:
        return self.refs[self.content[(status["incarnation"], status["generation"])]]

    def start(self, label: str, tp: int) -> VllmServer:
        pythonpath = os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))
        self.engines[label] = VllmServer(
            self.dirs[0],
            self.services.client(f"node-{label}").with_overrides(lease_ttl_s=6.0),
            name=MODEL,
            tensor_parallel_size=tp,
            log_dir=self.root / "logs",
            extra_env={
                "PYTHONPATH": pythonpath,
                "MOONCAKE_RL_TEST_FAIL_TE_WRITE": str(self.write_fault),
            },
        ).start()
        return self.engines[label]

    def urls(self) -> list[str]:
        return [self.engines[label].url for label in sorted(self.engines)]

    def update(self, **options: Any) -> Any:
        with self.store() as store, Coordinator(store, self.urls(), **options) as coordinator:
            return coordinator.update(MODEL, batch_bytes=BATCH)

    def statuses(self) -> dict[str, dict[str, Any]]:
        return {k: e.mooncake("GET", "status").json() for k, e in self.engines.items()}

    def assert_nothing_lost(self) -> None:
        """A plain update brings every engine to the Store's active generation."""
        self.update()
        with self.store() as store:
            active = GenerationRegistry(store, MODEL).active()
        converged = wait_converged(self.engines, self.reference, time.monotonic(), 30)
        assert set(converged.generations.values()) == {active.generation}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        self.services.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    made = World(tmp_path_factory.mktemp("update-faults"))
    try:
        made.publish()
        made.start("a", 1)
        made.start("b", 2)
        yield made
    finally:
        made.close()


def record(scenario: str, outcome: str, seconds: float, bound_s: float) -> None:
    TABLE.append((scenario, outcome, round(seconds, 2), bound_s))


@pytest.mark.parametrize("phase", ["drain", "prepare", "stage 0", "apply"])
def test_coordinator_killed(world: World, phase: str) -> None:
    """The coordinator dies (SIGKILL) after the phase while clients keep both engines
    busy: the engines staged behind that traffic and never paused (every request served,
    by the old generation); the session lease runs out, the session's staging is released
    (its advertisements leave the Store), each engine serves its old generation without a
    session again by itself, and the next coordinator gets through."""
    statuses = world.statuses()
    served = {k: s["generation"] for k, s in statuses.items()}
    old = {k: world.reference(s) for k, s in statuses.items()}
    world.publish()
    traffic = Traffic(world.engines)
    traffic.start()
    try:
        run = start_coordinator(
            world.settings,
            world.urls(),
            MODEL,
            kill_at=phase,
            session_ttl_s=SESSION_TTL_S,
            batch_bytes=BATCH,
        )
        killed_at = run.killed()
        held = world.statuses()
        converged = wait_converged(world.engines, world.reference, killed_at, LEASE_BOUND_S)
    finally:
        outputs = traffic.stop()
    assert all(s["state"] != "serving" for s in held.values()), json.dumps(held, indent=1)
    assert all(s["ready"] and not s["paused"] for s in held.values()), json.dumps(held, indent=1)
    assert converged.generations == served
    assert {label for label, _ in outputs} == set(world.engines)
    assert all(output == old[label] for label, output in outputs), outputs
    session = next(iter(held.values()))["session"]["id"]
    workers = [
        w["worker_id"]
        for e in world.engines.values()
        for w in e.mooncake("GET", "placement?boxes=false").json()["workers"]
    ]
    with world.store() as store:
        assert store.complete_sizes([advert_key(session, w) for w in workers]) == [None] * len(
            workers
        )
    outcomes = {s["last_session"]["outcome"] for s in world.statuses().values()}
    assert outcomes == {"expired"}
    world.assert_nothing_lost()
    record(
        f"coordinator killed after {phase}",
        "lease expired; old generation served",
        converged.seconds,
        LEASE_BOUND_S,
    )


@pytest.mark.parametrize(
    "phase,victim,outcome",
    [
        ("prepare", "b", "re-planned; survivor updated; restart loads active"),
        ("apply", "a", "survivor committed; restart loads active"),
    ],
)
def test_engine_killed(world: World, phase: str, victim: str, outcome: str) -> None:
    """An engine dies after the phase. After prepare, the coordinator re-plans around it (it
    was a reader) before apply; after apply, its commit fails. Either way the survivor ends
    on the new generation, and the restarted engine loads it from the Store."""
    generation = world.publish()
    killed: list[float] = []

    def progress(reached: str) -> None:
        if reached == phase and not killed:
            kill_engine(world.engines[victim])
            killed.append(time.monotonic())

    with (
        world.store() as store,
        Coordinator(store, world.urls(), progress=progress) as coordinator,
    ):
        result = coordinator.update(MODEL, batch_bytes=BATCH, min_engines=1)
    survivor = next(label for label in world.engines if label != victim)
    assert result.committed == [world.engines[survivor].url]
    assert list(result.failed) == [world.engines[victim].url]
    world.engines[victim].start()
    converged = wait_converged(world.engines, world.reference, killed[0], RESTART_BOUND_S)
    assert converged.generations == {"a": generation, "b": generation}
    world.assert_nothing_lost()
    record(f"engine killed after {phase}", outcome, converged.seconds, RESTART_BOUND_S)


def test_transfer_engine_write_fails(world: World) -> None:
    """Every TE write fails (injected in both engines): apply fails and every engine drops
    its staging and serves its old generation; live weights were never touched."""
    served = {k: s["generation"] for k, s in world.statuses().items()}
    world.publish()
    world.write_fault.touch()
    try:
        failed_at = time.monotonic()
        with pytest.raises(UpdateFailed) as failed:
            world.update()
    finally:
        world.write_fault.unlink()
    assert "apply stage 0 failed" in str(failed.value) and "batch_transfer_sync_write" in str(
        failed.value
    )
    converged = wait_converged(world.engines, world.reference, failed_at, 10)
    assert converged.generations == served
    world.assert_nothing_lost()
    record(
        "Transfer Engine write fails",
        "apply failed; old generation served",
        converged.seconds,
        10,
    )


def test_commit_response_dropped(world: World) -> None:
    """The engine commits but its response is lost: the coordinator retries, the engine
    answers the same (idempotent per session), and nothing is committed twice."""
    generation = world.publish()
    b = world.engines["b"]
    proxy = DroppingProxy(b.port)
    try:
        proxy.drop("/mooncake/commit")
        started = time.monotonic()
        urls = [world.engines["a"].url, proxy.url]
        with world.store() as store, Coordinator(store, urls) as coordinator:
            result = coordinator.update(MODEL, batch_bytes=BATCH)
    finally:
        proxy.close()
    assert proxy.dropped == ["POST /mooncake/commit HTTP/1.1"]
    assert sorted(result.committed) == sorted(urls) and result.failed == {}
    last = b.mooncake("GET", "status").json()["last_session"]
    assert (last["outcome"], last["generation"], last["id"]) == (
        "committed",
        generation,
        result.session,
    )
    converged = wait_converged(world.engines, world.reference, started, 10)
    assert set(converged.generations.values()) == {generation}
    record("commit response dropped", "retried; committed once", converged.seconds, 10)


def test_two_coordinators_race(world: World) -> None:
    """Both start their updates at once: one brings every engine up, the other holds nothing
    and undoes nothing of the winner's. The loser is refused at its first drain by the
    winner's session, or, when the winner committed after the loser's survey, by the record
    its drain names, which the engine already serves; a loser that surveyed after the
    commit finds nothing to do."""
    generation = world.publish()
    started = time.monotonic()
    together = CTX.Barrier(2)
    runs = [
        start_coordinator(world.settings, world.urls(), MODEL, together=together, batch_bytes=BATCH)
        for _ in range(2)
    ]
    outcomes = [run.outcome() for run in runs]
    winners = [i for i, (status, result) in enumerate(outcomes) if result["committed"]]
    assert len(winners) == 1, outcomes
    assert outcomes[winners[0]][0] == "ok"
    assert sorted(outcomes[winners[0]][1]["committed"]) == sorted(world.urls())
    status, loser = outcomes[1 - winners[0]]
    if status == "ok":
        assert sorted(loser["skipped"]) == sorted(world.urls()), loser
    else:
        assert loser["error"].startswith("drain: "), loser
        assert "409 session_held" in loser["error"] or "409 stale_generation" in loser["error"]
    converged = wait_converged(world.engines, world.reference, started, 30)
    assert set(converged.generations.values()) == {generation}
    record("two coordinators race", "one wins; loser holds nothing", converged.seconds, 30)


def test_master_restarted_mid_update(world: World) -> None:
    """The master restarts (state lost) once every engine prepared: apply cannot read, every
    engine serves its old generation; after a republish one update converges."""
    served = {k: s["generation"] for k, s in world.statuses().items()}
    world.publish()
    restarted: list[float] = []

    def progress(phase: str) -> None:
        if phase == "prepare" and not restarted:
            restarted.append(time.monotonic())
            world.services.master = kill_and_restart(world.services.master)

    with (
        world.store() as store,
        Coordinator(store, world.urls(), progress=progress) as coordinator,
        pytest.raises(UpdateFailed) as failed,
    ):
        coordinator.update(MODEL, batch_bytes=BATCH)
    assert "apply stage 0 failed" in str(failed.value), failed.value
    converged = wait_converged(world.engines, world.reference, restarted[0], 30)
    assert converged.generations == served
    with world.store() as store:
        wait_until_writable(store)
    assert world.publish() == 1  # a new incarnation numbers from 1
    world.assert_nothing_lost()
    record(
        "master restarted mid-update",
        "apply failed; old generation served; republish converges",
        converged.seconds,
        30,
    )
