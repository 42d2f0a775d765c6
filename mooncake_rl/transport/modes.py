"""Transport selection: which path an update takes, and the GPU ids topology is declared in.

The Store path stays the default. The others exist for deployments where the Store is not
the fastest route: a broadcast group to engines on GPUs of their own, CPU serialization to
engines that share GPUs with the trainer. ``auto`` picks between those two per engine.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum

from pydantic import ValidationError

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.settings import Settings


class TransportMode(StrEnum):
    """How an update reaches engines. Every engine's leg is one of the first three."""

    STORE = "store"
    BROADCAST = "broadcast"
    CPU_SERIALIZE = "cpu_serialize"
    AUTO = "auto"


_VALID = ", ".join(TransportMode)
_GPU_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def resolve_mode(value: str | None) -> TransportMode:
    """The mode a flag names, or ``MOONCAKE_RL_TRANSPORT`` (default ``store``) without one."""
    if value is None:
        try:
            return TransportMode(Settings().transport)
        except ValidationError as error:
            bad = [e for e in error.errors() if e["loc"] == ("transport",)]
            if not bad:
                raise
            raise ConfigurationError(
                f"unknown transport {bad[0]['input']!r} in MOONCAKE_RL_TRANSPORT; valid: {_VALID}"
            ) from error
    try:
        return TransportMode(value)
    except ValueError:
        raise ConfigurationError(f"unknown transport {value!r}; valid: {_VALID}") from None


def require_store_path(chosen: TransportMode, mode: str, pull: str, option: str = "--{}") -> None:
    """Refuse the Store-path options (``mode`` direct, ``pull`` node) with another transport:
    broadcast and CPU serialization deliver full tensors and read no Store. ``option``
    spells a setting's name where the caller sets it (a CLI flag, a VeRL key)."""
    if chosen is TransportMode.STORE:
        return
    if mode != "compat":
        raise ConfigurationError(
            f"{option.format('mode')} {mode} is a Store-path mode; the {chosen.value} transport "
            f"delivers full tensors (compat): drop {option.format('mode')} or use "
            f"{option.format('transport')} store"
        )
    if pull != "single":
        raise ConfigurationError(
            f"{option.format('pull')} {pull} chooses how the Store is read; the {chosen.value} "
            f"transport does not read it: drop {option.format('pull')} or use "
            f"{option.format('transport')} store"
        )


def parse_gpu_ids(text: str | Sequence[str], what: str) -> tuple[str, ...]:
    """Physical GPU ids (CUDA UUIDs, or labels such as ``host0:3``), in the order given.

    ``text`` is comma-separated or already split; an empty string declares nothing (the
    settings' default). Ids are compared across engines and the train pool, so a typo or a
    repeated id is refused here rather than silently splitting the pool wrong.
    """
    if isinstance(text, str):
        if not text.strip():
            return ()
        items = text.split(",")
    else:
        items = list(text)
    ids: list[str] = []
    for raw in items:
        item = raw.strip()
        if not item:
            raise ConfigurationError(
                f"{what}: empty GPU id in {text!r}; list ids separated by single commas"
            )
        if not _GPU_ID.match(item):
            raise ConfigurationError(
                f"{what}: bad GPU id {item!r}; use 1-128 letters, digits, '.', '_', ':', '-' "
                "(a CUDA UUID such as GPU-6f1c... or a label such as host0:3)"
            )
        if item in ids:
            raise ConfigurationError(
                f"{what}: GPU id {item!r} is listed twice; one physical GPU is one rank"
            )
        ids.append(item)
    return tuple(ids)
