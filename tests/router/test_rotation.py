"""The bracket (take out -> sync -> re-admit in the ``finally``) and the serialized rotation,
against a real ``vllm-router``, a real Store and real HTTP workers. Mirrors the seed's
bracket test plan: ordering, the ``finally``, a concurrent scale-down, escalation, error
precedence, the plain path, and the probe that rejects skew before anything is touched.
The sync is the caller's step; the real update inside it is covered end to end in
``tests/engine/test_vllm_e2e.py`` and ``make load``."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
import torch

from mooncake_rl.cli import main
from mooncake_rl.coordinator import Coordinator, ReadmitFailed, UpdateFailed, UpdateResult
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.protocol import PLACEMENT_DIGEST, reported_placement
from mooncake_rl.router import EngineHeldOut, Rotation, RotationBusy, VersionSkew, open_router
from mooncake_rl.router.launch import RouterProcess
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from tests.conftest import settings_for
from tests.fleet import FakeEngines, fleet
from tests.router.conftest import HttpWorker

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def stores(master: EmbeddedMaster, holders) -> Iterator[tuple[StoreClient, StoreClient]]:
    """Two clients, like two processes: the coordinator's and a scale-down's."""
    segment = holders("router").segment
    clients = [
        StoreClient(settings_for(master, name, segment_bytes=0, local_segment=segment))
        for name in ("coordinator", "autoscaler")
    ]
    try:
        yield clients[0], clients[1]
    finally:
        for client in clients:
            client.close()


class Bracket:
    """A coordinator over the workers, with the router already holding all of them."""

    def __init__(self, router: RouterProcess, store: StoreClient, workers: list[HttpWorker]):
        self.process = router
        self.router = open_router(router.spec)
        self.urls = [w.url for w in workers]
        for url in self.urls:
            self.router.add(url)
        self.coordinator = Coordinator(store, self.urls, holder="coordinator")
        self.rotation = Rotation(self.router, store, holder="coordinator")

    def run(self, sync: Callable[[], UpdateResult], tag: str = "u1") -> UpdateResult:
        return self.coordinator.bracketed(self.rotation, tag, self.urls, sync)

    def result(self, error: str | None = None) -> UpdateResult:
        return UpdateResult("m", 2, "compat", self.urls, committed=list(self.urls), error=error)

    def close(self) -> None:
        self.coordinator.close()
        self.router.close()


@pytest.fixture
def bracket(
    start_router: Callable[[str], RouterProcess], stores, http_workers: list[HttpWorker]
) -> Iterator[Bracket]:
    made = Bracket(start_router("vllm"), stores[0], http_workers[:2])
    try:
        yield made
    finally:
        made.close()


def test_engines_leave_rotation_before_the_sync_and_all_come_back(bracket: Bracket) -> None:
    seen: dict[str, object] = {}

    def sync() -> UpdateResult:
        seen["listed"] = bracket.router.workers()
        seen["held"] = sorted(bracket.rotation.held_out())
        return bracket.result()

    result = bracket.run(sync)
    assert seen == {"listed": [], "held": sorted(bracket.urls)}
    assert sorted(bracket.router.workers()) == sorted(bracket.urls)
    assert result.rotation == {url: "readmitted" for url in bracket.urls}
    assert bracket.rotation.held_out() == {}


def test_keep_leaves_the_last_workers_in_rotation_and_takes_out_the_rest(
    bracket: Bracket,
) -> None:
    """Keep mode: a wave of every worker stays in rotation (paused engines queue what they
    are sent; with no worker the router answers 503); a wave that leaves another worker in
    rotation still goes out."""
    seen: list[tuple[list[str], list[str]]] = []

    def sync() -> UpdateResult:
        seen.append((sorted(bracket.router.workers()), sorted(bracket.rotation.held_out())))
        return bracket.result()

    for wave in (bracket.urls, bracket.urls[:1]):
        bracket.coordinator.bracketed(bracket.rotation, "u1", wave, sync, leave_last=True)
    assert seen == [(sorted(bracket.urls), []), (bracket.urls[1:], bracket.urls[:1])]
    assert sorted(bracket.router.workers()) == sorted(bracket.urls)
    assert bracket.rotation.held_out() == {}


def test_a_failed_sync_still_readmits_every_engine(bracket: Bracket) -> None:
    def sync() -> UpdateResult:
        raise UpdateFailed(bracket.result("apply stage 0 failed: injected"))

    with pytest.raises(UpdateFailed, match="apply stage 0 failed: injected") as failed:
        bracket.run(sync)
    assert sorted(bracket.router.workers()) == sorted(bracket.urls)
    assert failed.value.result.rotation == {url: "readmitted" for url in bracket.urls}


def test_an_engine_scaled_down_during_the_sync_is_not_readmitted(bracket: Bracket, stores) -> None:
    kept, retired = bracket.urls
    autoscaler = Rotation(bracket.router, stores[1], holder="autoscaler")

    def sync() -> UpdateResult:
        autoscaler.retire(retired)
        return bracket.result()

    result = bracket.run(sync)
    assert bracket.router.workers() == [kept]
    assert result.rotation == {kept: "readmitted", retired: "retired"}
    assert bracket.rotation.held_out() == {}


def test_a_readmission_failure_after_a_good_sync_escalates(bracket: Bracket) -> None:
    def sync() -> UpdateResult:
        bracket.process.stop()  # the router dies while the engines sync
        return bracket.result()

    with pytest.raises(ReadmitFailed, match="synced but out of rotation") as stuck:
        bracket.run(sync)
    assert sorted(stuck.value.stuck) == sorted(bracket.urls)
    assert all(why.startswith("failed: ") for why in stuck.value.result.rotation.values())
    assert stuck.value.result.committed == bracket.urls
    # Still recorded as held out: `mooncake-rl router list` shows them, `add --force` fixes it.
    assert sorted(bracket.rotation.held_out()) == sorted(bracket.urls)


def test_a_sync_failure_keeps_its_own_error_over_a_readmission_failure(bracket: Bracket) -> None:
    def sync() -> UpdateResult:
        bracket.process.stop()
        raise UpdateFailed(bracket.result("commit failed: injected"))

    with pytest.raises(UpdateFailed, match="commit failed: injected") as failed:
        bracket.run(sync)
    rotation = failed.value.result.rotation
    assert sorted(rotation) == sorted(bracket.urls)
    assert all(why.startswith("failed: ") for why in rotation.values())


def test_rotation_changes_are_serialized_across_clients(bracket: Bracket, stores) -> None:
    """While one process holds the rotation lock (mid take-out), another's add waits for it
    and, past its wait, gives up with nothing changed; an engine held out by an update is
    not admitted by a scale-up unless forced."""
    engine = bracket.urls[0]
    autoscaler = Rotation(bracket.router, stores[1], holder="autoscaler", lock_wait_s=0.5)

    def sync() -> UpdateResult:
        with pytest.raises(EngineHeldOut, match=r"re-admits it when it ends.*--force"):
            autoscaler.admit(engine)
        with bracket.rotation._locked(), pytest.raises(RotationBusy, match="stayed held"):
            autoscaler.admit(engine, force=True)
        assert bracket.router.workers() == []
        autoscaler.admit(engine, force=True)  # the lock is free again: forced in
        assert bracket.router.workers() == [engine]
        return bracket.result()

    result = bracket.run(sync)
    # The forced add took the entry: the update's re-admission finds it gone and skips it.
    assert result.rotation == {engine: "retired", bracket.urls[1]: "readmitted"}
    assert sorted(bracket.router.workers()) == sorted(bracket.urls)


def test_the_probe_rejects_an_engine_without_the_plugin_before_touching_anything(
    bracket: Bracket,
) -> None:
    """The HTTP workers serve completions but have no ``/mooncake`` routes: version skew."""
    with pytest.raises(VersionSkew, match=r"no engine was touched.*has no /mooncake routes"):
        bracket.coordinator.update("m", router=bracket.router)
    assert sorted(bracket.router.workers()) == sorted(bracket.urls)
    assert bracket.rotation.held_out() == {}


def test_a_placement_the_planner_refuses_takes_no_engine_out_of_rotation(
    start_router: Callable[[str], RouterProcess], stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Placements are read and planned before the bracket: an update the planner refuses
    (a box past its tensor's rows) never touches the router, and no engine drains. Before,
    every engine left rotation for the plan and came back."""
    store = stores[0]
    weights = torch.randn(8, 8, generator=torch.Generator().manual_seed(5))
    publish_local(store, "refused", [("w", weights)], dtype="float32")
    engines = FakeEngines.of(store, "refused", [("n0", 2)], 256 << 20)
    (simulated,) = engines.placements
    worker = {k: v for k, v in engines.placements[simulated][0].items() if k != PLACEMENT_DIGEST}
    worker["shards"][0]["global_offset"] = [64, 0]
    engines.placements[simulated][0] = reported_placement(worker)
    router = open_router(start_router("vllm").spec)
    changes: list[tuple[str, str]] = []
    try:
        with fleet(1, engines.handle) as urls:
            engines.urls = {urls[0]: simulated}
            router.add(urls[0])
            for name in ("add", "remove"):
                real = getattr(router, name)
                monkeypatch.setattr(
                    router, name, lambda url, _n=name, _f=real: changes.append((_n, url)) or _f(url)
                )
            with (
                Coordinator(store, urls, holder="coordinator") as coordinator,
                pytest.raises(InvariantViolation, match=r"out of bounds: tp0/w@\(64, 0\)"),
            ):
                coordinator.update("refused", mode="direct", router=router)
            assert changes == [] and router.workers() == urls
            assert "drain" not in engines.paths()
    finally:
        router.close()


