"""Test helpers: tiny models, placements, and a byte-level executor used as an oracle.

The executor runs a routing table the way the apply pipeline must (per worker: stage 1
batches of reads then pushes; barrier; stage 2 pushes), on real bytes, refusing to copy
bytes that have not arrived and to write a byte twice. Its result is compared with what
each worker should hold, computed independently with numpy slicing of the tensors.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mooncake.reshard.weight import (
    OwnershipAxis,
    ParallelRank,
    PlacementFragment,
    ReplicatedAxis,
    SplitAxis,
    StoredFragment,
    TensorDescriptor,
    WeightManifest,
    WeightPlacementPart,
)

from mooncake_rl.plan import STAGING_REGION, CompatDemand, Destinations, RoutingTable, object_key
from mooncake_rl.protocol import reported_placement

ITEMSIZE = {"uint8": 1, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Spec:
    """A test tensor: ``kind`` is 'replicated', 'split' (on ``dim``) or 'owned'."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    kind: str = "replicated"
    dim: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def manifest(
    specs: list[Spec], generation: int = 1, model: str = "m", packed: bool = False
) -> WeightManifest:
    """One object per tensor, or (``packed``) tensors cut in two row blocks spread over three
    shared objects, to exercise multi-fragment sources."""
    group = f"mooncake-rl/{model}/g{generation:012d}"
    fragments = []
    cursor = {}
    for i, s in enumerate(specs):
        for j, (offset, local) in enumerate(source_boxes(s, packed)):
            nbytes = math.prod(local) * ITEMSIZE[s.dtype]
            name = f"blob{i % 3}" if packed else s.name
            at = cursor.get(name, 0)
            cursor[name] = at + nbytes + (8 if packed else 0)
            fragments.append(
                StoredFragment(
                    fragment_id=f"{s.name}#{j}",
                    tensor_id=s.name,
                    global_offset=offset,
                    local_shape=local,
                    object_key=object_key(group, name),
                    object_offset=at,
                    nbytes=nbytes,
                )
            )
    return WeightManifest(
        namespace="mooncake-rl",
        resource_id=model,
        revision="r",
        weight_generation=generation,
        group_id=group,
        manifest_key=f"{group}/manifest",
        tensors=tuple(_descriptor(s, (), ()) for s in specs),
        fragments=tuple(fragments),
        created_at="now",
    )


def source_boxes(s: Spec, packed: bool):
    """Stored boxes of a tensor: whole, or two row blocks along dim 0 when packed."""
    rows = s.shape[0]
    if not packed or rows < 2:
        return [((0,) * len(s.shape), s.shape)]
    cut = rows // 2
    rest = (0,) * (len(s.shape) - 1)
    return [((0, *rest), (cut, *s.shape[1:])), ((cut, *rest), (rows - cut, *s.shape[1:]))]


def stored_objects(m: WeightManifest, specs: list[Spec], data: dict[str, bytes]):
    """Object contents the publisher would have put, from logical tensor bytes."""
    spec = {s.name: s for s in specs}
    prefix = f"{m.group_id}/payload/"
    out: dict[str, bytearray] = {}
    for f in m.fragments:
        name = f.object_key[len(prefix) :]
        chunk = fragment_bytes(spec[f.tensor_id], data[f.tensor_id], f.global_offset, f.local_shape)
        blob = out.setdefault(name, bytearray())
        blob.extend(b"\xee" * max(0, f.object_offset + len(chunk) - len(blob)))
        blob[f.object_offset : f.object_offset + len(chunk)] = chunk
    return {k: bytes(v) for k, v in out.items()}


def _descriptor(s: Spec, shard_dims, axes) -> TensorDescriptor:
    return TensorDescriptor(
        s.name, s.shape, s.dtype, ITEMSIZE[s.dtype], shard_dims, "row-major", axes, None, None
    )


