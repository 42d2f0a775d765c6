"""Whether the Store holds a generation's payloads whole, checked before it is announced.

    manifest --object_extents--> the objects it declares and their sizes
    the Store's complete replicas of them --> problems (absent, incomplete, wrong size)
                                              + the segment of each whole one (SegmentMap)

Why: announce and activate refuse a generation that engines could not read in full, and the
same replica descriptors give the planner its locality hints at no extra round trip.
"""

from __future__ import annotations

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.generations.keys import payload_prefix
from mooncake_rl.generations.layout import SegmentMap
from mooncake_rl.generations.packing import object_extents
from mooncake_rl.store import StoreClient


def payload_problems(store: StoreClient, manifest: WeightManifest) -> list[str]:
    """Fragments not held whole: absent, not yet complete, or of another size than declared."""
    return payload_state(store, manifest)[0]


def payload_state(store: StoreClient, manifest: WeightManifest) -> tuple[list[str], SegmentMap]:
    """``payload_problems`` and, from the same replica descriptors, the segment of every
    payload held whole (the announce's locality hints)."""
    objects = object_extents(manifest)
    problems: list[str] = []
    segments: dict[str, str] = {}
    prefix = len(payload_prefix(manifest.group_id))
    for stored, found in zip(objects.values(), store.complete_replicas(list(objects)), strict=True):
        if found is None:
            problems.append(f"missing {stored.key}")
        elif found[0] != stored.nbytes:
            problems.append(f"{stored.key} holds {found[0]} bytes, expected {stored.nbytes}")
        else:
            segments[stored.key[prefix:]] = found[1]
    return problems, SegmentMap.of(segments)
