"""The update's orchestration: the :class:`Coordinator` and its waves.

``update`` checks its options, probes a router (if any), reads the Store's active record,
and splits the engines into waves (all at once unless ``max_unavailable``). Each wave is
surveyed (:mod:`.survey`: placements, checks, the plan, while engines serve), then synced
(:meth:`Coordinator._sync`: drain, prepare, apply or deliver, commit, under one
:class:`~.session.SessionLease`), with engines out of a router's rotation for the landing
(or, direct mode in place, the whole sync). Waves add up in one :class:`UpdateResult`.
"""

from __future__ import annotations

import functools
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_rl.coordinator.adapter import sync_adapter
from mooncake_rl.coordinator.client import Body, EngineClient
from mooncake_rl.coordinator.result import (
    ReadmitFailed,
    UpdateFailed,
    UpdateResult,
    planned,
)
from mooncake_rl.coordinator.session import SessionLease, advertised_peers, prepare_body
from mooncake_rl.coordinator.survey import (
    BARE_PLACEMENT,
    Options,
    Survey,
    engine_gpus,
    survey_targets,
    target_of,
)
from mooncake_rl.errors import ConfigurationError, MooncakeRLError
from mooncake_rl.generations.lora import load_adapter_record
from mooncake_rl.generations.registry import ActiveRecord, require_active
from mooncake_rl.plan.params import PULLS
from mooncake_rl.plan.update import RoutingCache
from mooncake_rl.protocol import MAX_TTL_S
from mooncake_rl.router.adapters import Router
from mooncake_rl.router.probe import require_compatible, waves
from mooncake_rl.router.rotation import Rotation
from mooncake_rl.store import StoreClient
from mooncake_rl.transport.modes import (
    TransportMode,
    parse_gpu_ids,
    require_store_path,
    resolve_mode,
)
from mooncake_rl.transport.sender import ChildLauncher, SenderKeeper, SenderLauncher
from mooncake_rl.transport.topology import classify, require_mixed_ran

Bracket = Callable[[Sequence[str], Callable[[], UpdateResult]], UpdateResult]
"""Runs a step with these engines out of a router's rotation (:meth:`Coordinator.bracketed`)."""


def _unbracketed(engines: Sequence[str], step: Callable[[], UpdateResult]) -> UpdateResult:
    return step()