def fragment_box(s: Spec, tp: int, r: int, dim: int | None = None):
    """(global_offset, local_shape) rank ``r`` of TP ``tp`` holds, or None; a split tensor
    is split along ``dim`` (default ``s.dim``)."""
    if s.kind == "replicated" or tp == 1:
        return (0,) * len(s.shape), s.shape
    if s.kind == "owned":
        owner = sum(map(ord, s.name)) % tp
        return ((0,) * len(s.shape), s.shape) if owner == r else None
    dim = s.dim if dim is None else dim
    size = s.shape[dim] // tp
    offset = tuple(r * size if d == dim else 0 for d in range(len(s.shape)))
    local = tuple(size if d == dim else n for d, n in enumerate(s.shape))
    return offset, local


def parts(
    specs: list[Spec], tp: int, pieces: bool = False, dims: dict[str, int] | None = None
) -> list[WeightPlacementPart]:
    """One instance of TP ``tp``: one part per rank; ``pieces`` cuts each box in two rows;
    ``dims`` overrides the split dim of split tensors for this instance (engines of one
    cluster may split the same tensor along different dims)."""
    dims = dims or {}
    out = []
    for r in range(tp):
        rank = ParallelRank(tp=r)
        tensors, fragments = [], []
        for s in specs:
            dim = dims.get(s.name, s.dim)
            box = fragment_box(s, tp, r, dim)
            if box is None:
                continue
            if tp == 1 or s.kind == "replicated":
                axes, shard_dims = (ReplicatedAxis("tp"),), ()
            elif s.kind == "owned":
                axes, shard_dims = (OwnershipAxis("tp"),), ()
            else:
                axes, shard_dims = (SplitAxis("tp", dim),), (dim,)
            tensors.append(_descriptor(s, shard_dims, axes))
            for offset, local in _cut(*box) if pieces else [box]:
                nbytes = math.prod(local) * ITEMSIZE[s.dtype]
                fragments.append(PlacementFragment(s.name, offset, local, nbytes, rank))
        out.append(
            WeightPlacementPart(
                resource_id="m",
                revision="r",
                weight_generation=0,
                placement_set_id="ps",
                topology_id="t",
                participant_id=f"tp{r}",
                rank=rank,
                tensors=tuple(tensors),
                fragments=tuple(fragments),
            )
        )
    return out


def landings(destinations: Destinations) -> dict[str, tuple[str, int]]:
    """Each placement fragment's (region, base offset): the mapping ``Destinations.of`` took."""
    rows = zip(destinations.fragment_regions, destinations.fragment_bases, strict=True)
    return dict(zip(destinations.fragment_ids, rows, strict=True))


def _cut(offset, local):
    if local[0] < 2:
        return [(offset, local)]
    half = local[0] // 2
    first = (offset, (half, *local[1:]))
    second = ((offset[0] + half, *offset[1:]), (local[0] - half, *local[1:]))
    return [first, second]


def contents(specs: list[Spec], seed: int = 0) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    return {s.name: rng.integers(0, 256, s.nbytes, dtype=np.uint8).tobytes() for s in specs}


def fragment_bytes(spec: Spec, data: bytes, offset, local) -> bytes:
    """Row-major bytes of the box ``offset/local`` of the tensor (independent of the planner)."""
    itemsize = ITEMSIZE[spec.dtype]
    array = np.frombuffer(data, dtype=np.uint8).reshape(*spec.shape, itemsize)
    index = tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))
    return array[index].tobytes()


def _ranges(record, src_name: str):
    length, count = int(record["length"]), int(record["count"])
    src, dst = int(record[src_name]), int(record["dst_offset"])
    s_stride, d_stride = int(record["src_stride"]), int(record["dst_stride"])
    return [(src + k * s_stride, dst + k * d_stride, length) for k in range(count)]


