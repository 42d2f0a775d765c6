"""The survey: what one wave learns, and plans, before it touches any engine.

Placements in (``GET /mooncake/placement?boxes=false``; in full where a plan needs boxes),
checked against the Store's active record and the transport's topology; the generation's
objects checked readable; for the Store transport, the plan and every engine's prepare
slices encoded. Out comes a :class:`Survey`: the targets and what the sync needs of them.
Engines serve throughout, and a refusal here leaves every engine as it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mooncake_rl.coordinator.delta import InPlaceDelta, delta_targets
from mooncake_rl.coordinator.result import (
    UpdateFailed,
    UpdateResult,
    left_out,
    require_enough,
)
from mooncake_rl.errors import MooncakeError
from mooncake_rl.generations.chain import load_delta_table, realize_generation
from mooncake_rl.generations.checksums import ChecksumTable
from mooncake_rl.generations.pack_order import PackOrder, save_pack_order
from mooncake_rl.generations.registry import ActiveRecord, GenerationRegistry, payload_problems
from mooncake_rl.plan.planner import planning_mode
from mooncake_rl.plan.update import UpdatePlan, encode_workers, plan_update, require_staging
from mooncake_rl.router.probe import require_compatible
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.modes import TransportMode
from mooncake_rl.transport.sender import SenderLauncher
from mooncake_rl.transport.topology import Classification, classify, require_mixed

if TYPE_CHECKING:
    from mooncake_rl.coordinator.orchestration import Coordinator

logger = logging.getLogger(__name__)

BARE_PLACEMENT = "placement?boxes=false"
"""Placements without boxes (``protocol.BOXES``): what an update reads first."""


@dataclass(frozen=True)
class Options:
    """What every wave of one update shares."""

    mode: str
    drain_mode: str
    batch_bytes: int
    direct_fallback: str | None
    transport: TransportMode
    train_pool: Sequence[str] | None
    sender: SenderLauncher | None
    in_place: bool = True
    pull: str = "single"

    @property
    def pauses_at_prepare(self) -> bool:
        """Direct mode receiving in place: peers write live weights from the first stage,
        so engines pause at prepare, not just to land."""
        return self.mode == "direct" and self.in_place


class Phases:
    """Seconds per update phase, into ``result.phase_seconds``. A phase met twice adds up:
    the plan is made before the drain and bound again (or re-planned) after it."""

    def __init__(self, result: UpdateResult, progress: Callable[[str], None]) -> None:
        self.result, self.progress = result, progress
        self.clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        seconds = self.result.phase_seconds.get(name, 0.0) + now - self.clock
        self.result.phase_seconds[name] = round(seconds, 4)
        self.clock = now
        self.progress(name)

    def restart(self) -> None:
        self.clock = time.perf_counter()


@dataclass
class Survey:
    """What one wave learnt before touching any engine (:func:`survey_targets`)."""

    result: UpdateResult
    phase: Phases
    checksums: ChecksumTable
    placements: dict[str, dict[str, Any]]
    targets: list[str]
    classification: Classification
    mixed: bool
    # The Store transport: its planner for a set of engines, and the plan for every target.
    plan_for: Callable[[Sequence[str]], UpdatePlan] | None = None
    planned: UpdatePlan | None = None
    # Each target's prepare-body ``workers`` under ``planned``, encoded before the drain.
    encoded: dict[str, bytes] = field(default_factory=dict)
    # A delta generation: the engines taking it in place (not in ``targets``; their fetch
    # is planned apart, :mod:`mooncake_rl.plan.delta`).
    delta: InPlaceDelta = field(default_factory=InPlaceDelta)

    def plan(self, urls: Sequence[str]) -> UpdatePlan:
        """The plan for ``urls``: the one made before the drain when every target drained,
        else a new one (a miss: the topology changed)."""
        assert self.plan_for is not None and self.planned is not None
        return self.planned if list(urls) == self.targets else self.plan_for(urls)

    def workers(self, url: str, plan: UpdatePlan) -> bytes:
        """``url``'s prepare-body ``workers`` under ``plan``: encoded before the drain when
        ``plan`` is the one made then, else now (a re-plan after an engine failed)."""
        if plan is self.planned and url in self.encoded:
            return self.encoded[url]
        return encode_workers(plan.engine_workers(url, self.checksums.objects))


def learn_pack_order(
    store: StoreClient, model: str, described: Mapping[str, Mapping[str, Any]]
) -> None:
    """Tell the next publish how these engines cut their tensors (:mod:`.pack_order`); no
    engines described (a compat or non-Store update, whose receivers read whole tensors):
    to pack tensor after tensor again. A hint only, so a Store that refuses it costs this
    update nothing; a write only when it changes."""
    order = PackOrder.of_engines({url: reply["workers"] for url, reply in described.items()})
    try:
        save_pack_order(store, model, order)
    except MooncakeError as error:
        logger.warning("the pack order of %s was not stored: %s", model, error)


def serves(placement: Mapping[str, Any], record: ActiveRecord) -> bool:
    """The engine already serves exactly this record's generation: the only skip."""
    return (
        placement.get("model") == record.model
        and placement.get("generation") == record.generation
        and placement.get("incarnation") == record.incarnation
    )


