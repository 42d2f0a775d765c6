"""``mooncake_store``: this project as a backend of vLLM's native weight-transfer API.

Whoever already drives vLLM's RL routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) or its
``WeightTransferTrainerFactory`` selects it with ``--weight-transfer-config
'{"backend": "mooncake_store"}'``; the general plugin registers both sides
(:func:`engine_ext.vllm.plugins.register_weight_transfer`).

- Trainer (:class:`MooncakeStoreTrainerEngine`): ``send_weights`` publishes the source as the
  model's next generation (one copy per tensor in the Store, announced only once complete),
  then runs one update round whose ``update_info`` names that generation's active record.
- Engine (:class:`MooncakeStoreWeightTransferEngine`): every worker runs the worker protocol
  of the ``/mooncake/*`` routes (:class:`engine_ext.worker.UpdateWorker`). Init describes the
  worker's placement once. ``update_weights`` checks the record against the engine's own
  Store, plans (the routing table is cached by layout, also in the Store: the first update
  plans, later ones replay it; each worker lands only its own slice), prepares and applies:
  staging only, live weights untouched. ``finish_weight_update`` commits: lands through
  vLLM's layerwise reload and checks the landing. A failed commit reloads the Store's active
  generation.

TP ranks agree after every step (JSON over the TP group's CPU group, never pickle): when one
rank fails, every rank aborts, so none waits for a peer that gave up. What this path gives
up against ``mooncake-rl update`` is in ``docs/vllm-native.md``.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, Self, TypeVar

import torch
from pydantic import BaseModel, Field, field_validator, model_validator
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)

from engine_ext.admission import RequestRefused, check_generation, parsed
from engine_ext.leases import loader_engine_id
from engine_ext.loading import mark_served, served_by, served_record
from engine_ext.ranks import gather_json
from engine_ext.served import weight_version
from engine_ext.vllm.native_errors import BACKEND, Refusal, Refused
from engine_ext.vllm.worker import VllmUpdateWorker
from mooncake_rl.coordinator import advertised_peers
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import publish_format
from mooncake_rl.generations.publisher import DEFAULT_KEEP, publish_local
from mooncake_rl.generations.registry import ActiveRecord, GenerationRegistry
from mooncake_rl.plan.update import RoutingCache, plan_update, require_staging
from mooncake_rl.protocol import Digest, Generation, Hex16, Name, PrepareRequest, Wire
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient

W = TypeVar("W", bound=BaseModel)
T = TypeVar("T")


# -- wire: what crosses vLLM's routes ------------------------------------------------------
class MooncakeStoreInitInfo(Wire):
    """``init_info``: which model of the Store the engine follows, and how updates land.

    The Store itself is the engine's own (``MOONCAKE_RL_*`` in its environment): a caller of
    the route cannot point an engine at another Store.
    """

    model: Name
    mode: Literal["compat", "direct"] = "direct"
    batch_bytes: int | None = Field(
        None, gt=0, le=1 << 40, description="bytes per pipeline batch (default: the engine's)"
    )
    direct_fallback: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="direct mode: regex of parameters landed whole through load_weights",
    )

    @field_validator("direct_fallback")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"not a regular expression: {error}") from None
        return pattern

    @model_validator(mode="after")
    def _fallback_is_direct(self) -> MooncakeStoreInitInfo:
        if self.direct_fallback is not None and self.mode != "direct":
            raise ValueError("direct_fallback applies to mode 'direct' only")
        return self


class MooncakeStoreUpdateInfo(Wire):
    """``update_info``: the active record the trainer announced. Each worker checks it
    against its Store (the record exists and names exactly this) before it stages a byte."""

    generation: Generation
    fence: int = Field(gt=0, lt=10**12, description="the active record's number")
    incarnation: Hex16
    manifest_digest: Digest

    @classmethod
    def of(cls, record: ActiveRecord) -> Self:
        return cls(
            generation=record.generation,
            fence=record.fence,
            incarnation=record.incarnation,
            manifest_digest=record.manifest_digest,
        )


def parsed_as(model: type[W], body: Any, what: str) -> W:
    """``body`` validated as ``model``; otherwise a 422 :class:`Refused` naming each bad
    field, raised before anything changed."""
    try:
        return parsed(model, body)
    except RequestRefused as refused:
        raise Refused(
            422,
            refused.code,
            f"invalid {what}, nothing changed: {refused.detail}; fields: "
            + ", ".join(model.model_fields),
        ) from None


# -- engine side ---------------------------------------------------------------------------
class EngineUpdateWorker(VllmUpdateWorker):
    """The extension's worker protocol, bound to the model vLLM gave the engine."""

    def __init__(self, engine: WeightTransferEngine) -> None:
        self.engine = engine

    def model(self) -> torch.nn.Module:
        return self.engine.model

    def configs(self) -> tuple[Any, Any]:
        return self.engine.vllm_config, self.engine.model_config

    def _reset_runner_caches(self) -> None:
        """Nothing: vLLM's ``finish_weight_update`` resets the runner's LoRA state itself."""


