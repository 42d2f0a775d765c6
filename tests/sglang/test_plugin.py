"""The plugin against the installed SGLang: loaded by SGLang's own plugin machinery.

SGLang 0.5.23 needs no patch: every plug point the adapter relies on is checked here
against the installed package (see ``patches/README.md``).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")

from engine_ext.sglang.ipc import MooncakeRLReqInput, MooncakeRLReqOutput
from engine_ext.sglang.loader import MooncakeModelLoader
from engine_ext.sglang.plugins import TARGETS
from mooncake_rl.errors import ConfigurationError

SGLANG_VERSION = "0.5.23"


@pytest.fixture(scope="module", autouse=True)
def plugins() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # discovers engine_ext.sglang.plugins:register via the entry point


def test_pinned_sglang_is_installed() -> None:
    from importlib.metadata import version

    assert version("sglang") == SGLANG_VERSION


def test_every_hook_is_applied_to_the_installed_sglang() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert set(TARGETS.values()) <= HookRegistry._patched
    from sglang.srt.managers.scheduler import Scheduler

    assert Scheduler.init_request_dispatcher.__wrapped__.__name__ == "init_request_dispatcher"


def test_cli_accepts_the_load_format() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(
        [
            "--model-path",
            "/models/tiny",
            "--load-format",
            "mooncake",
            "--model-loader-extra-config",
            '{"name": "tiny"}',
        ]
    )
    assert args.load_format == "mooncake"


def test_sglang_picks_the_mooncake_loader() -> None:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader

    loader = get_model_loader(
        LoadConfig(load_format="mooncake", model_loader_extra_config='{"name": "tiny"}')
    )
    assert type(loader) is MooncakeModelLoader and loader.model_name == "tiny"
    assert type(get_model_loader(LoadConfig(load_format="auto"))) is DefaultModelLoader
    with pytest.raises(ConfigurationError, match="model-loader-extra-config"):
        get_model_loader(LoadConfig(load_format="mooncake"))
    with pytest.raises(ValueError):
        LoadConfig(load_format="not-a-format")  # SGLang's own check still runs for others


def test_control_messages_round_trip_through_sglang_ipc() -> None:
    from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode
    from sglang.srt.managers.tokenizer_control_mixin import _COMMUNICATOR_SPECS

    request = MooncakeRLReqInput(engine_id="e", method="apply", args="[2, 0, []]")
    output = MooncakeRLReqOutput(replies='[{"ok": true, "rank": 0}]')
    assert msgpack_decode(msgpack_encode(request)) == request
    assert msgpack_decode(msgpack_encode(output)) == output
    assert ("mooncake_rl", MooncakeRLReqOutput) in _COMMUNICATOR_SPECS


def test_scheduler_dispatch_answers_with_every_rank_reply() -> None:
    """The AFTER hook's dispatch entry on SGLang's TypeBasedDispatcher, at TP=1; the
    scheduler is a namespace with the three attributes the glue reads."""
    import json

    import torch
    from sglang.utils import TypeBasedDispatcher

    from engine_ext.loading import mark_served
    from engine_ext.receiver import ServedRecord
    from engine_ext.sglang.plugins import _add_dispatch
    from tests.sglang.harness import publish_topology

    publish_topology(1, 0)
    model = torch.nn.Linear(2, 2)
    mark_served(model, ServedRecord(7, 9, "0123456789abcdef"), "tiny")
    scheduler = SimpleNamespace(
        _request_dispatcher=TypeBasedDispatcher([]),
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)),
        tp_cpu_group=None,
    )
    _add_dispatch(None, scheduler)
    output = scheduler._request_dispatcher(MooncakeRLReqInput(engine_id="e", method="status"))
    assert isinstance(output, MooncakeRLReqOutput)
    [reply] = json.loads(output.replies)
    assert reply == {
        "ok": True,
        "rank": 0,
        "generation": 7,
        "fence": 9,
        "incarnation": "0123456789abcdef",
        "model_name": "tiny",
    }
    [refused] = json.loads(
        scheduler._request_dispatcher(MooncakeRLReqInput(engine_id="e", method="__init__")).replies
    )
    assert not refused["ok"] and "unknown worker method" in refused["error"]


def server_args(*flags: str) -> Any:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "/models/tiny", *flags]))


def only_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """The route-security variables exactly as ``env`` sets them."""
    monkeypatch.delenv("MOONCAKE_RL_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("MOONCAKE_RL_INSECURE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    "flags,env,named",
    [
        pytest.param(
            ["--host", "0.0.0.0"],
            {},
            "refusing to serve /mooncake/* without a token: the engine's HTTP server binds "
            "'0.0.0.0'",
            id="open-beyond-loopback",
        ),
        pytest.param(
            ["--api-key", "k3y"],
            {"MOONCAKE_RL_AUTH_TOKEN": "other"},
            "SGLang's --api-key guards /mooncake/* as well",
            id="two-different-tokens",
        ),
    ],
)
def test_sglang_launch_refuses_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], env: dict[str, str], named: str
) -> None:
    """SGLang's own ``launch_server``, hooked: the refusal comes before its subprocesses."""
    from sglang.srt.entrypoints import http_server

    only_env(monkeypatch, env)
    routes_before = list(http_server.app.router.routes)
    with pytest.raises(ConfigurationError) as refused:
        http_server.launch_server(server_args(*flags))
    assert str(refused.value).startswith(named)
    assert http_server.app.router.routes == routes_before  # nothing attached


@pytest.mark.parametrize(
    "flags,env,tokens",
    [
        pytest.param([], {}, (), id="loopback-open"),
        pytest.param(["--host", "0.0.0.0", "--api-key", "k3y"], {}, ("k3y",), id="api-key"),
        pytest.param(
            ["--host", "0.0.0.0", "--api-key", "k3y"],
            {"MOONCAKE_RL_AUTH_TOKEN": "k3y"},
            ("k3y",),
            id="same-token-twice",
        ),
        pytest.param(["--host", "0.0.0.0"], {"MOONCAKE_RL_INSECURE": "1"}, (), id="insecure"),
    ],
)
def test_sglang_route_tokens(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], env: dict[str, str], tokens: tuple
) -> None:
    from engine_ext.sglang.plugins import sglang_tokens
    from mooncake_rl.settings import Settings

    only_env(monkeypatch, env)
    assert sglang_tokens(server_args(*flags), Settings()) == tokens


def test_the_untouched_weight_version_is_sglangs_default() -> None:
    """The receiver tags a loaded generation only over SGLang's own default version."""
    import msgspec
    from sglang.srt.server_args import ServerArgs

    from engine_ext.sglang.plugins import DEFAULT_VERSION

    fields = msgspec.structs.fields(ServerArgs)
    assert [f.default for f in fields if f.name == "weight_version"] == [DEFAULT_VERSION]