def target_of(record: ActiveRecord) -> dict[str, Any]:
    """The record an update brings, as its drains and prepares name it."""
    return {
        "model": record.model,
        "generation": record.generation,
        "fence": record.fence,
        "incarnation": record.incarnation,
    }


def refusal(
    url: str, placement: Mapping[str, Any], record: ActiveRecord, drain_mode: str
) -> str | None:
    """Why an engine cannot be brought to ``record`` (other model, ahead of the Store, or
    no such pause mode)."""
    modes = placement.get("pause_modes", ("abort", "wait"))  # plugins before keep mode
    if drain_mode not in modes:
        return (
            f"{url} runs {placement.get('engine_version', 'an engine')}, which pauses only "
            f"with {', '.join(modes)}, not {drain_mode!r}: use --drain abort or wait, or "
            "upgrade the engine"
        )
    if placement.get("model") != record.model:
        return f"{url} serves {placement.get('model')!r}, not {record.model!r}"
    same_store = placement.get("incarnation") == record.incarnation
    if same_store and int(placement.get("fence") or 0) > record.fence:
        return (
            f"{url} serves generation {placement.get('generation')} under active record "
            f"{placement.get('fence')}, newer than the Store's record {record.fence} (generation "
            f"{record.generation}): another coordinator or publish moved on; retry the update"
        )
    return None


def engine_gpus(
    placements: Mapping[str, Mapping[str, Any]], urls: Sequence[str]
) -> dict[str, list[str] | None]:
    """Each engine's physical GPU ids in rank order; ``None`` where a rank reports none."""
    found: dict[str, list[str] | None] = {}
    for url in urls:
        gpus = [w.get("gpu") for w in placements[url].get("workers", [])]
        found[url] = [g for g in gpus if g] if gpus and all(gpus) else None
    return found