class StepFailed(RuntimeError):
    """A step failed on at least one TP rank; every rank raises it alike. When every rank
    refused (nothing changed), the message is marked with the first rank's refusal."""

    def __init__(self, step: str, replies: list[dict[str, Any]], hint: str = "") -> None:
        self.refused = all(r.get("refused") for r in replies)
        self.refusal = Refusal(**replies[0]["refused"]) if self.refused else None
        detail = "; ".join(f"rank {r['rank']}: {r['error']}" for r in replies if not r.get("ok"))
        message = f"{BACKEND} {step} failed ({detail})" + (f"; {hint}" if hint else "")
        super().__init__(self.refusal.marked(message) if self.refusal else message)


def attempt(rank: int, run: Callable[[], T]) -> tuple[T | None, dict[str, Any]]:
    """``run``'s result and a reply in the worker protocol's shape, never raising: a rank
    that raised before a collective would leave the other ranks waiting in it."""
    try:
        return run(), {"ok": True, "rank": rank}
    except (Refused, RequestRefused) as refused:  # ours, or a check of the worker protocol
        refusal = getattr(refused, "refusal", None) or Refusal(refused.status, refused.code)
        reply = {"refused": asdict(refusal), "error": refused.detail}
        return None, {"ok": False, "rank": rank, **reply}
    except Exception as error:
        return None, {"ok": False, "rank": rank, "error": f"{type(error).__name__}: {error}"}


@dataclass(frozen=True)
class Link:
    """What ``init_weight_transfer_engine`` settled for every later update."""

    info: MooncakeStoreInitInfo
    engine_id: str
    placement: tuple[dict[str, Any], ...]  # every TP rank's description, in rank order
    batch_bytes: int  # init_info's, else the engine's MOONCAKE_RL_BATCH_BYTES
    cache: RoutingCache  # routing tables, in memory and in the Store


