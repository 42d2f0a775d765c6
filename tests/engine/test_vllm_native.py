"""vLLM's own RL routes and trainer factory, with ``--weight-transfer-config
'{"backend": "mooncake_store"}'``, against one real vLLM CPU engine (TP1, eager).

The engine starts from disk with no Mooncake route or extension (``VLLM_PLUGINS`` unset:
only the general plugin); the trainer publishes through the Store and lands through
``/init_weight_transfer_engine`` ... ``/finish_weight_update``. Greedy output must equal
transformers' for the published weights; refused infos must leave the engine as it was.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from engine_ext.vllm.plugins import register_weight_transfer
from engine_ext.vllm.server import VllmServer
from engine_ext.vllm.weight_transfer import MooncakeStoreTrainerInitInfo, MooncakeStoreUpdateInfo
from mooncake_rl.generations.keys import advert_key
from mooncake_rl.generations.registry import ActiveRecord
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import PROMPT, hf_greedy, make_tiny_llama, perturbed_copy
from tests.conftest import settings_for
from tests.engine.streams import TokenStream, generate

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-native"
ENGINE_ID = "native-engine"


@dataclass
class Native:
    server: VllmServer
    settings: Settings
    dirs: list[Path]
    refs: list[list[int]]
    sent: list[ActiveRecord] = field(default_factory=list)

    def send(self, index: int, mode: str) -> ActiveRecord:
        """One trainer round through vLLM's trainer factory and HTTP client."""
        from transformers import AutoModelForCausalLM

        register_weight_transfer()  # a trainer runs no vLLM plugin loader
        policy = AutoModelForCausalLM.from_pretrained(self.dirs[index], dtype=torch.float32)
        info = MooncakeStoreTrainerInitInfo(
            rank=0, model=MODEL, dtype="float32", mode=mode, settings=self.settings
        )
        trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(self.server.url), source=ModuleSource(policy)
        )
        try:
            trainer.send_weights()
        finally:
            trainer.shutdown()
        assert trainer.record is not None
        self.sent.append(trainer.record)
        return trainer.record

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.post(f"{self.server.url}/{path}", json=body, timeout=120)


@pytest.fixture(scope="module")
def native(
    master: EmbeddedMaster, holders, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Native]:
    root = tmp_path_factory.mktemp("native")
    settings = settings_for(
        master, "native", segment_bytes=0, local_segment=holders("native-store").segment
    )
    dirs = [make_tiny_llama(root / "g1")]
    dirs.append(perturbed_copy(dirs[0], root / "g2", seed=1))
    server = VllmServer(
        dirs[0],
        settings,
        load_from_store=False,
        extension=False,
        routes=False,
        log_dir=root / "logs",
        # vLLM mounts its RL routes only with VLLM_SERVER_DEV_MODE.
        extra_env={"VLLM_SERVER_DEV_MODE": "1", "MOONCAKE_RL_ENGINE_ID": ENGINE_ID},
        extra_args=[
            "--enforce-eager",
            "--enable-scale-out",  # /inference/v1/generate, with weight_versions spans
            "--weight-transfer-config",
            json.dumps({"backend": "mooncake_store"}),
            "--middleware",  # refusals answer 409/422 with a code, not vLLM's 500
            "engine_ext.vllm.native_errors.RefusalStatus",
        ],
    )
    with server:
        yield Native(server, settings, dirs, [hf_greedy(d) for d in dirs])


def test_trainer_factory_lands_generations_through_native_routes(native: Native) -> None:
    assert native.server.complete(PROMPT) == native.refs[0]
    for index, mode in ((1, "direct"), (0, "compat")):  # to the next policy and back
        record = native.send(index, mode)
        assert native.server.complete(PROMPT) == native.refs[index], mode
        version = httpx.get(f"{native.server.url}/weight_info").json()["weight_version"]
        assert version == f"{MODEL}:{record.incarnation}:{record.generation}"


