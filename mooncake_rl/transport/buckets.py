"""CPU serialization: a bucket of whole tensors in safetensors format (a JSON header and raw
bytes; never pickle), handed to an engine through shared memory on the same host or in
an HTTP body otherwise."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations.catalog import rollout_dtype
from mooncake_rl.transport.layout import Bucket, ReceiveLayout

SHM_DIR = Path("/dev/shm")
SHM_NAME = re.compile(r"^mooncake-rl-[0-9a-f]{32}-[0-9]{1,6}$")
"""Bucket files: session id and bucket index; nothing else is ever opened."""


class MalformedBucket(InvariantViolation):
    """A bucket does not hold exactly the tensors the layout puts in it."""


def this_host_id() -> str:
    """This machine's boot id: an engine reporting the same one shares this /dev/shm
    (unless a container gives it its own: then set ``MOONCAKE_RL_CPU_HANDOFF=http``)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def shm_name(session: str, index: int) -> str:
    name = f"mooncake-rl-{session}-{index}"
    if not SHM_NAME.match(name):
        raise InvariantViolation(f"no bucket file name for session {session!r}, index {index}")
    return name


def shm_path(name: str) -> Path:
    if not SHM_NAME.match(name):
        raise MalformedBucket(f"bucket name {name!r} is not a mooncake-rl bucket file")
    return SHM_DIR / name


def pack(tensors: Mapping[str, torch.Tensor]) -> bytes:
    return save_safetensors({name: t.contiguous() for name, t in tensors.items()})


def write_shm(name: str, data: bytes) -> Path:
    """The bucket in a shared-memory file only its owner can write (others read it)."""
    path = shm_path(name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    return path


def read_shm(name: str) -> bytes:
    return shm_path(name).read_bytes()


def unpack(data: bytes, layout: ReceiveLayout, bucket: Bucket) -> dict[str, torch.Tensor]:
    """One bucket's tensors by name; the bucket must hold exactly the layout's tensors for
    it, at their dtypes and shapes."""
    try:
        tensors = load_safetensors(data)
    except Exception as error:  # safetensors raises its own error types
        raise MalformedBucket(f"bucket {bucket.index} is not safetensors: {error}") from error
    expected = layout.bucket_tensors(bucket)
    names = sorted(t.name for t in expected)
    if sorted(tensors) != names:
        raise MalformedBucket(
            f"bucket {bucket.index} holds {sorted(tensors)[:5]}, the layout puts {names[:5]} "
            "there: sender and engine disagree on the generation or the bucket size"
        )
    for spec in expected:
        tensor = tensors[spec.name]
        if tensor.dtype != rollout_dtype(spec.dtype) or tuple(tensor.shape) != spec.shape:
            raise MalformedBucket(
                f"{spec.name} arrived as {tensor.dtype} {tuple(tensor.shape)}, the generation "
                f"stores {spec.dtype} {spec.shape}"
            )
    return tensors


def unpack_into(
    data: bytes, layout: ReceiveLayout, bucket: Bucket, buffer: torch.Tensor
) -> list[str]:
    """Land one bucket's tensors at their layout offsets in ``buffer`` (bytes)."""
    tensors = unpack(data, layout, bucket)
    for spec in layout.bucket_tensors(bucket):
        flat = tensors[spec.name].reshape(-1).view(torch.uint8)
        buffer[spec.offset : spec.offset + spec.nbytes].copy_(flat)
    return sorted(tensors)