def test_the_router_cli_scales_up_and_down_through_the_rotation(
    start_router: Callable[[str], RouterProcess],
    master: EmbeddedMaster,
    http_workers: list[HttpWorker],
    capsys: pytest.CaptureFixture[str],
) -> None:
    running = start_router("sglang")
    flags = ["--router", running.url, "--router-kind", "sglang"]
    flags += ["--master", master.master_address, "--metadata", master.metadata_url]
    engine = http_workers[2].url

    def cli(*args: str) -> tuple[int, str]:
        code = main(["router", *args, *flags])
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    code, out = cli("add", engine)
    assert code == 0 and json.loads(out)["workers"] == [engine]
    code, out = cli("list")
    assert code == 0 and json.loads(out) == {"workers": [engine], "held_out": {}}
    code, out = cli("remove", engine)
    assert code == 0 and json.loads(out)["workers"] == []
    code, out = cli("add")
    assert code == 2 and "`mooncake-rl router add` needs an engine URL" in out


def test_the_router_cli_sends_the_router_api_key_and_never_prints_it(
    start_router: Callable[..., RouterProcess],
    master: EmbeddedMaster,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = "router-key-d51a"
    running = start_router("sglang", api_key=key)  # its worker API answers 401 without it
    flags = ["list", "--router", running.url, "--router-kind", "sglang"]
    flags += ["--master", master.master_address, "--metadata", master.metadata_url]

    def cli(*args: str) -> tuple[int, str]:
        code = main(["router", *flags, *args])
        captured = capsys.readouterr()
        assert key not in captured.out + captured.err
        return code, captured.out + captured.err

    for refused in (cli(), cli("--router-api-key", "wrong")):
        assert refused[0] != 0 and "401" in refused[1], refused
    code, out = cli("--router-api-key", key)
    assert code == 0 and json.loads(out) == {"workers": [], "held_out": {}}
    monkeypatch.setenv("MOONCAKE_RL_ROUTER_API_KEY", key)
    code, out = cli()
    assert code == 0 and json.loads(out) == {"workers": [], "held_out": {}}


def test_cli_update_with_a_router_refuses_skew_with_exit_2(
    bracket: Bracket, master: EmbeddedMaster, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ["--master", master.master_address, "--metadata", master.metadata_url]
    engines = [flag for url in bracket.urls for flag in ("--engine", url)]
    code = main(["update", "--name", "m", *engines, "--router", bracket.process.url, *store])
    assert code == 2
    assert "version skew, no engine was touched" in capsys.readouterr().err
    assert sorted(bracket.router.workers()) == sorted(bracket.urls)