def test_refused_infos_change_nothing(native: Native) -> None:
    served = native.sent[-1] if native.sent else native.send(1, "direct")
    before = native.server.complete(PROMPT)

    # The Store is the engine's own: a caller cannot point it at another master.
    redirect = {"model": MODEL, "master": "10.0.0.1:50051"}
    bad_init = native.post("init_weight_transfer_engine", {"init_info": redirect})
    assert (bad_init.status_code, bad_init.json()["error"]) == (422, "invalid_request")
    assert "invalid init_info" in bad_init.text and "master" in bad_init.text

    forged = {"generation": 99, "fence": 99, "incarnation": "0" * 16, "manifest_digest": "0" * 64}
    stale = MooncakeStoreUpdateInfo.of(served).model_dump(mode="json")
    for update_info, status, code, says in (
        ({**forged, "pickled": "gAR9lC4="}, 422, "invalid_request", "invalid update_info"),
        ({**forged, "fence": "99"}, 422, "invalid_request", "invalid update_info"),
        (forged, 409, "unknown_generation", "not an active record"),
        (stale, 409, "stale_generation", "is not newer than the served generation"),
    ):
        assert native.post("start_weight_update").status_code == 200
        refused = native.post("update_weights", {"update_info": update_info})
        assert (refused.status_code, refused.json()["error"]) == (status, code), refused.text
        assert says in refused.json()["detail"], refused.text
        # vLLM closed the round on the failure; the engine serves what it served.
        assert native.server.complete(PROMPT) == before

    # Still updatable after the refusals.
    index = 1 - native.refs.index(before)
    native.send(index, "direct")
    assert native.server.complete(PROMPT) == native.refs[index]


def test_the_next_session_sweeps_a_crashed_workers_advertisement(native: Native) -> None:
    """A worker that crashed mid-session never withdrew its advertisement; the next session
    of that worker sweeps it, and another worker's stays."""
    left_over = advert_key(uuid.uuid4().hex, f"{ENGINE_ID}/tp0")
    others = advert_key(uuid.uuid4().hex, "another-engine/tp0")
    store = StoreClient(native.settings)
    try:
        for key in (left_over, others):
            store.upsert_bytes(key, b"{}")  # written, never removed: as a crash leaves it
        index = 1 - native.refs.index(native.server.complete(PROMPT))
        native.send(index, "direct")
        assert store.exists([left_over, others]) == [False, True]
    finally:
        store.remove([left_over, others], force=True)
        store.close()


def test_keep_through_native_routes_resumes_requests_on_the_new_weights(native: Native) -> None:
    """vLLM's own keep pause around a native send, then the prefix reset the docs name: a
    request streaming across it finishes, its spans cut from the old version to the new,
    and its tokens after the cut are what the new weights give for its prefix."""
    max_tokens = 200
    served = native.server.complete(PROMPT)
    index = 1 - native.refs.index(served)
    old_version = httpx.get(f"{native.server.url}/weight_info").json()["weight_version"]
    stream = TokenStream(native.server, PROMPT, max_tokens)
    stream.start()
    assert stream.started_tokens.wait(120)
    assert native.post("pause?mode=keep").status_code == 200
    record = native.send(index, "direct")
    reset = native.post("reset_prefix_cache?reset_running_requests=true")
    assert reset.status_code == 200 and reset.json() == {"success": True}
    assert native.post("resume").status_code == 200
    stream.join(300)
    assert stream.final["finish_reason"] == "length" and len(stream.tokens) == max_tokens
    spans = stream.final["weight_versions"]
    new_version = f"{MODEL}:{record.incarnation}:{record.generation}"
    assert [s["version"] for s in spans] == [old_version, new_version], spans
    cut = spans[0]["end"]
    assert (spans[0]["start"], spans[1]["start"], spans[1]["end"]) == (0, cut, max_tokens)
    assert 8 <= cut < max_tokens
    after = generate(native.server, PROMPT + stream.tokens[:cut], max_tokens - cut)
    assert stream.tokens[cut:] == after
    assert native.server.complete(PROMPT) == native.refs[index]
