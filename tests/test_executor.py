"""The data plane with hand-written routing: real Store reads and TE pushes across processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mooncake_rl.apply.executor import Batch, PushOp, ReadOp
from mooncake_rl.apply.process import WorkerCluster
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.store import StoreClient
from tests.conftest import settings_for


def put_objects(master: EmbeddedMaster, holder_segment: str, objects: dict[str, bytes]) -> None:
    with StoreClient(
        settings_for(master, "writer", segment_bytes=0, local_segment=holder_segment)
    ) as store:
        for key, data in objects.items():
            store.put_bytes(key, data, preferred_segments=[holder_segment])


def blob(seed: int, size: int) -> bytes:
    return (
        torch.randint(
            0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
        )
        .numpy()
        .tobytes()
    )


@pytest.fixture
def cluster(master: EmbeddedMaster):
    clusters: list[WorkerCluster] = []

    def make(workers: dict[str, str], regions: dict[str, int], **overrides: Any) -> WorkerCluster:
        settings = {
            w: settings_for(master, n, segment_bytes=0, **overrides) for w, n in workers.items()
        }
        clusters.append(WorkerCluster(settings, dict.fromkeys(workers, regions)))
        return clusters[-1]

    yield make
    for made in clusters:
        made.close()


def test_reads_and_pushes_land_byte_exact(master: EmbeddedMaster, holders, cluster) -> None:
    a, b = blob(1, 300_000), blob(2, 200_000)
    put_objects(master, holders("store-node").segment, {"exec/a": a, "exec/b": b})
    workers = cluster({"w0": "node-0", "w1": "node-1"}, {"recv": 500_000})
    # w0 reads a (in 3 batches of 100k) and pushes each batch to w1; w1 reads b and pushes to w0.
    w0 = [
        Batch(
            reads=(ReadOp("exec/a", i * 100_000, "recv", i * 100_000, 100_000),),
            pushes=(PushOp("w1", "recv", i * 100_000, "recv", i * 100_000, 100_000),),
        )
        for i in range(3)
    ]
    w1 = [
        Batch(
            reads=(ReadOp("exec/b", 0, "recv", 300_000, 200_000),),
            pushes=(PushOp("w0", "recv", 300_000, "recv", 300_000, 200_000),),
        )
    ]
    descriptions = [workers.call(w, "prepare", [plan]) for w, plan in (("w0", w0), ("w1", w1))]
    results = workers.call_all({"w0": ("run", w0, descriptions), "w1": ("run", w1, descriptions)})
    assert all(status == "ok" for status, _ in results.values()), results
    r0, r1 = results["w0"][1], results["w1"][1]
    assert (r0["counters"].store_read_bytes, r0["counters"].te_pushed_bytes) == (300_000, 300_000)
    assert (r1["counters"].store_read_bytes, r1["counters"].te_pushed_bytes) == (200_000, 200_000)
    assert r0["result"].pushed_per_peer == {"w1": 300_000}
    for worker in ("w0", "w1"):
        assert workers.call(worker, "dump", "recv") == a + b


def test_staging_never_exceeds_the_watermark(master: EmbeddedMaster, holders, cluster) -> None:
    data = blob(3, 1 << 20)
    put_objects(master, holders("store-node").segment, {"exec/wm": data})
    chunk = 64 << 10
    workers = cluster(
        {"w0": "node-0", "w1": "node-1"},
        {"recv": 1 << 20},
        batch_bytes=chunk,
        staging_watermark_bytes=2 * chunk,
    )
    plan = [
        Batch(
            reads=(ReadOp("exec/wm", o, "recv", o, chunk),),
            pushes=(PushOp("w1", "recv", o, "recv", o, chunk),),
        )
        for o in range(0, 1 << 20, chunk)
    ]
    descriptions = [workers.call("w0", "prepare", [plan]), workers.call("w1", "prepare", [[]])]
    result = workers.call("w0", "run", plan, descriptions)["result"]
    assert result.batches == 16 and result.read_bytes == 1 << 20
    assert chunk <= result.peak_staging_bytes <= 2 * chunk
    assert workers.call("w1", "dump", "recv") == data


def test_wrong_range_length_is_refused_before_anything_moves(
    master: EmbeddedMaster, holders, cluster
) -> None:
    put_objects(master, holders("store-node").segment, {"exec/len": blob(4, 1000)})
    workers = cluster({"w0": "node-0"}, {"recv": 1000})
    too_long = [Batch(reads=(ReadOp("exec/len", 0, "recv", 0, 1001),))]
    with pytest.raises(RuntimeError, match=r"range \[0, 1001\) outside region recv of 1000 bytes"):
        workers.call("w0", "prepare", [too_long])
    unknown = [Batch(reads=(ReadOp("exec/len", 0, "staging", 0, 10),))]
    with pytest.raises(RuntimeError, match="local has no region 'staging'"):
        workers.call("w0", "prepare", [unknown])
    assert workers.call("w0", "dump", "recv") == bytes(1000)


def test_te_failure_mid_apply_names_the_peer(master: EmbeddedMaster, holders, cluster) -> None:
    data = blob(5, 400_000)
    put_objects(master, holders("store-node").segment, {"exec/te": data})
    workers = cluster({"w0": "node-0", "w1": "node-1"}, {"recv": 400_000})
    plan = [
        Batch(
            reads=(ReadOp("exec/te", o, "recv", o, 100_000),),
            pushes=(PushOp("w1", "recv", o, "recv", o, 100_000),),
        )
        for o in range(0, 400_000, 100_000)
    ]
    descriptions = [workers.call("w0", "prepare", [plan]), workers.call("w1", "prepare", [[]])]
    workers.processes["w1"].kill()
    workers.processes["w1"].join()
    status, detail = workers.call_all({"w0": ("run", plan, descriptions)})["w0"]
    assert status == "error"
    assert "peer worker w1" in detail and "TransferFailed" in detail


def test_missing_object_fails_the_read_with_its_key(master: EmbeddedMaster, cluster) -> None:
    workers = cluster({"w0": "node-0"}, {"recv": 100})
    plan = [Batch(reads=(ReadOp("exec/absent", 0, "recv", 0, 100),))]
    descriptions = [workers.call("w0", "prepare", [plan])]
    status, detail = workers.call_all({"w0": ("run", plan, descriptions)})["w0"]
    assert status == "error" and "OBJECT_NOT_FOUND (-704)" in detail and "exec/absent" in detail
