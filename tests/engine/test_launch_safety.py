"""Launches the /mooncake/* routes refuse, and the guard they accept, on real vLLM servers.

Two server starts, each serving a tiny Llama from disk (no Store is needed: a refused
launch stops before any worker call, and the accepted one only reads its status). The
refusal of an open route beyond loopback is the same raise in the same hook; its decision
is tested without a server (``tests/engine/test_route_guard.py``), which keeps ``make test``
inside its time budget; so is the missing worker extension, whose real launch (47 s) runs
under ``make faults``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

pytest.importorskip("vllm")

from engine_ext.vllm.server import VllmServer
from mooncake_rl.errors import ServiceError
from mooncake_rl.settings import Settings
from mooncake_rl.tiny_model import make_tiny_llama

pytestmark = pytest.mark.timeout(600)
API_KEY = "k3y"
EAGER = ["--enforce-eager"]  # no graph compilation: the checks come after model load


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("launch") / "model")


@pytest.fixture(autouse=True)
def no_guard_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers inherit this environment: only what a test gives them may guard them."""
    for name in ("MOONCAKE_RL_AUTH_TOKEN", "MOONCAKE_RL_INSECURE", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "launch,named",
    [
        pytest.param(
            {"extension": False},
            "VLLM_PLUGINS=mooncake needs the worker extension: add "
            "--worker-extension-cls mooncake_rl.Ext",
            id="no-worker-extension",
            # make faults: make test keeps the same refusal without a server
            # (tests/engine/test_route_guard.py::test_vllm_needs_the_worker_extension)
            marks=pytest.mark.faults,
        ),
    ],
)
def test_misconfigured_launch_stops_at_startup(
    model_dir: Path, tmp_path: Path, launch: dict, named: str
) -> None:
    server = VllmServer(
        model_dir, Settings(), load_from_store=False, log_dir=tmp_path, extra_args=EAGER, **launch
    )
    try:
        with pytest.raises(ServiceError, match=r"vLLM server: .* exited early"):
            server.start()
    finally:
        server.stop()
    log = server.log_path.read_text()
    assert f"mooncake_rl.errors.ConfigurationError: {named}" in log
    assert "has no attribute 'mooncake_call'" not in log  # stopped before any worker call


def test_api_key_guards_the_routes_beyond_loopback(model_dir: Path, tmp_path: Path) -> None:
    with VllmServer(
        model_dir,
        Settings(),
        load_from_store=False,
        log_dir=tmp_path,
        host="0.0.0.0",
        extra_args=[*EAGER, "--api-key", API_KEY],
        extra_env={"MOONCAKE_RL_MAX_BODY_BYTES": "1024"},
    ) as server:
        status = f"{server.url}/mooncake/status"
        for headers in ({}, {"authorization": "Bearer wrong"}):
            refused = httpx.get(status, headers=headers, timeout=30)
            assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
        key = {"authorization": f"Bearer {API_KEY}"}
        served = httpx.get(status, headers=key, timeout=30)
        assert served.status_code == 200
        assert (served.json()["state"], served.json()["generation"]) == ("serving", 0)

        too_large = httpx.post(
            f"{server.url}/mooncake/drain", content=b" " * 1025, headers=key, timeout=30
        )
        assert too_large.status_code == 413 and too_large.json()["error"] == "body_too_large"
        assert "1024 bytes" in too_large.json()["detail"]
        assert httpx.get(status, headers=key, timeout=30).json()["state"] == "serving"
    assert "bearer token crosses plain HTTP on 0.0.0.0" in server.log_path.read_text()
