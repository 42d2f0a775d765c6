"""Families beyond the tiny Llama, through real vLLM engines (the smoke of ``make models``).

A tied-embedding Qwen2 (qkv bias and a tied ``lm_head``) and a Qwen3-MoE (fused experts):
each starts from the Store, is updated in compat then direct mode, and after each update
serves exactly what plain vLLM serves from that generation's local directory. The last test
causes a bad landing (vLLM's own stale CPU expert prepack, put back) and checks that the
post-landing check refuses to serve it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from bench.models import run_family
from engine_ext.vllm.server import VllmServer
from mooncake_rl.coordinator import Coordinator, UpdateFailed
from mooncake_rl.generations.commands import publish_checkpoint
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import make_tiny, perturbed_copy
from tests.conftest import settings_for

pytestmark = pytest.mark.timeout(900)
FAULTS = Path(__file__).parent / "faults"


@pytest.fixture(scope="module")
def store(master: EmbeddedMaster, holders):
    settings = settings_for(
        master, "coordinator", segment_bytes=0, local_segment=holders("families").segment
    )
    with StoreClient(settings) as client:
        yield settings, client


@pytest.mark.parametrize(("family", "tied"), [("qwen2", True), ("qwen3_moe", False)])
def test_compat_and_direct_serve_exactly_the_generation(
    family: str, tied: bool, store, tmp_path: Path
) -> None:
    settings, client = store
    run = run_family(family, tied, 1, tmp_path, settings, client)
    assert run.error is None
    for mode in (run.compat, run.direct):
        assert mode.error is None
        assert mode.outputs == mode.reference
        assert mode.checked > 0 and mode.unchecked == 0
    # Direct mode receives exactly the engine's parameter bytes; compat reads the model once.
    assert run.direct.received_bytes == run.direct.store_read_bytes
    assert run.compat.store_read_bytes > 0


def test_a_landing_the_check_rejects_is_never_served(store, tmp_path: Path) -> None:
    settings, client = store
    g1 = make_tiny("qwen3_moe", tmp_path / "g1")
    g2 = perturbed_copy(g1, tmp_path / "g2", 1)
    publish_checkpoint(client, "stale-experts", g1, "float32")
    pythonpath = os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))
    engine = VllmServer(
        g1,
        settings,
        name="stale-experts",
        log_dir=tmp_path / "logs",
        token="t",
        extra_env={"PYTHONPATH": pythonpath},
    )
    with engine:
        before = engine.complete([5, 6, 7, 8, 9])
        publish_checkpoint(client, "stale-experts", g2, "float32")
        with (
            Coordinator(client, [engine.url], token="t") as coordinator,
            pytest.raises(UpdateFailed) as failed,
        ):
            coordinator.update("stale-experts", mode="compat", batch_bytes=64 << 10)
        assert "did not land intact" in str(failed.value)
        assert "mlp.experts" in str(failed.value)
        assert failed.value.result.rebuild == [engine.url]
        status = engine.mooncake("GET", "status").json()
        assert (status["state"], status["generation"]) == ("broken", 1)
        assert "did not land intact" in status["last_error"]
        # Broken engines refuse to resume: only a rebuild from the Store serves again.
        assert engine.mooncake("POST", "resume").status_code == 409
        assert before  # it served generation 1 before the update
