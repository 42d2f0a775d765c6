"""The pipeline batch reaches the plan: ``MOONCAKE_RL_BATCH_BYTES`` is the coordinator's
default, ``mooncake-rl update --batch-bytes`` and ``update(batch_bytes=...)`` override it,
and an engine worker whose staging watermark cannot hold two of the plan's batches is
refused before any engine is drained.

The engines are loopback HTTP servers (``tests.fleet``) answering from simulated placements;
the Store, the published generation and the planner are real, and what the plan made of the
batch is read back from the prepare bodies the engines received.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from mooncake_rl.apply.wire import decode_slice
from mooncake_rl.cli import build_parser, main
from mooncake_rl.coordinator import Coordinator, UpdateResult
from mooncake_rl.errors import ConfigurationError, InvariantViolation
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.plan.update import UpdatePlan
from mooncake_rl.protocol import PLACEMENT_DIGEST, PROTOCOL_VERSION, reported_placement
from mooncake_rl.router import VersionSkew
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from tests.conftest import trainer_settings
from tests.fleet import FakeEngines, fleet
from verl_bridge.config import BridgeConfig

MODEL = "batch-bytes"
CLUSTER = [("node-a", 2), ("node-b", 2)]
WATERMARK = 256 << 20


@pytest.fixture(scope="module")
def model_bytes(master, holders) -> int:
    """One generation of a float32 model (about 70 KB) in the Store; its size in bytes."""
    generator = torch.Generator().manual_seed(3)
    tensors = [(f"w{i}", torch.randn(64, 64, generator=generator)) for i in range(4)]
    tensors.append(("bias", torch.randn(256, generator=generator)))
    with StoreClient(trainer_settings(master, holders("batch-bytes"), "trainer")) as store:
        publish_local(store, MODEL, tensors, dtype="float32")
    return sum(t.nbytes for _, t in tensors)


@pytest.fixture
def coordinator_settings(master, holders, model_bytes: int) -> Settings:
    return trainer_settings(master, holders("batch-bytes"), "coordinator")


def engines_for(settings: Settings, watermark: int = WATERMARK) -> FakeEngines:
    with StoreClient(settings) as store:
        return FakeEngines.of(store, MODEL, CLUSTER, watermark)


@contextlib.contextmanager
def coordinating(settings: Settings, engines: FakeEngines, **options: Any) -> Iterator[Coordinator]:
    simulated = sorted(engines.placements)
    with (
        fleet(len(simulated), engines.handle) as urls,
        StoreClient(settings) as store,
        Coordinator(store, urls, **options) as coord,
    ):
        engines.urls = dict(zip(urls, simulated, strict=True))
        yield coord


def test_the_settings_batch_is_the_plans_default(
    coordinator_settings: Settings, monkeypatch: pytest.MonkeyPatch, model_bytes: int
) -> None:
    values = coordinator_settings.model_dump()
    del values["batch_bytes"]
    monkeypatch.setenv("MOONCAKE_RL_BATCH_BYTES", "8192")
    settings = Settings(**values)
    assert settings.batch_bytes == 8192
    engines = engines_for(settings)
    with coordinating(settings, engines) as coordinator:
        result = coordinator.update(MODEL, mode="direct")
    assert len(result.committed) == 2
    batches = engines.batches()
    assert max(batches) <= 8192 and sum(batches) == model_bytes and len(batches) > 4


def test_an_explicit_batch_wins_over_the_settings(
    coordinator_settings: Settings, model_bytes: int
) -> None:
    assert coordinator_settings.batch_bytes == 1 << 20
    engines = engines_for(coordinator_settings)
    with coordinating(coordinator_settings, engines) as coordinator:
        coordinator.update(MODEL, mode="direct", batch_bytes=4096)
    batches = engines.batches()
    assert max(batches) <= 4096 and sum(batches) == model_bytes and len(batches) > 8


def test_a_watermark_that_cannot_hold_two_batches_is_refused_before_any_drain(
    coordinator_settings: Settings,
) -> None:
    engines = engines_for(coordinator_settings, watermark=2 * 8192 - 1)
    with (
        coordinating(coordinator_settings, engines) as coordinator,
        pytest.raises(ConfigurationError) as refused,
    ):
        coordinator.update(MODEL, mode="direct", batch_bytes=8192)
    message = str(refused.value)
    assert "batches of 8192 bytes" in message and "16384" in message and "16383" in message
    assert "MOONCAKE_RL_STAGING_WATERMARK_BYTES" in message and "--batch-bytes" in message
    assert engines.paths() == {"placement?boxes=false"}
    # Half the batch fits the same watermark.
    with coordinating(coordinator_settings, engines) as coordinator:
        assert coordinator.update(MODEL, mode="direct", batch_bytes=4096).committed


UPDATE = ["update", "--name", MODEL, "--engine", "http://e"]


@pytest.mark.parametrize(("flag", "size"), [("4096", 4096), ("64KiB", 65536), ("1.5MiB", 3 << 19)])
def test_the_cli_parses_batch_bytes(flag: str, size: int) -> None:
    assert build_parser().parse_args([*UPDATE, "--batch-bytes", flag]).batch_bytes == size
    assert build_parser().parse_args(UPDATE).batch_bytes is None


@pytest.mark.parametrize("flag", ["0", "-1MiB", "lots"])
def test_the_cli_refuses_a_batch_that_is_no_size(flag: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*UPDATE, f"--batch-bytes={flag}"])
    assert exited.value.code == 2 and "--batch-bytes" in capsys.readouterr().err


def test_the_cli_hands_its_batch_to_the_update(master, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def update(self: Coordinator, model: str, **options: Any) -> UpdateResult:
        seen.update(options)
        return UpdateResult(model, 1, "direct", list(self.engines))

    monkeypatch.setattr(Coordinator, "update", update)
    argv = [*UPDATE, "--master", master.master_address, "--metadata", master.metadata_url]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main([*argv, "--batch-bytes", "2MiB"]) == 0
        assert seen["batch_bytes"] == 2 << 20
        assert main(argv) == 0
    assert seen["batch_bytes"] is None  # the coordinator's settings decide


def test_the_verl_bridge_config_takes_a_batch_for_its_store_settings() -> None:
    assert (
        BridgeConfig.from_kwargs({"model": "m", "batch_bytes": 8192}).settings().batch_bytes == 8192
    )
    default = BridgeConfig.from_kwargs({"model": "m"}).settings().batch_bytes
    assert default == Settings().batch_bytes
    for bad in (0, -1, "8MiB", 1.5):
        with pytest.raises(ConfigurationError, match="batch_bytes must be a positive integer"):
            BridgeConfig.from_kwargs({"model": "m", "batch_bytes": bad})


def test_an_update_reads_boxes_only_for_a_plan_it_does_not_hold(
    coordinator_settings: Settings,
) -> None:
    """Placements are read without boxes; the first update reads the boxes of one of the two
    identical engines, before any drain (its plan is new), and the next one, whose plan it
    holds, reads none."""
    engines = engines_for(coordinator_settings)
    with coordinating(coordinator_settings, engines) as coordinator:
        first = coordinator.update(MODEL, mode="direct", batch_bytes=4096)
        calls = len(engines.calls)
        second = coordinator.update(MODEL, mode="direct", batch_bytes=4096)
    assert len(first.described) == 1 and second.described == []
    assert len(first.committed) == len(second.committed) == 2
    assert (coordinator.cache.misses, coordinator.cache.hits) == (1, 1)
    routes = [route for _, route, _ in engines.calls]
    assert routes[:3] == ["placement?boxes=false"] * 2 + ["placement"]
    assert routes[3:5] == ["drain"] * 2
    assert "placement" not in routes[calls:] and "placement?boxes=false" in routes[calls:]


def test_boxes_are_read_with_the_collector_paused(coordinator_settings: Settings) -> None:
    """A 1T MoE engine's boxes parse into some 200k dicts; read with the cyclic collector
    running, they set off passes over the coordinator's whole heap (1.8 s instead of 0.4 s
    per reply). The read with boxes holds the planner's mode; the others do not."""
    engines = engines_for(coordinator_settings)
    collecting: dict[str, list[bool]] = {}
    handle = engines.handle

    async def observed(url: str, path: str, content: bytes, headers: object) -> tuple[int, Any]:
        collecting.setdefault(path.removeprefix("/mooncake/"), []).append(gc.isenabled())
        return await handle(url, path, content, headers)

    engines.handle = observed  # type: ignore[method-assign]
    assert gc.isenabled()
    with coordinating(coordinator_settings, engines) as coordinator:
        result = coordinator.update(MODEL, mode="direct", batch_bytes=4096)
    assert len(result.committed) == 2 and gc.isenabled()
    assert collecting["placement"] == [False]  # one of the two identical engines
    assert collecting["placement?boxes=false"] == [True, True]
    assert all(collecting["drain"]) and all(collecting["prepare"])


