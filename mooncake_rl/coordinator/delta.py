"""Which engines take a delta generation in place, decided in the survey.

    active record (a delta: ``base`` set) + placements --at base, same Store incarnation,
    direct mode in place over the Store--> candidates --their boxes (``GET placement``),
    :func:`mooncake_rl.apply.delta.delta_reads`--> the engines that take the delta in place

Everything else takes the full path: an engine further behind, compat mode, another
transport, or a worker with a parameter the engine processes after loading (vLLM-CPU's
packed GEMMs) or a box no checksum covers alone (:class:`DeltaUnavailable` says which).
Those read generation N whole, rebuilt once from its chain (:func:`realize_generation`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.apply.delta import DeltaUnavailable, delta_reads
from mooncake_rl.generations.chain import DeltaTable
from mooncake_rl.generations.checksums import ChecksumTable
from mooncake_rl.generations.registry import ActiveRecord
from mooncake_rl.transport.modes import TransportMode

if TYPE_CHECKING:
    from mooncake_rl.coordinator.orchestration import Coordinator
    from mooncake_rl.coordinator.survey import Options

logger = logging.getLogger(__name__)


class BoxRow(NamedTuple):
    """A box as a placement reports it (``engine_ext.shards.ShardSpec.to_json``)."""

    tensor: str
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    region: str
    region_offset: int

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> BoxRow:
        return cls(
            str(row["tensor"]),
            tuple(row["global_offset"]),
            tuple(row["local_shape"]),
            str(row["region"]),
            int(row["region_offset"]),
        )


def why_not_in_place(
    workers: Sequence[Mapping[str, Any]],
    manifest: WeightManifest,
    checksums: ChecksumTable,
    table: DeltaTable,
) -> str | None:
    """Why an engine (its workers' full placements) cannot take the delta in place."""
    for worker in workers:
        regions = set(worker.get("regions", {}))
        if not worker.get("in_place_all"):
            return f"worker {worker.get('worker_id')} processes some parameters after loading"
        try:
            delta_reads(
                manifest,
                checksums.objects,
                table,
                [BoxRow.of(s) for s in worker["shards"]],
                regions,
            )
        except DeltaUnavailable as error:
            return f"worker {worker.get('worker_id')}: {error}"
    return None


def delta_targets(
    coordinator: Coordinator,
    record: ActiveRecord,
    manifest: WeightManifest,
    checksums: ChecksumTable,
    table: DeltaTable | None,
    placements: Mapping[str, Mapping[str, Any]],
    targets: Sequence[str],
    options: Options,
) -> tuple[list[str], dict[str, str]]:
    """The targets that take ``record``'s delta in place, and why each other target takes
    the generation whole (nothing for a full generation)."""
    if table is None:
        return [], {}
    if options.mode != "direct" or not options.in_place:
        return [], dict.fromkeys(targets, "a delta is taken in place in direct mode alone")
    if options.transport is not TransportMode.STORE:
        return [], dict.fromkeys(targets, f"the {options.transport.value} transport")
    why_not: dict[str, str] = {}
    at_base = []
    for url in targets:
        served = placements[url].get("generation")
        if served != table.base or placements[url].get("incarnation") != record.incarnation:
            why_not[url] = f"serves generation {served}, not the base {table.base}"
        else:
            at_base.append(url)
    described, _ = coordinator._all(at_base, "GET", "placement")
    chosen = []
    for url in at_base:
        reply = described.get(url)
        why = "its placement did not answer" if reply is None else None
        why = why or why_not_in_place(reply["workers"], manifest, checksums, table)  # type: ignore[index]
        if why is None:
            chosen.append(url)
        else:
            why_not[url] = why
    for url, why in why_not.items():
        logger.info("%s takes generation %s whole: %s", url, record.generation, why)
    return chosen, why_not