def survey_targets(
    coordinator: Coordinator,
    model: str,
    engines: Sequence[str],
    record: ActiveRecord,
    needed: int,
    options: Options,
) -> Survey:
    """Steps 1-2 and, for the Store transport, the plan: all before any engine leaves
    rotation or drains, so engines serve while a cold plan runs (seconds for a 1T MoE),
    and a placement the planner refuses changes nothing. The plan after the drain is
    then the cache's hit, unless an engine failed to drain."""
    mode, chosen, train_pool = options.mode, options.transport, options.train_pool
    registry = GenerationRegistry(coordinator.store, model)
    manifest = registry.load_manifest(record.generation, record.manifest_digest)
    # One table load per update; each worker gets the rows of the objects it reads.
    checksums = registry.load_checksums(record.generation, record.checksums_digest)
    segments = registry.segment_hints(record)  # locality: reads stay on a segment's node
    result = UpdateResult(model, record.generation, mode, list(engines))
    result.transport, result.pull = chosen.value, options.pull
    result.drain_mode = options.drain_mode
    phase = Phases(result, coordinator._progress)

    placements, failed = coordinator._all(engines, "GET", BARE_PLACEMENT)
    require_compatible(placements)  # a reply carries its engine's status
    left_out(result, failed)
    result.skipped = [u for u in engines if u in placements and serves(placements[u], record)]
    targets = [u for u in engines if u in placements and u not in result.skipped]
    for url in targets:
        problem = refusal(url, placements[url], record, options.drain_mode)
        if problem:
            result.error = problem
            raise UpdateFailed(result)
    require_enough(result, targets, needed, "placement")
    # Before any drain: a topology the transport cannot serve changes nothing.
    classification = classify(chosen, targets, engine_gpus(placements, targets), train_pool)
    table = load_delta_table(coordinator.store, model, record.generation)
    in_place_delta, result.delta_refused = delta_targets(
        coordinator, record, manifest, checksums, table, placements, targets, options
    )
    targets = [u for u in targets if u not in in_place_delta.workers]
    mixed = chosen is TransportMode.AUTO and coordinator.store.settings.assert_mixed_transport
    if mixed:
        require_mixed(classification)
    if chosen is TransportMode.STORE:
        require_staging({u: placements[u]["workers"] for u in targets}, options.batch_bytes)
        wanted = coordinator.cache.boxes_wanted(
            manifest,
            {u: placements[u]["workers"] for u in targets},
            mode,
            options.batch_bytes,
            record.layout_digest,
            options.direct_fallback,
            segments,
            pull=options.pull,
        )
        # A 1T MoE engine's boxes: 50 MB of JSON, some 200k dicts. Parsed with the
        # collector running, they set off passes over this process's whole heap (1.8 s
        # instead of 0.4 s for one reply beside a plan's caches).
        with planning_mode():
            described, failed = coordinator._all(wanted, "GET", "placement")
        left_out(result, failed)
        placements.update(described)
        result.described = sorted(described)
        if mode == "direct" and described:
            learn_pack_order(coordinator.store, model, described)
        targets = [u for u in targets if u not in failed]
        require_enough(result, [*targets, *in_place_delta.engines], needed, "placement")
    if chosen is not TransportMode.STORE or mode != "direct":
        learn_pack_order(coordinator.store, model, {})
    phase("placement")
    survey = Survey(result, phase, checksums, placements, targets, classification, mixed)
    survey.delta = in_place_delta
    if not targets:
        return survey
    if table is not None:  # the rest read generation N whole: rebuilt once from its chain
        result.realized_bytes = realize_generation(
            coordinator.store, model, record.generation, checksums
        )
        phase("realize")
    unreadable = payload_problems(coordinator.store, manifest)
    if unreadable:
        result.error = (
            f"generation {record.generation} of {model} is not fully readable "
            f"({len(unreadable)} object(s): {', '.join(unreadable[:5])}); no engine was "
            "drained. A segment holder was lost: `mooncake-rl status` lists readable "
            "generations, `mooncake-rl activate --generation K` makes one active, or republish"
        )
        raise UpdateFailed(result)
    phase("check")
    if chosen is not TransportMode.STORE:
        return survey

    def describe(urls: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        """Boxes a re-plan reads after the drain (the first plan's were read before)."""
        described, failed = coordinator._all(urls, "GET", "placement")
        if failed:
            left_out(result, failed)
            result.error = "placement failed while re-planning: " + "; ".join(
                str(e) for e in failed.values()
            )
            raise UpdateFailed(result)
        placements.update(described)
        result.described = sorted({*result.described, *described})
        return {u: described[u]["workers"] for u in urls}

    def plan_for(urls: Sequence[str]) -> UpdatePlan:
        return plan_update(
            manifest,
            {u: placements[u]["workers"] for u in urls},
            mode,
            options.batch_bytes,
            coordinator.cache,
            record.layout_digest,
            options.direct_fallback,
            segments,
            describe,
            pull=options.pull,
        )

    survey.plan_for, survey.planned = plan_for, plan_for(targets)
    phase("plan")
    # The engines' slices, encoded while they serve: about 10 s of coordinator CPU per
    # update for a 1T MoE on 16 engines, which engines would otherwise wait out drained.
    survey.encoded = {url: survey.workers(url, survey.planned) for url in targets}
    phase("bodies")
    return survey
