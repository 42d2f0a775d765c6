"""One update session on its engines, and the steps run under it.

The session opens on every target at drain (its id in every later body), is renewed in the
background while held, and is closed by commit or aborted by release. Under it: drain
(engines held), prepare (each engine's slices in, its workers' endpoints out), apply stage
by stage (the Store transport; peers from prepare), or deliver (the broadcast and CPU legs
in place of apply), then commit. Each step records what it saw in the :class:`UpdateResult`
and releases every held engine when too few remain.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from mooncake_rl.coordinator.client import encode_body
from mooncake_rl.coordinator.result import UpdateFailed, UpdateResult, left_out, require_enough
from mooncake_rl.coordinator.survey import target_of
from mooncake_rl.generations.registry import ActiveRecord
from mooncake_rl.plan.update import UpdatePlan
from mooncake_rl.transport.legs import LegFailed, LegFigures, TransportLegs
from mooncake_rl.transport.modes import TransportMode
from mooncake_rl.transport.sender import SenderLauncher
from mooncake_rl.transport.topology import Classification

if TYPE_CHECKING:
    from mooncake_rl.coordinator.delta import DeltaFetch
    from mooncake_rl.coordinator.orchestration import Coordinator

P = TypeVar("P")
ADVERTISED = ("worker_id", "node", "endpoint", "regions")
"""The fields of a prepare reply's worker that peers write by (the apply body's peers)."""


class SessionLease:
    """One update session: its id, the engines it holds, their lease renewal, and the steps
    run under it (:meth:`drain`, :meth:`prepare`, :meth:`apply` or :meth:`deliver`,
    :meth:`commit`).

    Renewal runs every third of the TTL as a task on the coordinator's loop, so a long
    apply or commit never lets the lease lapse; its calls have their own bound on calls in
    flight, so a phase's fan-out never holds them back. When this process dies, renewal
    stops and the engines free themselves.
    """

    def __init__(self, coordinator: Coordinator, ttl_s: float) -> None:
        self.id = uuid.uuid4().hex
        self.held: set[str] = set()
        self.rebuilding: set[str] = set()
        self._coordinator = coordinator
        self._ttl_s = ttl_s
        self._renewal = coordinator._loop.submit(self._renew())

    async def _renew(self) -> None:
        body = encode_body({"session": self.id})
        while True:
            await asyncio.sleep(self._ttl_s / 3)
            urls = sorted(self.held)
            await self._coordinator._fan_out(
                urls, "POST", "renew", dict.fromkeys(urls, body), bound=self._coordinator._renewals
            )

    def release(self, urls: Sequence[str]) -> None:
        """Abort the session on ``urls``: each drops what it staged and serves again, or
        (live parameters received in place) rebuilds itself; those are kept in
        ``rebuilding``."""
        body = {"session": self.id}
        aborted, _ = self._coordinator._all(
            urls, "POST", "abort", {u: body for u in urls}, retry=True
        )
        self.rebuilding.update(
            u for u, reply in aborted.items() if reply.get("state") in ("broken", "rebuilding")
        )
        self.held.difference_update(urls)

    def stop(self) -> None:
        """No renewal from now on (one in flight is cancelled)."""
        self._renewal.cancel()

    @contextlib.contextmanager
    def holding(self, result: UpdateResult) -> Iterator[None]:
        """Run a sync's steps: any failure releases every engine still held; renewal always
        stops, and engines that rebuild themselves are recorded in ``result.rebuild``."""
        try:
            yield
        except BaseException:
            self.release(sorted(self.held))
            raise
        finally:
            self.stop()
            result.rebuild = sorted({*result.rebuild, *self.rebuilding})

    def deliver(
        self,
        members: list[str],
        classification: Classification,
        placements: Mapping[str, dict[str, Any]],
        launcher: SenderLauncher,
        record: ActiveRecord,
        bucket_bytes: int,
        needed: int,
        result: UpdateResult,
        phase: Callable[[str], None],
        base: Mapping[str, Any],
    ) -> list[str]:
        """Prepare and apply the broadcast and CPU legs (:mod:`mooncake_rl.transport.legs`)."""
        legs = TransportLegs(
            self._coordinator,
            self._coordinator.store,
            self._coordinator.store.settings,
            record,
            classification,
            placements,
            launcher,
            session=self.id,
            holder=f"{self._coordinator.holder}/{self.id}",
            bucket_bytes=bucket_bytes,
        )
        try:
            members, plan, _ = self.prepare(
                members,
                legs.plan_for,
                lambda url, plan: legs.body_for(url, plan, base),
                needed,
                result,
                phase,
            )
            legs.apply(plan)
        except LegFailed as error:
            # Apply writes staging only: released engines serve their old generation.
            self.release(sorted(self.held))
            result.failed.update(error.failed)
            result.failure_codes.update(dict.fromkeys(error.failed, "delivery_failed"))
            result.error = f"{classification.mode.value} delivery failed: {error}"
            raise UpdateFailed(result) from error
        finally:
            legs.close()
            result.legs.update(legs.figures.rows)
            result.store_read_bytes = legs.store_read_bytes
        return members

    def drain(
        self,
        targets: Sequence[str],
        drain_mode: str,
        needed: int,
        result: UpdateResult,
        target: dict[str, Any],
    ) -> list[str]:
        """Open the session on every target; the first (in URL order) alone, so that a
        rival coordinator that got there first stops this one before it holds anything.
        Each drain names ``target``: an engine a rival brought to it since the survey
        refuses, still serving (``stale_generation``)."""
        body = {
            "session": self.id,
            "holder": self._coordinator.holder,
            "ttl_s": self._ttl_s,
            "mode": drain_mode,
            "target": target,
        }
        ordered = sorted(targets)
        drained: list[str] = []
        for group, untried in ((ordered[:1], ordered[1:]), (ordered[1:], [])):
            ok, failed = self._coordinator._all(group, "POST", "drain", {u: body for u in group})
            self.held.update(ok)
            drained += ok
            left_out(result, failed)
            self.enough_or_release(result, [*drained, *untried], needed, "drain")
        return [u for u in targets if u in drained]

    def prepare(
        self,
        members: list[str],
        plan_for: Callable[[Sequence[str]], P],
        body_for: Callable[[str, P], dict[str, Any]],
        needed: int,
        result: UpdateResult,
        phase: Callable[[str], None],
    ) -> tuple[list[str], P, dict[str, dict[str, Any]]]:
        """Plan and prepare; engines that fail or stop answering are released and the rest
        re-planned without them (their pushes would never come) until all that remain are
        prepared and alive."""
        planned = False
        while True:
            plan = plan_for(members)
            if not planned:
                phase("plan")
                planned = True
            bodies = {u: body_for(u, plan) for u in members}
            prepared, failed = self._coordinator._all(members, "POST", "prepare", bodies)
            if not failed:
                phase("prepare")
                # Just before apply: every member still answers in this session.
                _, failed = self._coordinator._all(
                    members, "POST", "renew", {u: {"session": self.id} for u in members}
                )
            if not failed:
                return members, plan, prepared
            self.release(sorted(failed))
            left_out(result, failed)
            members = [u for u in members if u not in failed]
            self.enough_or_release(result, members, needed, "prepare")

    def apply(
        self,
        members: list[str],
        plan: UpdatePlan,
        peers: dict[str, dict[str, Any]],
        record: ActiveRecord,
        result: UpdateResult,
    ) -> None:
        figures = LegFigures()
        received = plan.routing.received_bytes()
        for stage in range(plan.stages):
            bodies = {
                url: {
                    "session": self.id,
                    "generation": record.generation,
                    "stage": stage,
                    "peers": stage_peers(plan, url, stage, peers),
                }
                for url in members
            }
            applied, failed = self._coordinator._all(members, "POST", "apply", bodies)
            for url, reply in applied.items():
                for worker in reply["workers"]:
                    result.store_read_bytes += worker["store_read_bytes"]
                    result.store_reread_bytes += worker.get("store_reread_bytes", 0)
                    result.pushed_bytes += worker["pushed_bytes"]
                figures.add(
                    url,
                    TransportMode.STORE.value,
                    sum(received.get(w["worker_id"], 0) for w in reply["workers"] if not stage),
                    max((w["seconds"] for w in reply["workers"]), default=0.0),
                )
            result.legs.update(figures.rows)
            if failed:
                # Released engines serve their old generation, or rebuild where they
                # received in place (result.rebuild).
                self.release(sorted(self.held))
                left_out(result, failed)
                result.error = f"apply stage {stage} failed: " + "; ".join(
                    str(e) for e in failed.values()
                )
                raise UpdateFailed(result)
            self._coordinator._progress(f"stage {stage}")

    def apply_delta(
        self,
        members: list[str],
        fetch: DeltaFetch,
        peers: dict[str, dict[str, Any]],
        record: ActiveRecord,
        result: UpdateResult,
    ) -> None:
        """A delta's one stage, while the engines serve: every entry read from the Store
        once and pushed to the other workers that need it (nothing live is written)."""
        bodies = {
            url: {
                "session": self.id,
                "generation": record.generation,
                "stage": 0,
                "peers": fetch.peers(url, peers),
            }
            for url in members
        }
        applied, failed = self._coordinator._all(members, "POST", "apply", bodies)
        for reply in applied.values():
            for worker in reply["workers"]:
                result.store_read_bytes += worker["store_read_bytes"]
                result.pushed_bytes += worker["pushed_bytes"]
                result.delta_bytes += worker["store_read_bytes"]
        if failed:  # nothing live was written: released engines serve the base
            self.release(sorted(self.held))
            left_out(result, failed)
            result.error = "delta fetch failed: " + "; ".join(str(e) for e in failed.values())
            raise UpdateFailed(result)
        self._coordinator._progress("stage 0")

    def commit(
        self,
        members: list[str],
        record: ActiveRecord,
        needed: int,
        result: UpdateResult,
    ) -> None:
        body = {"session": self.id, "generation": record.generation}
        committed, failed = self._coordinator._all(
            members, "POST", "commit", {u: body for u in members}, retry=True
        )
        self.held.difference_update(members)
        result.committed = [*result.committed, *(u for u in members if u in committed)]
        for url, reply in committed.items():
            result.landing[url] = reply.get("landing", {})
            for rank, worker in enumerate(reply.get("workers", [])):
                result.verified[f"{url}/tp{rank}"] = worker.get("verify", {})
        left_out(result, failed)
        result.rebuild = sorted(
            {*result.rebuild, *(u for u, e in failed.items() if e.code == "commit_failed")}
        )
        if len(result.committed) + len(result.skipped) < needed:
            result.error = "commit failed: " + "; ".join(str(e) for e in failed.values())
            raise UpdateFailed(result)

    def enough_or_release(
        self,
        result: UpdateResult,
        members: Sequence[str],
        needed: int,
        step: str,
    ) -> None:
        try:
            require_enough(result, members, needed, step)
        except UpdateFailed:
            self.release(sorted(self.held))
            raise


def prepare_body(session: SessionLease, record: ActiveRecord, **fields: Any) -> dict[str, Any]:
    """What every prepare of ``session`` names: the session, the record it brings and the
    manifest's digest; ``fields``: the kind of update's own (mode, stages, delta, adapter)."""
    return {
        "session": session.id,
        **target_of(record),
        "manifest_digest": record.manifest_digest,
        **fields,
    }


def advertised_peers(prepared: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Where each prepared worker takes pushes: the apply body's ``peers`` (prepare replies
    by engine, each with its ``workers``)."""
    return {
        w["worker_id"]: {k: w[k] for k in ADVERTISED}
        for reply in prepared.values()
        for w in reply["workers"]
    }


def stage_peers(
    plan: UpdatePlan, url: str, stage: int, peers: Mapping[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The advertised peers that ``url``'s workers push to in ``stage``, each with only the
    regions those pushes land in: all an apply body needs. Naming every prepared worker
    makes each body grow with the fleet, and a stage's bytes with its square (1,000 engines:
    gigabytes of JSON per stage); naming every region of a peer makes it grow with the
    model (a MoE worker advertises a region per parameter: megabytes per stage)."""
    return {
        worker: {
            **peers[worker],
            "regions": {
                name: peers[worker]["regions"][name]
                for name in sorted(regions)
                if name in peers[worker]["regions"]  # else the worker refuses it, naming it
            },
        }
        for worker, regions in sorted(plan.push_regions(url, stage).items())
    }
