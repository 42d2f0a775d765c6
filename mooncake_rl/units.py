"""Byte sizes as people write them on command lines: ``4096``, ``64MiB``, ``1.5GiB``."""

from __future__ import annotations

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_size(text: str) -> int:
    """Bytes: a plain number, or a number followed by KiB, MiB or GiB; ValueError otherwise."""
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)