class MooncakeStoreWeightTransferEngine(WeightTransferEngine):
    """One vLLM worker's side of ``mooncake_store`` (see the module docstring)."""

    init_info_cls = MooncakeStoreInitInfo
    update_info_cls = MooncakeStoreUpdateInfo
    # The plan describes the main model's parameters; a draft model has others.
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.updater = EngineUpdateWorker(self)
        self.link: Link | None = None
        self.staged: MooncakeStoreUpdateInfo | None = None

    def parse_init_info(self, init_dict: dict[str, Any]) -> MooncakeStoreInitInfo:
        return parsed_as(MooncakeStoreInitInfo, init_dict, "init_info")

    def parse_update_info(self, update_dict: dict[str, Any]) -> MooncakeStoreUpdateInfo:
        return parsed_as(MooncakeStoreUpdateInfo, update_dict, "update_info")

    # -- collectives ----------------------------------------------------------------------
    def _group(self) -> Any:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        return group.cpu_group if group.world_size > 1 else None

    def _agreed(self, step: str, reply: dict[str, Any], hint: str = "") -> list[dict[str, Any]]:
        """Every rank's reply to ``step``, once all succeeded; :class:`StepFailed` otherwise."""
        replies = gather_json(reply, self._group())
        if not all(r.get("ok") for r in replies):
            raise StepFailed(step, replies, hint)
        return replies

    def _require_link(self) -> Link:
        if self.link is None:
            raise Refused(
                409,
                "not_initialized",
                "no init_info yet; POST /init_weight_transfer_engine "
                '{"init_info": {"model": "<Store model name>"}} first',
            )
        return self.link

    # -- vLLM's lifecycle -----------------------------------------------------------------
    def init_transfer_engine(self, init_info: MooncakeStoreInitInfo) -> None:
        """Check the engine can follow ``init_info.model``, then describe every rank once."""
        if self.staged is not None:
            raise Refused(
                409,
                "update_staged",
                f"generation {self.staged.generation} is staged; finish_weight_update "
                "lands it before the engine is initialized again",
            )
        stages = self.parallel_config.pipeline_parallel_size
        if stages != 1:
            raise Refused(
                409,
                "unsupported_parallelism",
                f"{BACKEND} lands tensor-parallel shards only; this engine runs "
                f"--pipeline-parallel-size {stages}: serve it with 1",
            )
        _, loaded = served_by(self.model)
        if loaded not in (None, init_info.model):
            raise Refused(
                409,
                "wrong_model",
                f"this engine serves {loaded!r} from the Store; init_info names "
                f"{init_info.model!r}: name the model it serves",
            )
        engine_id = loader_engine_id()
        placement = self._agreed(
            "init",
            self.updater.call(engine_id, "describe"),
            "each worker opens its Store and Transfer Engine clients here: check "
            "MOONCAKE_RL_MASTER / MOONCAKE_RL_METADATA in the engine's environment",
        )
        batch_bytes = init_info.batch_bytes or Settings().batch_bytes
        require_staging({engine_id: placement}, batch_bytes)  # alike on every rank
        # Tables planned by an earlier life of this engine (or any engine) load from the Store.
        cache = RoutingCache(self.updater.store(engine_id))
        self.link = Link(init_info, engine_id, tuple(placement), batch_bytes, cache)

    def start_weight_update(self) -> None:
        self._require_link()
        self._drop()  # a round whose finish never came

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Stage the named generation. No device sync: live weights change at finish."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: MooncakeStoreUpdateInfo) -> None:
        """Plan, prepare and apply every stage; any failure drops what was staged."""
        link = self._require_link()
        if self.staged is not None:
            raise Refused(
                409,
                "update_staged",
                f"generation {self.staged.generation} is already staged in this "
                f"update; finish_weight_update lands it, then start another for generation "
                f"{update_info.generation}",
            )
        rank, call = self.updater.tp()[0], self.updater.call
        session = gather_json(uuid.uuid4().hex, self._group())[0]  # rank 0's, on every rank
        body, reply = attempt(rank, lambda: self._prepare_body(link, update_info, session))
        self._agreed("plan", reply)
        assert body is not None
        try:
            prepared = self._agreed("prepare", call(link.engine_id, "prepare", body))
            self._agreed("promote", call(link.engine_id, "promote"))
            peers = advertised_peers({link.engine_id: {"workers": prepared}})
            for stage in range(body["stages"]):
                applied = {
                    "session": session,
                    "generation": update_info.generation,
                    "stage": stage,
                    "peers": peers,
                }
                self._agreed(
                    f"apply stage {stage}", self.updater.run_stage_now(link.engine_id, applied)
                )
        except BaseException:
            call(link.engine_id, "abort")
            raise
        self.staged = update_info

    def _prepare_body(
        self, link: Link, info: MooncakeStoreUpdateInfo, session: str
    ) -> dict[str, Any]:
        """The prepare request of the worker protocol, planned from the Store's record.

        Every rank plans the same table (a pure function of the manifest and the placement,
        cached across generations of one layout) and takes its own slice from it.
        """
        request = PrepareRequest(
            session=session,
            model=link.info.model,
            generation=info.generation,
            manifest_digest=info.manifest_digest,
            fence=info.fence,
            incarnation=info.incarnation,
            mode=link.info.mode,
            stages=0,
            workers={},
            in_place=False,  # the native routes drain nothing: live weights change at finish
        )
        served, _ = served_by(self.model)
        if not served.superseded_by(request):
            raise Refused(
                409,
                "stale_generation",
                f"generation {info.generation} (record {info.fence}) is not newer than the "
                f"served generation {served.generation} (record {served.fence}); publish a "
                "new one",
            )
        store = self.updater.store(link.engine_id)
        record = check_generation(store, request)
        assert record is not None  # a fence names one record
        registry = GenerationRegistry(store, link.info.model)
        manifest = registry.load_manifest(info.generation, info.manifest_digest)
        checksums = registry.load_checksums(info.generation, record.checksums_digest)
        plan = plan_update(
            manifest,
            {link.engine_id: list(link.placement)},
            link.info.mode,
            link.batch_bytes,
            link.cache,
            record.layout_digest,
            link.info.direct_fallback,
        )
        return {
            **request.model_dump(mode="json"),
            "stages": plan.stages,
            "workers": plan.engine_workers(link.engine_id, checksums.objects),
        }

    def finish_weight_update(self) -> None:
        """Commit the staged generation; nothing staged (no update_weights) is a no-op.

        A commit that failed after landing began may have written live weights: every rank
        then reloads the Store's active generation before the error is raised.
        """
        info, self.staged = self.staged, None
        if info is None:
            return
        link = self._require_link()
        try:
            self._agreed("commit", self.updater.call(link.engine_id, "commit", info.generation))
        except StepFailed as failed:
            if failed.refused:  # every rank refused before landing: live weights untouched
                self.updater.call(link.engine_id, "abort")
                raise
            self._rebuild(link, failed)
        # Whose records the served fence counts: an init naming another model is refused.
        mark_served(self.model, served_by(self.model)[0], link.info.model)

    def _rebuild(self, link: Link, failed: StepFailed) -> None:
        try:
            rebuilt = self._agreed(
                "rebuild", self.updater.call(link.engine_id, "rebuild", link.info.model)
            )
        except StepFailed as again:
            raise RuntimeError(
                f"{failed}; live weights may be partly written and the reload from the Store "
                f"failed too ({again}): restart the engine"
            ) from again
        raise RuntimeError(
            f"{failed}; live weights may have been partly written, so every rank reloaded the "
            f"Store's active generation {rebuilt[0]['generation']}, which the engine now serves"
        ) from failed

    def _drop(self) -> None:
        if self.staged is not None and self.link is not None:
            self.updater.call(self.link.engine_id, "abort")
        self.staged = None

    def shutdown(self) -> None:
        """Drop any staged update and close the Store and Transfer Engine clients."""
        self.staged = None
        self.updater.close()
        self.link = None


