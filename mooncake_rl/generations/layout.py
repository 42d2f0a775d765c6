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
import json
import marshal
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter, itemgetter

from mooncake.reshard.weight import WeightManifest

from mooncake_rl.errors import InvariantViolation
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


def located_digest(layout: str, segments: str) -> str:
    """The source digest of a plan whose segment hints put objects on a rollout node: the
    layout's joined with the segment map's (``segments``), since the hints change the plan."""
    return hashlib.sha256(f"mooncake-rl/located/v1\0{layout}\0{segments}".encode()).hexdigest()


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


@dataclass(frozen=True)
class SegmentMap:
    """Which Mooncake Store segment holds each payload object: the announce's locality hints.

    Recorded at announce from the master's replica descriptors (a replica's transport
    endpoint is its segment's name), by object *name* (the key less the group prefix), so a
    plan can use it for every generation placed alike. A hint, never needed for correctness:
    the planner prefers readers on the segment's node and counts their reads off the NIC.
    """

    objects: tuple[str, ...]  # object names, sorted
    segment_of: tuple[int, ...]  # per object: index into ``segments``
    segments: tuple[str, ...]  # distinct segment names, sorted

    def __post_init__(self) -> None:
        # C-level checks: a 1T MoE's map has ~140k objects and is decoded at every update.
        if not _strictly_increasing(self.objects):
            raise InvariantViolation("segment map objects must be sorted and distinct")
        if not _strictly_increasing(self.segments) or not all(self.segments):
            raise InvariantViolation("segment map segments must be sorted, distinct, non-empty")
        if (
            len(self.segment_of) != len(self.objects)
            or not all(map(int.__instancecheck__, self.segment_of))
            or (
                self.segment_of
                and not 0 <= min(self.segment_of) <= max(self.segment_of) < len(self.segments)
            )
        ):
            raise InvariantViolation("segment map indices do not match its objects and segments")

    @classmethod
    def of(cls, segment_by_object: Mapping[str, str]) -> SegmentMap:
        segments = tuple(sorted(set(segment_by_object.values())))
        index = {segment: i for i, segment in enumerate(segments)}
        objects = tuple(sorted(segment_by_object))
        return cls(objects, tuple(index[segment_by_object[o]] for o in objects), segments)

    def segment(self, name: str) -> str | None:
        """The segment holding object ``name``, or None if the announce recorded none."""
        i = self._position.get(name)
        return None if i is None else self.segments[self.segment_of[i]]

    @cached_property
    def _position(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.objects)}

    def encode(self) -> bytes:
        body = {"objects": self.objects, "segment_of": self.segment_of, "segments": self.segments}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> SegmentMap:
        """The map a record holds; its digest is that of the record's bytes as read."""
        try:
            body = json.loads(data)
            found = cls(tuple(body["objects"]), tuple(body["segment_of"]), tuple(body["segments"]))
        except (ValueError, KeyError, TypeError) as error:
            raise InvariantViolation(f"not a segment map record ({error})") from error
        vars(found)["digest"] = cls.digest_of(data)  # what cached_property would store
        return found

    @staticmethod
    def digest_of(data: bytes) -> str:
        return hashlib.sha256(b"mooncake-rl/segments/v1\0" + data).hexdigest()

    @cached_property
    def digest(self) -> str:
        """SHA-256 of the encoded record (what the active record seals)."""
        return self.digest_of(self.encode())


def _strictly_increasing(values: tuple[str, ...]) -> bool:
    return all(map(str.__lt__, values[:-1], values[1:]))
