"""One tensor of a delta generation: what changed between its stored bytes in N-1 and in N.

    base (N-1's bytes), new (N's bytes) --diff--> TensorDelta: changed positions and their
        new elements, or the whole tensor when that is smaller
    TensorDelta --encode--> one entry's bytes;  entry bytes --decode--> TensorDelta (checked)
    base --apply_delta (in place)--> N's bytes

Why: consecutive RL policies barely differ in the dtype engines serve. Steps of about the
learning rate change 1-3 % of bf16 elements (DESIGN.md), so positions and new values are a
small fraction of the tensor. Elements compare as raw words (their bits), so NaN payloads,
signed zeros and fp8 codes round-trip exactly.

Positions are encoded the smallest of three ways for the tensor's change rate:

- ``gaps16`` / ``gaps32``: the distance from each changed element to the previous one (the
  first from position 0), in 16-bit words when every distance fits, else 32-bit: 2 or 4
  bytes per change;
- ``bitmask``: one bit per element (numel / 8 bytes), which wins above about 6 % changed in
  16-bit gaps;
- ``whole``: no positions, the new tensor itself, when positions and values together would
  not be smaller.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np

from mooncake_rl.errors import InvariantViolation

Encoding = Literal["gaps16", "gaps32", "bitmask", "whole"]
ENCODINGS: tuple[Encoding, ...] = ("gaps16", "gaps32", "bitmask", "whole")
WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
"""An element's raw bits, by itemsize."""
MAGIC = b"MRLDELT\0"
HEADER = struct.Struct("<8sBBxxQQ")  # magic, encoding, itemsize, numel, changed
Count = TypeVar("Count", int, np.ndarray)


@dataclass(frozen=True)
class TensorDelta:
    """A tensor of ``numel`` elements of ``itemsize`` bytes, as N-1's bytes plus changes:
    ``positions`` in the encoding's format and ``values``, the ``changed`` new elements in
    position order (``whole``: no positions, ``values`` is the new tensor)."""

    encoding: Encoding
    itemsize: int
    numel: int
    changed: int
    positions: bytes
    values: bytes

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise InvariantViolation(f"unknown delta encoding {self.encoding!r}")
        if self.itemsize not in WORDS:
            raise InvariantViolation(f"elements of {self.itemsize} bytes cannot be delta-coded")
        if not 0 <= self.changed <= self.numel:
            raise InvariantViolation(f"{self.changed} changed elements in a tensor of {self.numel}")
        if len(self.positions) != positions_bytes(self.encoding, self.numel, self.changed):
            raise InvariantViolation(
                f"{self.encoding} positions of {self.changed} changes in {self.numel} elements "
                f"take {positions_bytes(self.encoding, self.numel, self.changed)} bytes, "
                f"not {len(self.positions)}"
            )
        values = self.numel if self.encoding == "whole" else self.changed
        if len(self.values) != values * self.itemsize:
            raise InvariantViolation(
                f"{values} values of {self.itemsize} bytes take {values * self.itemsize} "
                f"bytes, not {len(self.values)}"
            )

    @property
    def nbytes(self) -> int:
        """What an entry holding this delta weighs (header included)."""
        return HEADER.size + len(self.positions) + len(self.values)


