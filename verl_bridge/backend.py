"""``mooncake_store``: a VeRL 0.9.x checkpoint engine that moves weights through Mooncake Store.

Select it with ``checkpoint_engine.backend=mooncake_store`` and
``checkpoint_engine.custom_backend_module=verl_bridge.backend``; VeRL imports this module in
the driver, in every trainer rank and in every rollout rank, and constructs the engine with
``engine_kwargs.mooncake_store`` (see :mod:`verl_bridge.config` and ``docs/verl.md``).

One sync, in the order VeRL's ``CheckpointEngineManager.update_weights`` runs it:

- ``prepare`` (all ranks) connects to the Store; ``build_topology`` (driver) mints a sync id;
  ``init_process_group`` gives each rank its role, rank and the sync id.
- ``send_weights`` (every trainer rank) publishes VeRL's per-tensor generator as the next
  immutable generation (:mod:`verl_bridge.publish`); rank 0 announces it and records the
  outcome under the sync id.
- ``receive_weights`` (every rollout rank, concurrently) yields nothing; rollout rank 0 waits
  for the trainer's outcome.
- ``finalize`` (all ranks, after every sender and receiver returned): rollout rank 0 drives
  every engine's drain/prepare/apply/commit through the coordinator, so the bytes move from
  the Store into the engines over Transfer Engine, never through VeRL's IPC path. With the
  ``transport`` key set to ``broadcast`` or ``auto``, trainer rank 0 is the broadcast's
  sender, met through a Store slot (:mod:`mooncake_rl.transport.rendezvous`). The engines
  VeRL paused before the sync (its manager aborts them and frees their KV cache first) stay
  paused through commit: VeRL resumes them once their KV cache is back
  (:mod:`engine_ext.backend`).

Why the engines are driven in ``finalize`` and not inside ``receive_weights``: VeRL's vLLM
``ServerAdapter.update_weights`` first starts ``update_weights_from_ipc`` on every engine
worker, then iterates this generator, and those workers stay blocked receiving buckets
until the generator ends. Any ``/mooncake/*`` call that needs the workers would queue behind
that RPC and never run. For the same reason ``receive_weights`` never raises: an exception
would leave the workers waiting for a last bucket that never comes.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, cast

import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWithCache
from verl.workers.rollout.utils import ensure_async_iterator

from mooncake_rl.coordinator import Coordinator, UpdateResult
from mooncake_rl.errors import InvariantViolation, MooncakeRLError
from mooncake_rl.generations.publisher import LastPublished, PublishFailed
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.metrics import UpdateMetrics
from mooncake_rl.router import open_router
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.modes import TransportMode, resolve_mode
from mooncake_rl.transport.rendezvous import SlotLauncher, close_slot, serve_slot
from verl_bridge import BACKEND_NAME
from verl_bridge.config import BridgeConfig
from verl_bridge.discovery import discover_engine_urls
from verl_bridge.manager import resume_replicas_after_failure
from verl_bridge.publish import Collective, SyncOutcome, TrainerSync, sync_key, wait_outcome

TRAINER, ROLLOUT = "trainer", "rollout"
_END = object()


class _LoopPull:
    """A blocking iterator over VeRL's weights for the publisher's worker thread.

    Each item is produced on the event loop's thread: the generator all-gathers on the
    trainer's device and process group, which belong to that thread. The worker thread only
    casts and puts, and asks for the next tensor once it is done with the previous one.
    """

    def __init__(self, source: AsyncIterator[tuple[str, torch.Tensor]]) -> None:
        self.source = source
        self.loop = asyncio.get_running_loop()

    async def _next(self) -> object:
        try:
            return await anext(self.source)
        except StopAsyncIteration:
            return _END

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            item = asyncio.run_coroutine_threadsafe(self._next(), self.loop).result()
            if item is _END:
                return
            yield cast(tuple[str, torch.Tensor], item)


resume_replicas_after_failure()  # VeRL imports this module in the driver, then syncs


@CheckpointEngineRegistry.register(BACKEND_NAME)
class MooncakeStoreCheckpointEngine(CheckpointEngineWithCache):
    """One engine per trainer rank and per rollout rank (VeRL builds them)."""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        # Trainers call new(backend, is_master=..., bucket_size=..., **kw); rollout workers
        # call new(backend, bucket_size=..., **kw). Store objects are whole tensors, so the
        # IPC bucket size has no use here.
        del bucket_size
        self.is_master = bool(is_master)
        self.config = BridgeConfig.from_kwargs(engine_kwargs)
        self._store: StoreClient | None = None
        self._coordinator: Coordinator | None = None
        self._role: str | None = None
        self._rank = 0
        self._sync_id: str | None = None
        self._record_key: str | None = None
        self._outcome: SyncOutcome | None = None
        self._receive_error: MooncakeRLError | None = None
        # This trainer rank's copy of what it last published: its next delta's base.
        self._last_published = LastPublished() if self.config.delta_every else None
        self.last_update: UpdateResult | None = None
        self.metrics = UpdateMetrics(self.config.metrics_export())

    @property
    def store(self) -> StoreClient:
        if self._store is None:
            self._store = StoreClient(self.config.settings())
        return self._store

    # -- topology ------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Connect to the Store (so bad settings fail before any weight moves)."""
        return {"is_master": self.is_master, "node": self.store.settings.node, "pid": os.getpid()}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Runs in VeRL's driver: roles, ranks and one fresh sync id shared by both sides."""
        actors, rollouts = actor_wg_world_size, rollout_world_size
        masters = [i for i, meta in enumerate(metadata[:actors]) if meta["is_master"]]
        if masters != [0]:
            raise InvariantViolation(f"exactly trainer rank 0 must be master, got {masters}")
        sync_id = uuid.uuid4().hex

        def side(role: str, size: int) -> dict[str, list[Any]]:
            return {
                "role": [role] * size,
                "rank": list(range(size)),
                "world_size": [size] * size,
                "sync_id": [sync_id] * size,
            }

        return side(TRAINER, actors), side(ROLLOUT, rollouts)

    def init_process_group(self, role: str, rank: int, world_size: int, sync_id: str) -> None:
        """No process group of our own: trainer ranks reuse torch.distributed's."""
        if role not in (TRAINER, ROLLOUT):
            raise InvariantViolation(f"unknown role {role!r}")
        if role == TRAINER:
            group = Collective()
            if (group.rank, group.world_size) != (rank, world_size):
                raise InvariantViolation(
                    f"trainer rank {rank}/{world_size} runs in torch.distributed rank "
                    f"{group.rank}/{group.world_size}: initialize the trainer's process group"
                )
            self._drop_record()  # left behind by a sync that failed before finalize
            self._record_key = sync_key(self.config.model, sync_id) if rank == 0 else None
        self._role, self._rank, self._sync_id = role, rank, sync_id
        self._outcome = self._receive_error = None

    def finalize(self) -> None:
        """After every sender and receiver returned: rollout rank 0 updates the engines.

        VeRL finalizes trainer and rollout ranks concurrently. With a transport that may
        broadcast, trainer rank 0 is the broadcast's sender: it waits here until rollout
        rank 0's coordinator posts the group to send to (or closes the sync's sender slot),
        then reads the announced generation from the Store and broadcasts it from its GPU.
        """
        try:
            if self._role == TRAINER:
                self._drop_record()
                if self._rank == 0 and self._may_broadcast():
                    assert self._sync_id is not None
                    serve_slot(
                        self.store, self._sync_id, self.store.settings, self.config.timeout_s
                    )
            elif self._role == ROLLOUT and self._rank == 0:
                try:
                    self.last_update = self.update_engines()
                finally:  # ends trainer rank 0's wait, whatever happened here
                    if self._may_broadcast():
                        assert self._sync_id is not None
                        close_slot(self.store, self._sync_id)
        finally:
            self._role = self._sync_id = None

    def _may_broadcast(self) -> bool:
        return resolve_mode(self.config.transport) in (TransportMode.BROADCAST, TransportMode.AUTO)

    # -- trainer side --------------------------------------------------------------------
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Publish the next generation; every rank returns the same metrics or raises.

        Every rank walks the whole generator even after a failure (it is collective). On
        any failure the generation is removed and the previous one stays active.
        """
        sync_id = self._expect(TRAINER)
        sync = TrainerSync(
            self.store,
            self.config.model,
            self.config.dtype,
            sync_id,
            collective=Collective(),
            global_steps=global_steps,
            timeout_s=self.config.timeout_s,
            replica_num=self.config.replica_num,
            keep=self.config.keep,
            pack_bytes=self.config.pack_bytes,
            delta=self.config.delta_policy(),
            kept=self._last_published,
        )
        source = ensure_async_iterator(weights)
        try:
            sync.begin()
            await asyncio.to_thread(sync.publish, _LoopPull(source))
        finally:
            async for _ in source:
                pass
        outcome = sync.conclude()
        if not outcome.ok:
            raise PublishFailed(outcome.error or f"sync {sync_id} failed")
        return outcome.metrics(BACKEND_NAME)

    # -- rollout side --------------------------------------------------------------------
    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yields nothing: the weights move inside the engines (see the module docstring).

        Rollout rank 0 waits here for the trainer's outcome, which ``finalize`` acts on.
        Never raises, so VeRL's IPC receivers are always released.
        """
        sync_id = self._expect(ROLLOUT)
        if self._rank == 0:
            try:
                self._outcome = await asyncio.to_thread(
                    wait_outcome, self.store, self.config.model, sync_id, self.config.timeout_s
                )
            except MooncakeRLError as error:
                self._receive_error = error
        return
        yield  # an async generator, as VeRL's server adapters iterate it

    def update_engines(self) -> UpdateResult:
        """Bring every engine to the generation the trainer announced in this sync."""
        if self._receive_error is not None:
            raise self._receive_error
        if self._outcome is None:
            raise InvariantViolation("receive_weights did not run for this sync")
        if not self._outcome.ok:
            raise PublishFailed(self._outcome.error or "the trainer did not publish")
        urls = self.config.engine_urls or tuple(discover_engine_urls())
        if self._coordinator is None or tuple(self._coordinator.engines) != urls:
            if self._coordinator is not None:
                self._coordinator.close()
            token = self.store.settings.auth_token
            self._coordinator = Coordinator(
                self.store,
                urls,
                token=token.get_secret_value() if token else None,
                session_ttl_s=self.config.session_ttl_s,
            )
        assert self._sync_id is not None
        spec = self.config.router_spec()
        router = open_router(spec) if spec else None
        try:
            return self.metrics.observe(
                lambda: self._coordinator.update(
                    self.config.model,
                    mode=self.config.mode,
                    drain_mode=self.config.drain_mode,
                    pull=self.config.pull,
                    min_engines=self.config.min_engines,
                    transport=self.config.transport,
                    # Trainer ranks on CUDA report their GPUs; CPU runs declare them in the config.
                    train_gpus=self._outcome.train_gpus or self.config.train_gpus or None,
                    # Trainer rank 0 sends (see finalize), from its own address.
                    sender=SlotLauncher(
                        self.store,
                        self._sync_id,
                        self._outcome.sender_host or self.store.settings.hostname,
                        self._outcome.sender_host_id or "",
                    ),
                    router=router,
                    max_unavailable=self.config.max_unavailable,
                )
            )
        finally:
            if router is not None:
                router.close()

    async def get_weights(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """The Store's active generation, one tensor at a time: the Store is the cache."""
        _, tensors = await asyncio.to_thread(active_weights, self.store, self.config.model)
        while (item := await asyncio.to_thread(next, tensors, None)) is not None:
            yield item

    # -- helpers -------------------------------------------------------------------------
    def _expect(self, role: str) -> str:
        if self._role != role or self._sync_id is None:
            raise InvariantViolation(
                f"this call needs init_process_group(role={role!r}, ...) first; "
                f"the engine has role {self._role!r}"
            )
        return self._sync_id

    def _drop_record(self) -> None:
        if self._record_key is not None:
            self.store.remove([self._record_key], force=True)
            self._record_key = None

    def close(self) -> None:
        """Release the HTTP client and the Store client (VeRL never calls this)."""
        if self._coordinator is not None:
            self._coordinator.close()
        if self._store is not None:
            self._store.close()