def execute(table: RoutingTable, objects: dict[str, bytes]):
    """Run the table on bytes; returns (buffers, written masks, node NIC bytes)."""
    sizes = {
        (int(w), int(r)): int(n)
        for w, r, n in zip(
            table.region_sizes["worker"],
            table.region_sizes["region"],
            table.region_sizes["size"],
            strict=True,
        )
    }
    buffers = {k: np.zeros(n, np.uint8) for k, n in sizes.items()}
    written = {k: np.zeros(n, bool) for k, n in sizes.items()}
    nic = np.zeros(len(table.nodes), np.int64)

    def land(key, dst, chunk):
        mask = written[key][dst : dst + len(chunk)]
        assert len(mask) == len(chunk), f"write past region end {key}"
        assert not mask.any(), f"byte written twice in {key} at {dst}"
        buffers[key][dst : dst + len(chunk)] = chunk
        mask[:] = True

    def push(p):
        sender, peer = int(p["worker"]), int(p["peer"])
        src_key, dst_key = (sender, int(p["src_region"])), (peer, int(p["dst_region"]))
        for src, dst, length in _ranges(p, "src_offset"):
            assert written[src_key][src : src + length].all(), "push of bytes not yet arrived"
            land(dst_key, dst, buffers[src_key][src : src + length].copy())
            if table.worker_node[sender] != table.worker_node[peer]:
                nic[table.worker_node[sender]] += length

    for w in range(len(table.workers)):
        for batch in table.batches(table.workers[w]):
            if batch.stage != 1:
                continue
            for r in batch.reads:
                data = np.frombuffer(objects[table.objects[int(r["object"])]], np.uint8)
                for src, dst, length in _ranges(r, "src_offset"):
                    assert src + length <= len(data), "read past object end"
                    land((w, int(r["dst_region"])), dst, data[src : src + length])
                    nic[table.worker_node[w]] += length
            for p in batch.pushes:
                push(p)
    for w in range(len(table.workers)):  # the coordinator's barrier is here
        for batch in table.batches(table.workers[w]):
            if batch.stage == 2:
                for p in batch.pushes:
                    push(p)
    return buffers, written, nic


def check_delivery(table, buffers, written, expected) -> None:
    """``expected``: {(worker index, region name): [(offset, bytes)]}; nothing else written."""
    region_id = {name: i for i, name in enumerate(table.regions)}
    want = {}
    for (w, region), pieces in expected.items():
        key = (w, region_id[region])
        mask = np.zeros(len(buffers[key]), bool)
        for offset, data in pieces:
            got = buffers[key][offset : offset + len(data)].tobytes()
            assert got == data, f"wrong bytes at worker {w} {region}@{offset}"
            assert written[key][offset : offset + len(data)].all(), "demanded byte not written"
            mask[offset : offset + len(data)] = True
        want[key] = mask
    for key, mask in written.items():
        if table.regions[key[1]] == STAGING_REGION:
            continue
        extra = mask & ~want.get(key, np.zeros(len(mask), bool))
        assert not extra.any(), f"undemanded bytes written at {key}"


def reporting(engines: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """The engines as real ones describe themselves: each worker reports its digest."""
    return {url: [reported_placement(w) for w in workers] for url, workers in engines.items()}


def run_bench(
    *flags: str, module: str = "bench.plan", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m bench.plan`` (or ``module``) with ``flags`` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", module, *flags],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )


def bench_plan(*flags: str, module: str = "bench.plan") -> dict[str, Any]:
    """The one JSON object ``python -m bench.plan`` (or ``module``) prints for ``flags``."""
    return json.loads(run_bench(*flags, module=module).stdout)


def expected_delivery(table, specs, data, demand, part_of, destinations):
    """What each worker region must hold after ``table`` ran: every fragment of its part
    (compat: every tensor) where its destinations (or the default regions) put it."""
    spec = {s.name: s for s in specs}
    expected = defaultdict(list)
    for w, worker_id in enumerate(table.workers):
        if isinstance(demand, CompatDemand):
            for s in specs:
                expected[(w, "compat")].append((table.compat.offset(s.name), data[s.name]))
            continue
        where = {}
        if worker_id in destinations:
            where = landings(destinations[worker_id])
        for f in part_of[worker_id].fragments:
            region, base = where.get(f.placement_fragment_id, (f.placement_fragment_id, 0))
            chunk = fragment_bytes(
                spec[f.tensor_id], data[f.tensor_id], f.global_offset, f.local_shape
            )
            expected[(w, region)].append((base, chunk))
    return expected