def positions_bytes(encoding: Encoding, numel: Count, changed: Count) -> Count:
    """Bytes of the positions of ``changed`` changes among ``numel`` elements (per element
    of arrays of them, too)."""
    return {
        "gaps16": 2 * changed,
        "gaps32": 4 * changed,
        "bitmask": -(-numel // 8),
        "whole": 0,
    }[encoding]


def entry_holds(
    size: np.ndarray, numel: np.ndarray, writes: np.ndarray, itemsize: int
) -> np.ndarray:
    """Per entry, whether ``size`` bytes can be an entry that writes ``writes`` of its
    ``numel`` elements of ``itemsize`` bytes in some encoding (``whole`` writes them all):
    an entry's size checked against its declared extent without reading it."""
    sparse = [
        HEADER.size + positions_bytes(encoding, numel, writes) + writes * itemsize
        for encoding in ("gaps16", "gaps32", "bitmask")
    ]
    whole = (writes == numel) & (size == HEADER.size + numel * itemsize)
    return whole | np.any([size == s for s in sparse], axis=0)


def diff(base: np.ndarray, new: np.ndarray) -> TensorDelta:
    """``new`` as changes to ``base``: same itemsize and element count, any shape (their
    bytes are compared element by element), encoded the smallest way."""
    old_words, new_words = _words(base), _words(new)
    if old_words.shape != new_words.shape:
        raise InvariantViolation(
            f"a delta needs tensors of one size: {base.nbytes} bytes in {base.dtype} against "
            f"{new.nbytes} bytes in {new.dtype}"
        )
    itemsize, numel = new_words.itemsize, new_words.size
    where = np.flatnonzero(old_words != new_words)
    changed = len(where)
    gaps = np.diff(where, prepend=0)
    sizes = {
        "gaps16": positions_bytes("gaps16", numel, changed) + changed * itemsize
        if changed == 0 or int(gaps.max()) < 1 << 16
        else None,
        "gaps32": positions_bytes("gaps32", numel, changed) + changed * itemsize,
        "bitmask": positions_bytes("bitmask", numel, changed) + changed * itemsize,
        "whole": numel * itemsize,
    }
    encoding: Encoding = min(
        (e for e in ENCODINGS if sizes[e] is not None), key=lambda e: (sizes[e], e == "whole")
    )
    if encoding == "whole":
        return TensorDelta("whole", itemsize, numel, changed, b"", new_words.tobytes())
    if encoding == "bitmask":
        mask = np.zeros(numel, np.bool_)
        mask[where] = True
        positions = np.packbits(mask, bitorder="little").tobytes()
    else:
        positions = gaps.astype(np.uint16 if encoding == "gaps16" else np.uint32).tobytes()
    return TensorDelta(encoding, itemsize, numel, changed, positions, new_words[where].tobytes())


def changed_positions(delta: TensorDelta, name: str = "tensor") -> np.ndarray:
    """The changed elements' positions, ascending; refuses positions outside the tensor or
    out of order, naming ``name``."""
    if delta.encoding == "whole":
        return np.arange(delta.numel, dtype=np.int64)
    if delta.encoding == "bitmask":
        bits = np.unpackbits(np.frombuffer(delta.positions, np.uint8), bitorder="little")
        if bits[delta.numel :].any():
            raise InvariantViolation(f"{name}: a delta marks elements past its {delta.numel}")
        where = np.flatnonzero(bits[: delta.numel])
        if len(where) != delta.changed:
            raise InvariantViolation(
                f"{name}: its delta marks {len(where)} elements but says {delta.changed}"
            )
        return where
    gaps = np.frombuffer(delta.positions, np.uint16 if delta.encoding == "gaps16" else np.uint32)
    if len(gaps) > 1 and not gaps[1:].all():
        raise InvariantViolation(f"{name}: its delta repeats a position")
    where = np.cumsum(gaps, dtype=np.int64)
    if len(where) and where[-1] >= delta.numel:
        raise InvariantViolation(
            f"{name}: its delta changes element {int(where[-1])} of {delta.numel}"
        )
    return where


def apply_delta(base: np.ndarray, delta: TensorDelta, name: str = "tensor") -> None:
    """Write ``delta``'s new elements into ``base`` (N-1's bytes, writable, contiguous): it
    then holds N's. Checks everything before it writes anything."""
    if not (base.flags.c_contiguous and base.flags.writeable):
        raise InvariantViolation(f"{name}: a delta applies in place to dense, writable bytes")
    words = _words(base)
    if (words.itemsize, words.size) != (delta.itemsize, delta.numel):
        raise InvariantViolation(
            f"{name}: a delta of {delta.numel} elements of {delta.itemsize} bytes cannot "
            f"apply to {words.size} elements of {words.itemsize} bytes"
        )
    where = changed_positions(delta, name)
    words[where] = np.frombuffer(delta.values, words.dtype)


def encode(delta: TensorDelta) -> bytes:
    """One Store entry: a fixed header, the positions, the values."""
    header = HEADER.pack(
        MAGIC, ENCODINGS.index(delta.encoding), delta.itemsize, delta.numel, delta.changed
    )
    return header + delta.positions + delta.values


def decode(entry: bytes | memoryview, name: str = "tensor") -> TensorDelta:
    """The delta an entry holds, checked (positions inside the tensor, in order); refuses a
    malformed entry naming ``name``."""
    return decode_changes(entry, name)[0]


def decode_changes(
    entry: bytes | memoryview, name: str = "tensor"
) -> tuple[TensorDelta, np.ndarray]:
    """:func:`decode`, with the changed positions its check computed."""
    view = memoryview(entry)
    if len(view) < HEADER.size:
        raise InvariantViolation(f"{name}: its delta entry is truncated ({len(view)} bytes)")
    magic, code, itemsize, numel, changed = HEADER.unpack_from(view)
    if magic != MAGIC or code >= len(ENCODINGS):
        raise InvariantViolation(f"{name}: its entry is not a tensor delta")
    encoding = ENCODINGS[code]
    cut = HEADER.size + positions_bytes(encoding, numel, changed)
    try:
        delta = TensorDelta(
            encoding, itemsize, numel, changed, bytes(view[HEADER.size : cut]), bytes(view[cut:])
        )
    except InvariantViolation as error:
        raise InvariantViolation(f"{name}: {error}") from error
    return delta, changed_positions(delta, name)


def _words(tensor: np.ndarray) -> np.ndarray:
    """A tensor's elements as raw unsigned words, flat (a view when it is contiguous)."""
    if tensor.dtype.itemsize not in WORDS:
        raise InvariantViolation(
            f"elements of {tensor.dtype.itemsize} bytes ({tensor.dtype}) cannot be delta-coded"
        )
    return np.ascontiguousarray(tensor).reshape(-1).view(WORDS[tensor.dtype.itemsize])
