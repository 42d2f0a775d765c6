"""SGLang engines hold serving leases: SGLang's own loader (``--load-format mooncake``)
leases the active generation under the engine's id before reading it, and the lease task
the ``launch_server`` hook adds to the server's lifespan continues that lease, follows the
served generation, and releases it when the server stops.

SGLang's real ``TokenizerManager`` needs running schedulers (a GPU), so the serving half
uses the recording stand-in of ``test_receiver_routes`` (SGLang's own request types).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from engine_ext.leases import ENGINE_ID_ENV
from engine_ext.loading import served_by
from engine_ext.receiver import ServedRecord
from engine_ext.sglang.plugins import EngineRoutes
from mooncake_rl.generations.commands import checkpoint_tensors
from mooncake_rl.generations.leases import LeaseBook, lease_book
from mooncake_rl.generations.publisher import publish_local
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from tests.conftest import settings_for
from tests.sglang.harness import load_model, publish_topology, settings_env, sglang_model_dir
from tests.sglang.test_receiver_routes import RecordingTokenizerManager

MODEL = "tiny-sglang-lease"
ENGINE = "sglang-lease-engine"


async def _lease_of(
    book: LeaseBook, generation: int, other_than: float = 0.0, timeout_s: float = 20.0
):
    """The engine's live lease on ``generation``, once one not expiring at ``other_than``."""
    deadline = time.monotonic() + timeout_s
    while True:
        lease = (await asyncio.to_thread(book.leases)).get(ENGINE)
        if (
            lease is not None
            and lease.generation == generation
            and lease.live(time.time())
            and lease.expires_at != other_than
        ):
            return lease
        assert time.monotonic() < deadline, f"no live lease on {generation}: {lease}"
        await asyncio.sleep(0.1)


def test_sglang_engine_leases_what_it_loads_and_serves(
    master: EmbeddedMaster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(master, "node-sglang-lease")
    for key, value in settings_env(settings_for(master, "node-sglang-lease")).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MOONCAKE_RL_LEASE_TTL_S", "3")
    monkeypatch.setenv(ENGINE_ID_ENV, ENGINE)  # what the launch_server hook exports
    with StoreClient(settings) as store:
        directory = sglang_model_dir(tmp_path / "model")
        generation = publish_local(
            store, MODEL, checkpoint_tensors(directory), dtype="float32"
        ).generation
        book = lease_book(store, MODEL)

        # Load: SGLang picks our loader, which leases before it reads.
        from sglang.srt.plugins import load_plugins

        load_plugins()
        publish_topology(1, 0)
        model = load_model(directory, "mooncake", {"name": MODEL})
        assert served_by(model)[0].generation == generation
        loaded = book.leases()[ENGINE]
        assert loaded.generation == generation and loaded.expires_at > time.time() + 3

        # Serve: the lifespan task continues the same lease, follows a commit, releases.
        manager = RecordingTokenizerManager()  # its schedulers report generation 1
        assert generation == 1
        routes = EngineRoutes(ENGINE, MODEL, lambda: manager)

        @contextlib.asynccontextmanager
        async def sglang_lifespan(app: object):
            yield None

        async def serve() -> None:
            async with routes.with_leases(sglang_lifespan)(None):
                await _lease_of(book, 1, other_than=loaded.expires_at)  # the server renewed
                receiver = await routes.receiver()
                receiver.served = ServedRecord(2, 2, receiver.served.incarnation)  # committed
                await _lease_of(book, 2)
            assert ENGINE not in await asyncio.to_thread(book.leases)

        asyncio.run(serve())
