"""The layout digest of a generation: what a routing plan depends on, computed at announce.

Keys change every generation (``{group_id}/payload/<name>``) but the layout usually does
not, so plans are keyed by a digest of the layout (tensors, shapes, dtypes, fragment
geometry, object names, offsets and sizes), never by the generation, group or keys. The
announcer computes it once per generation and seals it into the active-generation record:
hashing the ~140k tensor and fragment objects of a 1T MoE costs ~0.1 s, more than the rest
of a plan-cache hit, and the consumer would otherwise redo it on every update.
"""

from __future__ import annotations

import hashlib
import marshal
import re
from operator import attrgetter, itemgetter

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.generations.keys import payload_prefix

# Plain-data fields (str, int, None, int tuples) serialized with marshal format 2: a pure
# function of content (no object references, no interning flags), and fast because it is
# C code; parallel axes are dataclasses and go through repr.
TENSOR_FIELDS = attrgetter(
    "tensor_id",
    "global_shape",
    "dtype",
    "itemsize",
    "shard_dims",
    "layout_fingerprint",
    "layer_id",
    "expert_id",
)
TENSOR_AXES = attrgetter("parallel_axes")
FRAGMENT_FIELDS = attrgetter(
    "tensor_id", "global_offset", "local_shape", "object_offset", "nbytes", "aliases"
)
FRAGMENT_KEY = attrgetter("object_key")
DIGEST_PATTERN = re.compile(r"[0-9a-f]{64}")


def layout_digest(manifest: WeightManifest) -> str:
    """SHA-256 of the layout of ``manifest``: equal for two generations of the same layout.

    Covers every tensor field and every fragment's geometry, object name, offset and size;
    excludes generation, revision, group, the keys' group prefix, fragment ids and timestamps.
    Only C-level iteration, so a 1T MoE manifest takes ~0.1 s.
    """
    prefix = payload_prefix(manifest.group_id)
    h = hashlib.sha256(b"mooncake-rl/source-layout/v1")
    h.update(marshal.dumps(list(map(TENSOR_FIELDS, manifest.tensors)), 2))
    h.update("\x00".join(map(repr, map(TENSOR_AXES, manifest.tensors))).encode())
    h.update(marshal.dumps(list(map(FRAGMENT_FIELDS, manifest.fragments)), 2))
    names = map(itemgetter(slice(len(prefix), None)), map(FRAGMENT_KEY, manifest.fragments))
    h.update("\x00".join(names).encode())  # every key starts with the prefix (validated)
    return h.hexdigest()


def is_digest(value: object) -> bool:
    """Whether ``value`` looks like a SHA-256 hex digest (lowercase, 64 characters)."""
    return isinstance(value, str) and DIGEST_PATTERN.fullmatch(value) is not None