def test_the_plan_is_made_before_any_engine_drains(coordinator_settings: Settings) -> None:
    """A cold plan takes seconds for a 1T MoE: engines go on serving while it runs, and the
    plan after the drain is the same one (no second lookup, no second plan)."""
    engines = engines_for(coordinator_settings)
    routes_at: dict[str, list[str]] = {}

    def progress(phase: str) -> None:
        routes_at.setdefault(phase, [route for _, route, _ in engines.calls])

    with coordinating(coordinator_settings, engines, progress=progress) as coordinator:
        result = coordinator.update(MODEL, mode="direct", batch_bytes=4096)
    assert len(result.committed) == 2
    assert routes_at["plan"] == ["placement?boxes=false"] * 2 + ["placement"]
    assert "drain" in routes_at["drain"]
    assert list(result.phase_seconds)[:5] == ["placement", "check", "plan", "bodies", "drain"]
    assert (coordinator.cache.misses, coordinator.cache.hits) == (1, 0)


def test_prepare_bodies_are_encoded_before_the_drain_and_sent_as_planned(
    coordinator_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Encoding a 1T MoE's slices takes the coordinator seconds per engine: each engine's is
    made once, while every engine serves, and is what that engine's prepare receives."""
    engines = engines_for(coordinator_settings)
    made: list[tuple[str, list[str], dict[str, Any]]] = []
    engine_workers = UpdatePlan.engine_workers

    def spied(plan: UpdatePlan, url: str, checksums: Any = None) -> dict[str, Any]:
        workers = engine_workers(plan, url, checksums)
        made.append((url, [route for _, route, _ in engines.calls], workers))
        return workers

    monkeypatch.setattr(UpdatePlan, "engine_workers", spied)
    with coordinating(coordinator_settings, engines) as coordinator:
        result = coordinator.update(MODEL, mode="direct", batch_bytes=4096)
    assert sorted(result.committed) == sorted(url for url, _, _ in made) == sorted(engines.urls)
    assert all("drain" not in routes for _, routes, _ in made)
    prepared = {url: body for url, route, body in engines.calls if route == "prepare"}
    for url, _, workers in made:
        assert prepared[url]["workers"] == json.loads(json.dumps(workers))
        assert prepared[url]["session"] == result.session and prepared[url]["stages"] == 2


def test_an_engine_lost_at_prepare_gets_the_survivors_a_new_plans_bodies(
    coordinator_settings: Settings,
) -> None:
    """The bodies encoded before the drain belong to the plan for every target; once an
    engine fails its prepare, the survivor is prepared again from the re-plan, which pushes
    nothing to the lost engine."""
    engines = engines_for(coordinator_settings)
    handle = engines.handle

    async def losing(url: str, path: str, content: bytes, headers: Any) -> tuple[int, Any]:
        status, reply = await handle(url, path, content, headers)
        if path == "/mooncake/prepare" and engines.urls[url] == lost:
            return 500, {"detail": {"code": "prepare_failed", "message": "injected"}}
        return status, reply

    lost = sorted(engines.placements)[0]
    engines.handle = losing  # type: ignore[method-assign]
    with coordinating(coordinator_settings, engines) as coordinator:
        result = coordinator.update(MODEL, mode="direct", batch_bytes=4096, min_engines=1)
    [survivor] = result.committed
    lost_workers = {w["worker_id"] for w in engines.placements[lost]}
    pushed_to = [
        {
            push.peer
            for worker in body["workers"].values()
            for stage in decode_slice(worker["slice"]).stages
            for batch in stage
            for push in batch.pushes
        }
        for url, route, body in engines.calls
        if route == "prepare" and url == survivor
    ]
    assert len(pushed_to) == 2
    assert pushed_to[0] & lost_workers and not pushed_to[1] & lost_workers


def test_an_engine_of_another_protocol_is_refused_before_any_drain(
    coordinator_settings: Settings,
) -> None:
    """Without a router (whose probe checks every engine first) the survey checks the
    versions its placement replies report: nothing drains, and the engine is named."""
    engines = engines_for(coordinator_settings)
    engines.protocol[sorted(engines.placements)[1]] = PROTOCOL_VERSION + 1
    with (
        coordinating(coordinator_settings, engines) as coordinator,
        pytest.raises(VersionSkew, match=f"speaks protocol {PROTOCOL_VERSION + 1}"),
    ):
        coordinator.update(MODEL, mode="direct", batch_bytes=4096)
    assert engines.paths() == {"placement?boxes=false"}


def test_a_placement_the_planner_refuses_drains_no_engine(coordinator_settings: Settings) -> None:
    """A box outside its tensor (a broken discovery) is refused by name while every engine
    still serves: nothing was drained, nothing needs releasing."""
    engines = engines_for(coordinator_settings)
    first = sorted(engines.placements)[0]
    worker = {k: v for k, v in engines.placements[first][0].items() if k != PLACEMENT_DIGEST}
    box = worker["shards"][0]
    box["global_offset"] = [64 + offset for offset in box["global_offset"]]
    engines.placements[first][0] = reported_placement(worker)
    with (
        coordinating(coordinator_settings, engines) as coordinator,
        pytest.raises(InvariantViolation, match=box["tensor"]),
    ):
        coordinator.update(MODEL, mode="direct", batch_bytes=4096)
    assert engines.paths() == {"placement?boxes=false", "placement"}