# -- trainer side --------------------------------------------------------------------------
@dataclass(kw_only=True)
class MooncakeStoreTrainerInitInfo(TrainerInitInfo):
    """The trainer's choice of model, rollout dtype and landing; ``settings`` is its own
    Store client (default: ``MOONCAKE_RL_*``). Checked here, before any call to an engine."""

    backend: ClassVar[str] = BACKEND
    model: str
    dtype: str = "bfloat16"
    mode: Literal["compat", "direct"] = "direct"
    batch_bytes: int | None = None
    direct_fallback: str | None = None
    keep: int | None = DEFAULT_KEEP
    settings: Settings | None = None

    def __post_init__(self) -> None:
        self.engine_init_info()
        try:
            publish_format(self.dtype)
        except InvariantViolation as error:
            raise ValueError(f"{BACKEND}: {error}") from None
        if self.keep is not None and (type(self.keep) is not int or self.keep < 1):
            raise ValueError(f"{BACKEND}: keep must be an integer >= 1 or None, got {self.keep!r}")

    def engine_init_info(self) -> MooncakeStoreInitInfo:
        body = {
            "model": self.model,
            "mode": self.mode,
            "batch_bytes": self.batch_bytes,
            "direct_fallback": self.direct_fallback,
        }
        return parsed_as(MooncakeStoreInitInfo, body, "trainer init info")


class MooncakeStoreTrainerEngine(TrainerWeightTransferEngine[MooncakeStoreTrainerInitInfo]):
    """Publishes each round to the Store, then lands it through the engines' routes.

    Rank 0 publishes every tensor (one copy each, in its node's segment); other ranks only
    iterate the source, whose materialization is a collective (FSDP ``full_tensor``).
    """

    init_info_cls = MooncakeStoreTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: MooncakeStoreTrainerInitInfo,
        store: StoreClient | None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.store = store
        self.record: ActiveRecord | None = None  # the generation last sent

    @classmethod
    def trainer_init(
        cls,
        init_info: MooncakeStoreTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError(
                f"{BACKEND} publishes a WeightSource every round: pass source=ModuleSource(model)"
            )
        if not init_info.is_sender:
            return cls(client=client, source=source, init_info=init_info, store=None)
        store = StoreClient(init_info.settings or Settings())
        try:
            client.init_weight_transfer_engine(init_info.engine_init_info().model_dump(mode="json"))
        except BaseException:
            store.close()
            raise
        return cls(client=client, source=source, init_info=init_info, store=store)

    def send_weights(self) -> None:
        """Publish the source as the next generation, then start, update and finish.

        A failed publish raises before any engine is called (the previous generation stays
        active); the engines' weight version becomes ``name:incarnation:generation``, as on
        the coordinator's path.
        """
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        assert self.store is not None
        info = self.init_info
        record = publish_local(
            self.store, info.model, iter(self.source), dtype=info.dtype, keep=info.keep
        )
        self.client.start_weight_update()
        self.client.update_weights(MooncakeStoreUpdateInfo.of(record).model_dump(mode="json"))
        self.client.finish_weight_update(
            weight_version=weight_version(info.model, served_record(record))
        )
        self.record = record

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