class Coordinator(EngineClient):
    """An HTTP client over a set of engines, used by the CLI and the VeRL bridge: it
    updates them from the Store (:meth:`update`); its calls are :class:`EngineClient`'s."""

    def __init__(
        self,
        store: StoreClient,
        engines: Sequence[str],
        *,
        token: str | None = None,
        timeout_s: float = 600.0,
        session_ttl_s: float = 30.0,
        holder: str | None = None,
        progress: Callable[[str], None] | None = None,
        max_connections: int | None = None,
    ) -> None:
        """``session_ttl_s``: how long engines stay held if this process stops renewing;
        ``holder``: the name engines report for this coordinator (default host:pid);
        ``max_connections``: at most this many calls of a phase in flight at once, the
        rest wait their turn (default: all); lease renewals have a bound of their own."""
        if not engines:
            raise MooncakeRLError("at least one engine URL is needed")
        if not 1 <= session_ttl_s <= MAX_TTL_S:
            raise MooncakeRLError(
                f"the session TTL must lie in 1..{MAX_TTL_S:g} s (engines refuse others), "
                f"got {session_ttl_s}"
            )
        super().__init__(token=token, timeout_s=timeout_s, max_connections=max_connections)
        self.store = store
        self.engines = [url.rstrip("/") for url in engines]
        self._progress = progress or (lambda message: None)
        # Routing tables also go to the Store: the next process (CLI, restarted bridge) loads them.
        self.cache = RoutingCache(store)
        self.session_ttl_s = session_ttl_s
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        self.senders = SenderKeeper()
        """Broadcast senders (and their groups), one per engine set, kept across updates."""

    def close(self) -> None:
        self.senders.close()
        super().close()

    def status(self) -> dict[str, dict[str, Any]]:
        ok, failed = self._all(self.engines, "GET", "status")
        return {**ok, **{u: {"error": str(e)} for u, e in failed.items()}}

    def update(
        self,
        model: str,
        *,
        mode: str = "compat",
        drain_mode: str = "abort",
        batch_bytes: int | None = None,
        direct_fallback: str | None = None,
        min_engines: int | None = None,
        transport: str | None = None,
        train_gpus: str | Sequence[str] | None = None,
        sender: SenderLauncher | None = None,
        router: Router | None = None,
        max_unavailable: int | None = None,
        in_place: bool = True,
        pull: str = "single",
    ) -> UpdateResult:
        """``direct_fallback``: regex of parameter names direct mode lands through each
        engine's ``load_weights`` (full tensors) instead of its shard discovery.
        ``min_engines``: how many engines must end on the new generation (already serving
        it counts); default all. ``transport``: store (default: ``MOONCAKE_RL_TRANSPORT``),
        broadcast, cpu_serialize or auto; the non-Store ones need ``train_gpus`` (default
        ``MOONCAKE_RL_TRAIN_GPUS``) and deliver full tensors in buckets of ``batch_bytes``;
        ``sender``: where a broadcast's sender runs (default: a child of this process).
        ``batch_bytes``: the plan's pipeline batch (default: ``MOONCAKE_RL_BATCH_BYTES`` of
        this Store client's settings); every engine worker's staging watermark must hold two.

        ``router``: the request router in front of the engines. Before anything is touched
        the router, the engines' plugin versions and the topology are probed; then each
        engine is taken out of rotation before it drains and re-admitted (if still wanted)
        once its sync ended, whatever the outcome. ``max_unavailable``: update that many
        engines at a time (a rolling update), all pinned to the same generation; default
        all at once. :class:`ReadmitFailed` means the sync succeeded but engines stayed out
        of rotation; a failed sync raises its own error even when re-admission failed too.

        ``in_place``: direct mode receives into live parameters that need no post-load
        processing (no staging memory, no landing copy). An update that then fails after
        prepare leaves those engines rebuilding from the Store (``result.rebuild``) instead
        of serving their old generation; ``False`` stages every byte.

        ``pull``: ``single`` reads each published byte from the Store once for the whole
        fleet; ``node`` once per rollout node, so that a node fans its own reads out over
        NVLink as they land instead of after the barrier (compat mode's full tensors: about
        1.8x -> 1.0x its NIC bound in ``bench simulate``). The Store then serves the model
        once per node: use it where the trainers' NICs have that headroom.
        """
        if pull not in PULLS:
            raise ConfigurationError(
                f"pull must be one of {', '.join(PULLS)}, got {pull!r}: single reads each "
                "byte once for the fleet, node once per rollout node"
            )
        needed = len(self.engines) if min_engines is None else min_engines
        if not 1 <= needed <= len(self.engines):
            raise MooncakeRLError(
                f"min_engines must lie in 1..{len(self.engines)} (the engines given), got {needed}"
            )
        groups = waves(self.engines, max_unavailable)
        chosen = resolve_mode(transport)
        require_store_path(chosen, mode, pull)
        train_pool = parse_gpu_ids(
            train_gpus if train_gpus is not None else self.store.settings.train_gpus,
            "the train pool's GPU ids (--train-gpus / MOONCAKE_RL_TRAIN_GPUS)",
        )
        rotation = None
        if router is not None:
            self._probe(router, chosen, train_pool)
            rotation = Rotation(router, self.store, holder=self.holder)
        record = require_active(self.store, model, "cannot update engines")
        if load_adapter_record(self.store, model, record.generation) is not None:
            return sync_adapter(self, record, needed, drain_mode)
        batch = self.store.settings.batch_bytes if batch_bytes is None else batch_bytes
        options = Options(
            mode, drain_mode, batch, direct_fallback, chosen, train_pool, sender, in_place, pull
        )
        tag = uuid.uuid4().hex
        total = UpdateResult(model, record.generation, mode, list(self.engines))
        total.transport, total.pull, total.drain_mode = chosen.value, pull, drain_mode
        spare = len(self.engines) - needed
        for group in groups:
            needed_now = max(1, len(group) - spare)
            bracket = functools.partial(
                self.bracketed, rotation, tag, leave_last=drain_mode == "keep"
            )
            try:
                survey = survey_targets(self, model, group, record, needed_now, options)
                if survey.delta.engines:  # out of rotation for the landing alone
                    in_place = survey.delta.engines
                    needed_delta = max(1, len(in_place) - (len(group) - needed_now))
                    self._sync_delta(survey, record, needed_delta, options, bracket)
                    needed_now = max(1, needed_now - len(survey.result.delta))
                if options.pauses_at_prepare:  # out of rotation for the whole sync
                    sync = functools.partial(self._sync, survey, record, needed_now, options)
                    rest = [u for u in group if u not in survey.delta.workers]
                    result = bracket(rest, functools.partial(sync, _unbracketed))
                else:  # out of rotation for the landing alone
                    result = self._sync(survey, record, needed_now, options, bracket)
            except (UpdateFailed, ReadmitFailed) as error:
                total.absorb(error.result)
                error.result = total
                raise
            total.absorb(result)
            spare -= len(group) - len(result.committed) - len(result.skipped)
        return total

    def _probe(
        self, router: Router, chosen: TransportMode, train_pool: Sequence[str] | None
    ) -> None:
        """Router API, plugin versions and topology, before any engine leaves rotation."""
        router.probe()
        statuses, failed = self._all(self.engines, "GET", "status")
        require_compatible({**statuses, **{u: None for u, e in failed.items() if e.status == 404}})
        placements, _ = self._all(self.engines, "GET", BARE_PLACEMENT)
        urls = sorted(placements)
        classify(chosen, urls, engine_gpus(placements, urls), train_pool)

    def bracketed(
        self,
        rotation: Rotation | None,
        tag: str,
        engines: Sequence[str],
        sync: Callable[[], UpdateResult],
        *,
        leave_last: bool = False,
    ) -> UpdateResult:
        """Take ``engines`` out of rotation, sync, and re-admit in the ``finally``
        (``leave_last``: :meth:`Rotation.take_out`'s, for keep mode).

        Only engines still held out for this update (``tag``) come back: one retired
        meanwhile stays out. The sync's error wins over a failed re-admission; after a
        successful sync, a failed re-admission raises :class:`ReadmitFailed`.
        """
        if rotation is None:
            return sync()
        taken: list[str] = []
        outcome: dict[str, str] = {}
        try:
            rotation.take_out(engines, tag, taken, leave_last=leave_last)
            result = sync()
        except UpdateFailed as failed:
            failed.result.rotation = outcome  # filled in by the finally below
            raise
        finally:
            outcome.update(rotation.readmit(taken, tag))
        result.rotation = outcome
        stuck = {url: why for url, why in outcome.items() if why.startswith("failed")}
        if stuck:
            raise ReadmitFailed(result, stuck)
        return result

    def _sync_delta(
        self, survey: Survey, record: ActiveRecord, needed: int, options: Options, landing: Bracket
    ) -> UpdateResult:
        """A delta generation on the engines that take it in place (``survey.delta``):
        drain, prepare (each worker's entry buffer, its slice of the planned fetch), one
        apply stage (entries read once from the Store and pushed between workers, while the
        engines serve), commit (each decodes, then pauses to scatter and check) under
        ``landing``."""
        result, phase = survey.result, survey.phase
        phase.restart()
        session = SessionLease(self, self.session_ttl_s)
        result.session = session.id
        body = prepare_body(
            session, record, mode="direct", in_place=True, stages=1, delta={"base": record.base}
        )
        with session.holding(result):
            members = session.drain(
                survey.delta.engines, options.drain_mode, needed, result, target_of(record)
            )
            phase("drain")
            members, fetch, prepared = session.prepare(
                members,
                lambda urls: survey.delta.plan(urls, options.batch_bytes),
                lambda url, fetch: {**body, "workers": fetch.body(url)},
                needed,
                result,
                phase,
            )
            session.apply_delta(members, fetch, advertised_peers(prepared), record, result)
            phase("apply")

            def land() -> UpdateResult:
                session.commit(members, record, needed, result)
                return result

            landing(members, land)
            phase("commit")
            result.delta = [*result.delta, *(u for u in members if u in result.committed)]
        return result

    def _sync(
        self,
        survey: Survey,
        record: ActiveRecord,
        needed: int,
        options: Options,
        landing: Bracket,
    ) -> UpdateResult:
        """Steps 3-6 for the engines ``survey`` found (see the package doc); ``landing``
        brackets the commit (out of a router's rotation and back)."""
        result, phase, members = survey.result, survey.phase, survey.targets
        phase.restart()  # leaving rotation is not a phase of the sync
        if not members:
            return result
        session = SessionLease(self, self.session_ttl_s)
        result.session = session.id
        # What every prepare body names, on the Store transport or the legs.
        base = prepare_body(session, record, mode=options.mode, in_place=options.in_place)

        with session.holding(result):
            members = session.drain(members, options.drain_mode, needed, result, target_of(record))
            phase("drain")
            if survey.planned is not None:
                members, plan, prepared = session.prepare(
                    members,
                    survey.plan,
                    lambda url, plan: Body(
                        {**base, "stages": plan.stages},
                        {"workers": survey.workers(url, plan)},
                    ),
                    needed,
                    result,
                    phase,
                )
                survey.encoded.clear()  # sent: up to tens of MB per engine
                planned(result, plan)
                for url, reply in prepared.items():
                    result.in_place_bytes += reply.get("in_place_bytes", 0)
                    result.staged_bytes += reply.get("staged_bytes", 0)
                    result.staging[url] = [w["staging"] for w in reply["workers"] if "staging" in w]
                session.apply(members, plan, advertised_peers(prepared), record, result)
            else:
                members = session.deliver(
                    members,
                    survey.classification,
                    survey.placements,
                    options.sender
                    or ChildLauncher(self.store.settings, options.train_pool, self.senders),
                    record,
                    options.batch_bytes,
                    needed,
                    result,
                    phase,
                    base,
                )
            phase("apply")

            def land() -> UpdateResult:
                session.commit(members, record, needed, result)
                return result

            landing(members, land)
            phase("commit")
        if survey.mixed:
            require_mixed_ran(
                {TransportMode(result.legs[u]["transport"]) for u in result.committed}
            )
        return result
