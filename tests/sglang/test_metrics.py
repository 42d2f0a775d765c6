"""The receiver's figures on SGLang's own ``/metrics`` (``--enable-metrics``).

SGLang serves ``/metrics`` in prometheus_client's multiprocess mode from a registry nobody
else can reach; the plugin's lifespan wrapper re-serves it with the receiver's collector
beside SGLang's. The shared scenarios (``test_receiver_routes``) check every figure's value
through the SGLang glue; this file checks where they are served.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("sglang")

from fastapi import FastAPI
from prometheus_client import Counter, values
from sglang.srt.utils.common import add_prometheus_middleware

from engine_ext.metrics import expose
from engine_ext.sglang.plugins import EngineRoutes
from tests.engine.test_receiver_routes import by_label, engine_sample, samples_of
from tests.sglang.test_receiver_routes import RecordingTokenizerManager


def test_the_plugin_leaves_prometheus_client_for_sglang_to_import() -> None:
    """SGLang picks prometheus_client's multiprocess mode at that package's first import,
    after it set PROMETHEUS_MULTIPROC_DIR; a plugin that imported it earlier would leave
    SGLang's own metrics out of /metrics."""
    code = (
        "import sys\n"
        "from engine_ext.sglang.plugins import register\n"
        "register()\n"
        "sys.exit(3 if 'prometheus_client' in sys.modules else 0)\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]


async def test_sglang_metrics_serve_the_receiver_beside_sglangs_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    # A metric of SGLang's, as its processes write them: into the multiprocess directory.
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    Counter("sglang_probe_requests", "one of SGLang's own metrics", registry=None).inc(3)
    manager = RecordingTokenizerManager()
    routes = EngineRoutes("engine-under-test", "m", lambda: manager)
    app = FastAPI()

    @contextlib.asynccontextmanager
    async def sglang_lifespan(app: FastAPI) -> AsyncIterator[None]:
        add_prometheus_middleware(app)  # what SGLang's lifespan does under --enable-metrics
        yield

    async with routes.with_metrics(sglang_lifespan)(app):
        await routes.receiver()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            response = await client.get("/metrics")
    assert response.status_code == 200
    samples = samples_of(response.text)
    assert samples[("sglang_probe_requests_total", ())] == 3
    assert by_label(samples, "served_generation") == {"m": 1}
    assert engine_sample(samples, "receiver_state", state="serving") == 1
    assert engine_sample(samples, "engine_store_read_bytes_total") == 0


def test_an_engine_without_metrics_is_left_as_it_is() -> None:
    """SGLang without --enable-metrics serves no /metrics: nothing is added."""
    app = FastAPI()
    assert expose(app, lambda: None) is False
    assert not [r for r in app.routes if getattr(r, "path", None) == "/metrics"]
