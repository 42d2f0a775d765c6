"""``gather_json`` over a real two-rank gloo group: every rank gets every rank's value, in
rank order, whatever their sizes (the ``mooncake_store`` engine's TP ranks agree this way)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import torch.distributed as dist

from engine_ext.ranks import gather_json
from mooncake_rl.services import free_port


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        value = {"rank": rank, "ok": rank == 0, "error": "é" * (1000 * rank)}
        Path(out, f"{rank}.json").write_text(json.dumps(gather_json(value, dist.group.WORLD)))
    finally:
        dist.destroy_process_group()


def test_a_group_of_one_needs_no_collective() -> None:
    assert gather_json({"ok": True}, None) == [{"ok": True}]


def test_two_ranks_gather_each_others_replies(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")  # the parent imported torch already
    port = free_port()
    ranks = [context.Process(target=_rank, args=(r, port, str(tmp_path))) for r in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(60)
        assert process.exitcode == 0
    expected = [{"rank": 0, "ok": True, "error": ""}, {"rank": 1, "ok": False, "error": "é" * 1000}]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == expected
