"""``mooncake_store`` without a vLLM server: typed init/update infos (a bad one is refused,
naming the field, before anything changes), the engine's lifecycle over a recording worker
(refusals stage nothing; a failed commit rebuilds), the trainer's round over a recording
client against a real Store, and the plugin's registration."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from engine_ext.loading import mark_served
from engine_ext.receiver import ServedRecord
from engine_ext.vllm.native_errors import Refusal, Refused, refusal_in
from engine_ext.vllm.plugins import register_weight_transfer
from engine_ext.vllm.weight_transfer import (
    BACKEND,
    Link,
    MooncakeStoreInitInfo,
    MooncakeStoreTrainerEngine,
    MooncakeStoreTrainerInitInfo,
    MooncakeStoreUpdateInfo,
    MooncakeStoreWeightTransferEngine,
    StepFailed,
)
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.generations.publisher import PublishFailed
from mooncake_rl.generations.registry import GenerationRegistry
from mooncake_rl.plan.update import RoutingCache
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from tests.conftest import trainer_settings

MODEL = "tiny-native-config"
UPDATE = {"generation": 3, "fence": 3, "incarnation": "ab" * 8, "manifest_digest": "cd" * 32}


# -- typed infos ---------------------------------------------------------------------------
def test_init_info_defaults_and_round_trip() -> None:
    info = MooncakeStoreInitInfo.model_validate({"model": "m"})
    assert (info.mode, info.batch_bytes, info.direct_fallback) == ("direct", None, None)
    assert MooncakeStoreInitInfo.model_validate(info.model_dump(mode="json")) == info


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({}, "model"),
        ({"model": "m", "mode": "fast"}, "mode"),
        ({"model": "m", "batch_bytes": "1024"}, "batch_bytes"),  # strict: no coercion
        ({"model": "m", "batch_bytes": 0}, "batch_bytes"),
        ({"model": "m", "direct_fallback": "("}, "not a regular expression"),
        ({"model": "m", "mode": "compat", "direct_fallback": "bias"}, "mode 'direct' only"),
        ({"model": "m", "master": "evil:50051"}, "master"),  # the Store is the engine's own
        (["model", "m"], "dictionary"),
    ],
)
def test_bad_init_info_is_refused_naming_the_field(body: Any, says: str) -> None:
    engine = _engine()
    with pytest.raises(ValueError, match="invalid init_info, nothing changed") as raised:
        engine.parse_init_info(body)
    assert says in str(raised.value)
    assert engine.link is None


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"generation": 0}, "generation"),
        ({"fence": 0}, "fence"),
        ({"fence": "3"}, "fence"),
        ({"incarnation": "xyz"}, "incarnation"),
        ({"manifest_digest": "cd"}, "manifest_digest"),
        ({"ipc_handles_pickled": "gAR9lC4="}, "ipc_handles_pickled"),  # no pickle on any wire
    ],
)
def test_bad_update_info_is_refused_before_any_worker_call(
    change: dict[str, Any], says: str
) -> None:
    engine = _linked()
    with pytest.raises(ValueError, match="invalid update_info, nothing changed") as raised:
        engine.update_weights({**UPDATE, **change})
    assert says in str(raised.value)
    assert engine.updater.calls == [] and engine.staged is None


# -- the engine's lifecycle ----------------------------------------------------------------
class RecordingWorker:
    """Stands in for the worker protocol: records calls, answers as told."""

    def __init__(self, replies: dict[str, dict[str, Any]] | None = None) -> None:
        self.calls: list[str] = []
        self.replies = replies or {}

    def tp(self) -> tuple[int, int]:
        return 0, 1

    def call(self, engine_id: str, method: str, *args: Any) -> dict[str, Any]:
        self.calls.append(method)
        reply = {"ok": True, "rank": 0, "generation": 3, "worker_id": "engine-0/tp0"}
        reply["staging_watermark_bytes"] = 1 << 30
        return reply | self.replies.get(method, {})

    def store(self, engine_id: str) -> Any:
        """No Store client: routing tables stay in memory; an update that reads fails."""
        return None

    def close(self) -> None:
        self.calls.append("close")


def _engine(pipeline: int = 1) -> MooncakeStoreWeightTransferEngine:
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(pipeline_parallel_size=pipeline), model_config=None
    )
    engine = MooncakeStoreWeightTransferEngine(None, vllm_config, torch.device("cpu"), _model())
    engine.updater = RecordingWorker()  # type: ignore[assignment]
    engine._group = lambda: None  # type: ignore[method-assign]
    return engine


def _linked(**replies: dict[str, Any]) -> MooncakeStoreWeightTransferEngine:
    engine = _engine()
    engine.updater = RecordingWorker(replies)  # type: ignore[assignment]
    engine.link = Link(MooncakeStoreInitInfo(model=MODEL), "engine-0", (), 1 << 20, RoutingCache())
    return engine


def _model() -> torch.nn.Module:
    return torch.nn.Linear(4, 4)


def test_update_before_init_names_the_route_to_call() -> None:
    engine = _engine()
    marked = r"^\[mooncake_store 409 not_initialized\] .*/init_weight_transfer_engine"
    with pytest.raises(Refused, match=marked):
        engine.start_weight_update()
    with pytest.raises(Refused, match=marked):
        engine.update_weights(UPDATE)


def test_init_refuses_what_it_cannot_serve_and_keeps_nothing() -> None:
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2"):
        _engine(pipeline=2).init_transfer_engine(MooncakeStoreInitInfo(model=MODEL))
    engine = _engine()
    mark_served(engine.model, ServedRecord(1, 1, "ab" * 8), "another-model")
    with pytest.raises(ValueError, match="serves 'another-model' from the Store"):
        engine.init_transfer_engine(MooncakeStoreInitInfo(model=MODEL))
    assert engine.link is None and engine.updater.calls == []


def test_init_describes_every_rank_and_checks_the_batch() -> None:
    engine = _engine()
    with pytest.raises(ConfigurationError, match="staging watermark"):
        engine.init_transfer_engine(MooncakeStoreInitInfo(model=MODEL, batch_bytes=1 << 40))
    assert engine.link is None  # described, then refused before anything was kept
    engine.init_transfer_engine(MooncakeStoreInitInfo(model=MODEL, mode="compat"))
    assert engine.updater.calls == ["describe", "describe"]
    assert engine.link is not None and engine.link.info.mode == "compat"
    assert engine.link.batch_bytes == Settings().batch_bytes  # the engine's own default
    assert [w["rank"] for w in engine.link.placement] == [0]


def test_stale_generation_is_refused_before_the_store_or_staging() -> None:
    engine = _linked()
    mark_served(engine.model, ServedRecord(5, 5, "ab" * 8))
    engine.start_weight_update()
    with pytest.raises(StepFailed, match="not newer than the served generation 5") as failed:
        engine.update_weights(UPDATE)
    assert engine.updater.calls == [] and engine.staged is None
    assert failed.value.refusal == Refusal(409, "stale_generation")
    assert refusal_in(f"Worker failed with error '{failed.value}'") == failed.value.refusal


def test_finish_without_update_is_a_no_op() -> None:
    engine = _linked()
    engine.start_weight_update()
    engine.finish_weight_update()
    assert engine.updater.calls == []


def test_a_commit_ties_the_engine_to_the_model() -> None:
    engine = _linked()
    engine.staged = MooncakeStoreUpdateInfo.model_validate(UPDATE)
    engine.finish_weight_update()
    assert engine.updater.calls == ["commit"] and engine.staged is None
    with pytest.raises(ValueError, match=f"serves {MODEL!r} from the Store"):
        engine.init_transfer_engine(MooncakeStoreInitInfo(model="another-model"))


def test_refused_commit_aborts_and_leaves_live_weights() -> None:
    refusal = {"ok": False, "refused": {"status": 409, "code": "x"}, "error": "stages missing"}
    engine = _linked(commit=refusal)
    engine.staged = MooncakeStoreUpdateInfo.model_validate(UPDATE)
    with pytest.raises(StepFailed, match=r"^\[mooncake_store 409 x\] .*commit failed .*stages"):
        engine.finish_weight_update()
    assert engine.updater.calls == ["commit", "abort"] and engine.staged is None


def test_failed_commit_reloads_the_active_generation() -> None:
    engine = _linked(commit={"ok": False, "error": "LandingMismatch: layer 0"})
    engine.staged = MooncakeStoreUpdateInfo.model_validate(UPDATE)
    with pytest.raises(RuntimeError, match="reloaded the Store's active generation 3"):
        engine.finish_weight_update()
    assert engine.updater.calls == ["commit", "rebuild"]

    engine = _linked(
        commit={"ok": False, "error": "LandingMismatch"}, rebuild={"ok": False, "error": "down"}
    )
    engine.staged = MooncakeStoreUpdateInfo.model_validate(UPDATE)
    with pytest.raises(RuntimeError, match=r"failed too .*restart the engine"):
        engine.finish_weight_update()


def test_shutdown_drops_the_link_and_closes_the_worker() -> None:
    engine = _linked()
    engine.shutdown()
    assert engine.link is None and engine.updater.calls == ["close"]


# -- trainer side --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"mode": "fast"}, "mode"),
        ({"dtype": "int8"}, "unknown rollout dtype"),
        ({"keep": 0}, "keep"),
        ({"direct_fallback": "("}, "not a regular expression"),
    ],
)
def test_bad_trainer_init_info_is_refused(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        MooncakeStoreTrainerInitInfo(rank=0, model=MODEL, **fields)


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))

    def update_weights(self, update_info: Any) -> None:
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


class Broken(WeightSource):
    """A source that names one tensor twice: its generation cannot be announced."""

    def metadata(self) -> list[Any]:
        return []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "a.weight", torch.ones(4)
        yield "a.weight", torch.zeros(4)


def test_trainer_publishes_then_runs_one_round(master: EmbeddedMaster, holders) -> None:
    settings = trainer_settings(master, holders("native-config"), "trainer")
    info = MooncakeStoreTrainerInitInfo(rank=0, model=MODEL, dtype="float32", settings=settings)
    client = RecordingClient()
    register_weight_transfer()
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(_model())
    )
    try:
        assert client.calls == [("init", info.engine_init_info().model_dump(mode="json"))]
        trainer.send_weights()
        record = trainer.record
        assert record is not None
        with StoreClient(settings) as store:
            assert GenerationRegistry(store, MODEL).active() == record
        assert [c[0] for c in client.calls[1:]] == ["start", "update", "finish"]
        assert MooncakeStoreUpdateInfo.model_validate(client.calls[2][1]) == (
            MooncakeStoreUpdateInfo.of(record)
        )
        # The weight version, as on the coordinator's path: name:incarnation:generation.
        assert client.calls[3][1] == f"{MODEL}:{record.incarnation}:{record.generation}"

        trainer.source = Broken()
        with pytest.raises(PublishFailed):
            trainer.send_weights()
        assert len(client.calls) == 4  # no engine call for a generation never announced
    finally:
        trainer.shutdown()


def test_non_sender_ranks_only_iterate_the_source() -> None:
    iterated: list[str] = []

    class Counted(ModuleSource):
        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in super().__iter__():
                iterated.append(name)
                yield name, tensor

    client = RecordingClient()
    info = MooncakeStoreTrainerInitInfo(rank=1, model=MODEL)
    trainer = MooncakeStoreTrainerEngine.trainer_init(info, client=client, source=Counted(_model()))
    trainer.send_weights()
    assert iterated == ["weight", "bias"] and client.calls == [] and trainer.store is None
    with pytest.raises(ValueError, match="WeightSource"):
        MooncakeStoreTrainerEngine.trainer_init(info, client=client)


def test_registration_is_lazy_and_idempotent() -> None:
    register_weight_transfer()
    register_weight_transfer()
    assert WeightTransferEngineFactory._registry[BACKEND]() is MooncakeStoreWeightTransferEngine
    assert WeightTransferTrainerFactory._registry[BACKEND]() is MooncakeStoreTrainerEngine
    assert MooncakeStoreTrainerInitInfo.backend == BACKEND
