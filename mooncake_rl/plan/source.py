"""The generation-independent view of a published generation: its *layout*.

Keys change every generation (``{group_id}/payload/<name>``) but the layout does not, so
plans are made in terms of object *names* (the part after the payload prefix) and keyed by
a digest of the layout (tensors, shapes, dtypes, fragment geometry, object offsets and
sizes; ``mooncake_rl.generations.layout``), never by the generation, group or keys.
Concrete keys are bound at lowering time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from operator import attrgetter, itemgetter

import numpy as np
from mooncake.reshard.weight import TensorDescriptor, WeightManifest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.keys import payload_prefix
from mooncake_rl.generations.layout import FRAGMENT_KEY, layout_digest
from mooncake_rl.plan import grid

# The layout digest is computed once per generation by the announcer (it is sealed into
# the active-generation record); the planner recomputes it only when none is recorded.
source_digest = layout_digest


@dataclass(frozen=True, eq=False)
class SourceLayout:
    """Objects and per-tensor stored fragments of one generation, keys reduced to names.

    Tensors are sorted by id, objects by name. Tensor ``t``'s stored fragments, sorted by
    global offset, are ``fragment_ptr[t]..fragment_ptr[t+1]`` of ``fragment_object`` (object
    index) and ``fragment_offset`` (byte offset in the object); ``geometry[t]`` holds their
    (global_offset, local_shape, nbytes). ``object_sizes`` is the end of each object's last
    fragment: the bytes a ranged read may touch.
    """

    digest: str
    objects: tuple[str, ...]
    object_sizes: np.ndarray
    tensors: tuple[TensorDescriptor, ...]
    fragment_ptr: np.ndarray
    fragment_object: np.ndarray
    fragment_offset: np.ndarray
    geometry: tuple[tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...], ...]

    @cached_property
    def tensor_index(self) -> dict[str, int]:
        return {t.tensor_id: i for i, t in enumerate(self.tensors)}


_GEOMETRY = attrgetter("global_offset", "local_shape", "nbytes")


def source_layout(manifest: WeightManifest, digest: str | None = None) -> SourceLayout:
    """Extract the layout of a generation (C-level passes; Python only per multi-fragment
    tensor)."""
    fragments = manifest.fragments
    aliased = next((f for f in fragments if f.aliases), None)
    if aliased is not None:
        raise InvariantViolation(
            f"stored fragment {aliased.fragment_id} declares aliases; aliased tensors are "
            "not supported by the planner (publish each tensor as its own object)"
        )
    cut = itemgetter(slice(len(payload_prefix(manifest.group_id)), None))
    names = list(map(cut, map(FRAGMENT_KEY, fragments)))
    objects = sorted(set(names))
    obj = np.fromiter(
        map(dict(zip(objects, range(len(objects)), strict=True)).__getitem__, names), np.int64
    )
    tensors = tuple(sorted(manifest.tensors, key=attrgetter("tensor_id")))
    tindex = dict(zip(map(attrgetter("tensor_id"), tensors), range(len(tensors)), strict=True))
    owner = np.fromiter(map(tindex.__getitem__, map(attrgetter("tensor_id"), fragments)), np.int64)
    geometry = list(map(_GEOMETRY, fragments))
    offset = np.fromiter(map(attrgetter("object_offset"), fragments), np.int64, len(fragments))
    nbytes = np.fromiter(map(attrgetter("nbytes"), fragments), np.int64, len(fragments))
    order = grid.stable_order(owner)
    counts = np.bincount(owner, minlength=len(tensors))
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    for t in np.flatnonzero(counts > 1).tolist():  # several fragments: by global offset
        span = order[ptr[t] : ptr[t + 1]]
        order[ptr[t] : ptr[t + 1]] = sorted(span.tolist(), key=lambda i: geometry[i][0])
    sizes = np.zeros(len(objects), dtype=np.int64)
    np.maximum.at(sizes, obj, offset + nbytes)
    ordered = [geometry[i] for i in order.tolist()]
    bounds = ptr.tolist()
    return SourceLayout(
        digest=digest if digest is not None else source_digest(manifest),
        objects=tuple(objects),
        object_sizes=sizes,
        tensors=tensors,
        fragment_ptr=ptr,
        fragment_object=obj[order],
        fragment_offset=offset[order],
        geometry=tuple(tuple(ordered[a:b]) for a, b in pairwise(bounds)),
    )
