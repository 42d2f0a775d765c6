"""Routing tables kept in the Mooncake Store, so that a fresh process reuses them.

A table depends only on its :class:`PlanKey`, so the first coordinator to plan it (a 1T MoE
takes seconds) leaves it in the Store under :func:`entry_key`, and the next process (another
``mooncake-rl update``, a restarted VeRL bridge) loads it instead of planning again.

An entry is bytes, never pickle::

    b"MRLPLAN\\0" | u32 format version | u32 header length | header (JSON) | pad | body

The header holds the key the entry was stored under, the table's scalars, how many names
each list has, every array's dtype, length and offset in the body, and the XXH3-128 of the
body. The body is the arrays, each 64-byte aligned, then the names (UTF-8, NUL-separated).
A load is zero-copy: every array is a numpy view of the buffer the Store read into.

With a ``plan_dir`` (``MOONCAKE_RL_PLAN_DIR``), every entry saved or loaded is also kept
as a file on this node (:class:`LocalTables`), and a load maps that file before it asks the
Store: the same bytes, checked the same way, without moving a 1T MoE's 185 MB table over
the network again.

A loaded entry is used only when its magic and format version are this module's, its key
equals the wanted key, its body hashes to the recorded digest and the table passes
``RoutingTable``'s structural checks. Only validated tables are saved (the planner runs
``validate_routing_table`` before caching, seconds for a 1T MoE, too slow for a load), and
the hash proves the bytes loaded are the bytes saved. Anything else is logged, removed and
replanned: never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

from mooncake_rl.errors import InvariantViolation, MooncakeError, ObjectNotFound
from mooncake_rl.generations.keys import routing_table_key
from mooncake_rl.plan.cache import PlanKey
from mooncake_rl.plan.demand import CompatLayout
from mooncake_rl.plan.table import RoutingTable

if TYPE_CHECKING:
    from mooncake_rl.store import StoreClient

logger = logging.getLogger(__name__)

MAGIC = b"MRLPLAN\0"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<8sII")  # magic, format version, header length
ALIGN = 64
ARRAYS = ("worker_node", "object_sizes", "region_sizes", "reads", "pushes", "demands")
NAMES = ("workers", "nodes", "objects", "regions")


def key_fields(key: PlanKey) -> dict[str, Any]:
    """The plan key as JSON values: what an entry records and what a load compares."""
    return {
        "source_digest": key.source_digest,
        "target_digest": key.target_digest,
        "topology_digest": key.topology_digest,
        "params": asdict(key.params),
    }


def entry_key(key: PlanKey) -> str:
    """The Store key of the table planned for ``key``."""
    canonical = json.dumps(key_fields(key), sort_keys=True, separators=(",", ":"))
    return routing_table_key(key.source_digest, hashlib.sha256(canonical.encode()).hexdigest())


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def encode_table(table: RoutingTable) -> np.ndarray:
    """The table as one entry (uint8), under the key it was planned for."""
    arrays = {name: np.ascontiguousarray(getattr(table, name)) for name in ARRAYS}
    names = {name: getattr(table, name) for name in NAMES}
    if table.compat is not None:
        arrays["compat_offsets"] = np.ascontiguousarray(table.compat.offsets)
        arrays["compat_nbytes"] = np.ascontiguousarray(table.compat.nbytes)
        names["compat_tensor_ids"] = table.compat.tensor_ids
    text = [name for group in names.values() for name in group]
    if any("\0" in name for name in text):
        raise InvariantViolation("a routing table name contains NUL, which entries cannot hold")
    arrays["names"] = np.frombuffer("\0".join(text).encode(), np.uint8)
    layout, size = {}, 0
    for name, array in arrays.items():
        size = _aligned(size)
        layout[name] = [np.lib.format.dtype_to_descr(array.dtype), len(array), size]
        size += array.nbytes
    body = np.zeros(size, np.uint8)
    for name, array in arrays.items():
        offset = layout[name][2]
        body[offset : offset + array.nbytes] = array.view(np.uint8)
    key = PlanKey(table.source_digest, table.target_digest, table.topology_digest, table.params)
    header = json.dumps(
        {
            "key": key_fields(key),
            "mode": table.mode,
            "lower_bound_bytes": table.lower_bound_bytes,
            "max_chunk_cost": table.max_chunk_cost,
            "compat_total_bytes": None if table.compat is None else table.compat.total_bytes,
            "names": {name: len(group) for name, group in names.items()},
            "arrays": layout,
            "body_xxh3_128": xxhash.xxh3_128_hexdigest(body),
        },
        separators=(",", ":"),
    ).encode()
    start = _aligned(PREFIX.size + len(header))
    entry = np.zeros(start + size, np.uint8)
    entry[: PREFIX.size] = np.frombuffer(PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)), np.uint8)
    entry[PREFIX.size : PREFIX.size + len(header)] = np.frombuffer(header, np.uint8)
    entry[start:] = body
    return entry


def decode_table(entry: np.ndarray, key: PlanKey) -> RoutingTable:
    """The table an entry holds, as views of ``entry``; raises :class:`InvariantViolation`
    naming why the entry is unusable for ``key``."""
    if len(entry) < PREFIX.size:
        raise InvariantViolation(f"the entry is truncated ({len(entry)} bytes)")
    magic, version, header_bytes = PREFIX.unpack_from(entry)
    if magic != MAGIC:
        raise InvariantViolation("the entry is not a routing table")
    if version != FORMAT_VERSION:
        raise InvariantViolation(
            f"the entry has format version {version}; this reader knows {FORMAT_VERSION}"
        )
    try:
        header = json.loads(entry[PREFIX.size : PREFIX.size + header_bytes].tobytes())
        stored_key = header["key"]
    except (ValueError, TypeError, KeyError) as error:
        raise InvariantViolation(f"the entry's header does not parse: {error}") from None
    if stored_key != key_fields(key):
        raise InvariantViolation("the entry was stored for another plan key")
    body = entry[_aligned(PREFIX.size + header_bytes) :]
    if xxhash.xxh3_128_hexdigest(body) != header.get("body_xxh3_128"):
        raise InvariantViolation("the entry's body does not match its digest (corrupt or cut)")
    try:
        return _table(header, body, key)
    except (ValueError, TypeError, KeyError) as error:
        raise InvariantViolation(f"the entry's header is malformed: {error}") from None


def _table(header: dict[str, Any], body: np.ndarray, key: PlanKey) -> RoutingTable:
    arrays = {
        name: np.frombuffer(body, np.lib.format.descr_to_dtype(descr), count, offset)
        for name, (descr, count, offset) in header["arrays"].items()
    }
    counts = header["names"]
    text = arrays.pop("names").tobytes().decode()
    flat = text.split("\0") if sum(counts.values()) else []
    if len(flat) != sum(counts.values()):
        raise ValueError(f"{len(flat)} names where the header counts {sum(counts.values())}")
    names, start = {}, 0
    for name, count in counts.items():
        names[name] = tuple(flat[start : start + count])
        start += count
    compat = None
    if header["compat_total_bytes"] is not None:
        compat = CompatLayout(
            names["compat_tensor_ids"],
            arrays["compat_offsets"],
            arrays["compat_nbytes"],
            header["compat_total_bytes"],
        )
        if not len(compat.tensor_ids) == len(compat.offsets) == len(compat.nbytes):
            raise ValueError("compat layout lengths differ")
    return RoutingTable(
        mode=header["mode"],
        source_digest=key.source_digest,
        target_digest=key.target_digest,
        topology_digest=key.topology_digest,
        params=key.params,
        workers=names["workers"],
        nodes=names["nodes"],
        worker_node=arrays["worker_node"],
        objects=names["objects"],
        object_sizes=arrays["object_sizes"],
        regions=names["regions"],
        region_sizes=arrays["region_sizes"],
        reads=arrays["reads"],
        pushes=arrays["pushes"],
        demands=arrays["demands"],
        compat=compat,
        lower_bound_bytes=header["lower_bound_bytes"],
        max_chunk_cost=header["max_chunk_cost"],
    )


class LocalTables:
    """Entries as files in one node-local folder, mapped read-only on load.

    Files are named after the entry's Store key, written whole under a temporary name and
    renamed, so a reader never maps half a file; the newest ``keep`` stay. A file is only a
    copy: it is checked like a Store entry, and a bad one is removed.
    """

    def __init__(self, folder: Path, keep: int = 4) -> None:
        if keep < 1:
            raise InvariantViolation("a plan folder must keep at least one table")
        self.folder = folder
        self.keep = keep

    def path(self, name: str) -> Path:
        return self.folder / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.plan"

    def read(self, name: str) -> np.ndarray | None:
        try:
            return np.memmap(self.path(name), np.uint8, mode="r")
        except (FileNotFoundError, ValueError):  # ValueError: an empty file
            return None

    def write(self, name: str, entry: np.ndarray) -> None:
        path = self.path(name)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")
            partial.write_bytes(memoryview(np.ascontiguousarray(entry)))
            os.replace(partial, path)
            for stale in sorted(self.folder.glob("*.plan"), key=_mtime, reverse=True)[self.keep :]:
                stale.unlink(missing_ok=True)
        except OSError as error:
            logger.warning("routing table %s is not kept in %s (%s)", name, self.folder, error)

    def drop(self, name: str, why: str) -> None:
        logger.warning("ignoring routing table file %s: %s; removing it", self.path(name), why)
        self.path(name).unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


class StoredTables:
    """A :class:`PlanCache` backing in the Store: one copy per table without a hard pin,
    preferring this node's segment holder, and a node-local file copy when the settings
    name a ``plan_dir``. The Store may evict it; a missing table is planned again, so
    neither a Store failure nor a bad entry ever fails an update."""

    def __init__(self, store: StoreClient) -> None:
        self.store = store
        folder = store.settings.plan_dir
        self.local = None if folder is None else LocalTables(folder)

    def load(self, key: PlanKey) -> RoutingTable | None:
        name = entry_key(key)
        if self.local is not None and (entry := self.local.read(name)) is not None:
            try:
                return decode_table(entry, key)
            except InvariantViolation as error:
                self.local.drop(name, str(error))
        try:
            entry = self.store.get_array(name)
        except ObjectNotFound:
            return None
        except MooncakeError as error:
            return self._discard(name, f"it cannot be read: {error}")
        try:
            table = decode_table(entry, key)
        except InvariantViolation as error:
            return self._discard(name, str(error))
        if self.local is not None:
            self.local.write(name, entry)
        return table

    def save(self, key: PlanKey, table: RoutingTable) -> None:
        """Keep ``table`` (a put to an existing key is ignored: a table of one key is the
        same table whoever planned it)."""
        name = entry_key(key)
        entry = encode_table(table)
        if self.local is not None:
            self.local.write(name, entry)
        segment = self.store.settings.local_segment
        try:
            self.store.put_tensor(
                name,
                torch.from_numpy(entry),
                preferred_segments=(segment,) if segment else (),
                hard_pin=False,
            )
        except (InvariantViolation, MooncakeError) as error:
            logger.warning(
                "routing table %s is not kept in the Store (%s): the next process plans it again",
                name,
                error,
            )

    def _discard(self, name: str, why: str) -> None:
        logger.warning(
            "ignoring routing table %s in the Store: %s; planning it again and replacing it",
            name,
            why,
        )
        self.store.remove([name], force=True)
        return None
