"""Tensor specs and the ``WeightManifest`` that describes one generation."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from mooncake.reshard.weight import StoredFragment, TensorDescriptor, WeightManifest

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations import fp8
from mooncake_rl.generations.keys import (
    NAMESPACE,
    group_id,
    manifest_key,
    payload_key,
)
from mooncake_rl.generations.packing import PACK_PREFIX, Placement

ROLLOUT_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
"""Dtypes a stored tensor may have (an fp8 generation's weights are ``float8_e4m3fn``)."""
PUBLISH_FORMATS = ("bfloat16", "float16", "float32", fp8.FP8_FORMAT)
"""What a publisher casts to: one dtype for every tensor, or fp8 block quantization."""
LAYOUT = "row-major-contiguous"


def rollout_dtype(name: str) -> torch.dtype:
    try:
        return ROLLOUT_DTYPES[name]
    except KeyError:
        raise InvariantViolation(
            f"unknown rollout dtype {name!r}; choose one of {sorted(ROLLOUT_DTYPES)}"
        ) from None


def publish_format(name: str) -> str:
    """``name`` if a publisher can emit it; else an error that says what to choose."""
    if name == fp8.FP8_DTYPE:
        raise InvariantViolation(
            f"a plain cast to {name} has no scales, so no engine can read it: publish with "
            f"dtype {fp8.FP8_FORMAT!r} (128x128 block scales, DeepSeek-V3's fp8 layout)"
        )
    if name not in PUBLISH_FORMATS:
        raise InvariantViolation(
            f"unknown rollout dtype {name!r}; choose one of {', '.join(PUBLISH_FORMATS)}"
        )
    return name


def dtype_name(dtype: torch.dtype) -> str:
    for name, candidate in ROLLOUT_DTYPES.items():
        if candidate == dtype:
            return name
    raise InvariantViolation(f"unsupported dtype {dtype}")


@dataclass(frozen=True)
class TensorSpec:
    """One full tensor of a generation as stored: name, shape and rollout dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not self.name or any(ch.isspace() for ch in self.name):
            raise InvariantViolation(f"tensor name {self.name!r} must be non-empty, no spaces")
        if self.name.startswith(PACK_PREFIX):
            raise InvariantViolation(
                f"tensor name {self.name!r} starts with {PACK_PREFIX!r}, which names packed "
                "objects; rename the tensor"
            )
        if not self.shape or any(type(d) is not int or d < 1 for d in self.shape):
            raise InvariantViolation(f"tensor {self.name} has invalid shape {self.shape}")
        rollout_dtype(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, dtype: str) -> TensorSpec:
        # Scalars are stored as shape (1,): manifests need at least one dimension.
        return cls(name, tuple(int(d) for d in tensor.shape) or (1,), dtype)

    @classmethod
    def stored(cls, name: str, tensor: torch.Tensor, fmt: str) -> tuple[TensorSpec, ...]:
        """What publishing ``tensor`` in format ``fmt`` stores: itself in one dtype, or (fp8,
        a tensor :func:`fp8.quantizes`) its fp8 weight and then its block scales."""
        if fmt != fp8.FP8_FORMAT:
            return (cls.of(name, tensor, fmt),)
        if not fp8.quantizes(name, tensor.shape):
            return (cls.of(name, tensor, fp8.UNQUANTIZED_DTYPE),)
        return (
            cls.of(name, tensor, fp8.FP8_DTYPE),
            cls(fp8.scale_name(name), fp8.scale_shape(tensor.shape), fp8.SCALE_DTYPE),
        )

    @property
    def itemsize(self) -> int:
        return rollout_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def specs_digest(specs: Sequence[TensorSpec]) -> str:
    """Identity of a tensor sequence, compared across ranks before anything is announced."""
    body = json.dumps([[s.name, list(s.shape), s.dtype] for s in specs], separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def check_specs(specs: Sequence[TensorSpec]) -> None:
    if not specs:
        raise InvariantViolation("a generation needs at least one tensor (empty model)")
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise InvariantViolation(f"duplicate tensor name {spec.name!r}")
        seen.add(spec.name)


def build_manifest(
    model: str,
    generation: int,
    specs: Sequence[TensorSpec],
    created_at: str,
    placements: Mapping[str, Sequence[Placement]] | None = None,
) -> WeightManifest:
    """One fragment per full tensor, raw contiguous bytes: in its own object at offset 0, or
    where ``placements`` put it in a pack (:mod:`.packing`); a tensor placed in row blocks
    (a rank-major pack, :mod:`.pack_order`) has a fragment per block."""
    check_specs(specs)
    group = group_id(model, generation)
    placed = placements or {}
    tensors = tuple(
        TensorDescriptor(
            tensor_id=spec.name,
            global_shape=spec.shape,
            dtype=spec.dtype,
            itemsize=spec.itemsize,
            shard_dims=(),
            layout_fingerprint=LAYOUT,
            parallel_axes=(),
        )
        for spec in specs
    )
    fragments = tuple(
        _fragment(group, spec, placement)
        for spec in specs
        for placement in placed.get(spec.name) or (Placement(spec.name, 0),)
    )
    try:
        return _manifest(model, generation, group, tensors, fragments, created_at)
    except ValueError as error:  # mooncake.reshard's checks: e.g. packed tensors overlapping
        raise InvariantViolation(f"not a valid manifest: {error}") from error


def _fragment(group: str, spec: TensorSpec, placement: Placement) -> StoredFragment:
    first, end = placement.rows or (0, spec.shape[0])
    return StoredFragment(
        fragment_id=placement.fragment_id(spec.name),
        tensor_id=spec.name,
        global_offset=(first,) + (0,) * (len(spec.shape) - 1),
        local_shape=(end - first, *spec.shape[1:]),
        object_key=payload_key(group, placement.object_name),
        object_offset=placement.offset,
        nbytes=spec.nbytes // spec.shape[0] * (end - first),
    )


def _manifest(
    model: str,
    generation: int,
    group: str,
    tensors: tuple[TensorDescriptor, ...],
    fragments: tuple[StoredFragment, ...],
    created_at: str,
) -> WeightManifest:
    return WeightManifest(
        namespace=NAMESPACE,
        resource_id=model,
        revision=f"g{generation:012d}",
        weight_generation=generation,
        group_id=group,
        manifest_key=manifest_key(group),
        tensors=tensors,
        fragments=fragments,
        created_at=created_at,
    )


def specs_of(manifest: WeightManifest) -> list[TensorSpec]:
    return [TensorSpec(t.tensor_id, t.global_shape, t.dtype) for t in manifest.tensors]
