"""The bridge's ``metrics_textfile``: rollout rank 0 rewrites it after every update, with the
totals of every update so far and the last one's own figures (``docs/metrics.md``)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("verl")

from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

from mooncake_rl.coordinator import Coordinator, UpdateFailed, UpdateResult
from mooncake_rl.errors import ConfigurationError
from mooncake_rl.services import EmbeddedMaster
from tests.engine.test_receiver_routes import by_label, samples_of
from tests.test_metrics import MODEL, result
from verl_bridge.publish import SyncOutcome


def rollout_engine(master: EmbeddedMaster, **kwargs: object) -> object:
    import_external_libs("verl_bridge.backend")
    return CheckpointEngineRegistry.new(
        "mooncake_store",
        bucket_size=1 << 20,
        model=MODEL,
        master=master.master_address,
        metadata=master.metadata_url,
        engine_urls=["http://engine-a:8000"],
        **kwargs,
    )


def test_the_bridge_rewrites_its_textfile_after_every_update(
    master: EmbeddedMaster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    updates = iter([result(), UpdateFailed(result(committed=[], rebuild=[]))])

    def update(self: Coordinator, model: str, **options: object) -> UpdateResult:
        outcome = next(updates)
        if isinstance(outcome, UpdateFailed):
            raise outcome
        return outcome

    monkeypatch.setattr(Coordinator, "update", update)
    textfile = tmp_path / "verl.prom"
    engine = rollout_engine(master, metrics_textfile=str(textfile))
    try:
        # What init_process_group and receive_weights leave on rollout rank 0 after a
        # trainer published generation 5 (the sync itself: tests/verl/test_sync_e2e.py).
        engine._sync_id = "1" * 32
        engine._outcome = SyncOutcome(engine._sync_id, ok=True, generation=5)
        engine.update_engines()
        first = samples_of(textfile.read_text())
        with pytest.raises(UpdateFailed):
            engine.update_engines()
        second = samples_of(textfile.read_text())
    finally:
        engine.close()
    assert by_label(first, "updates_total") == {"committed": 1}
    assert by_label(second, "updates_total") == {"committed": 1, "failed": 1}
    assert second[("mooncake_rl_update_store_read_bytes_total", ())] == 2000
    assert by_label(second, "update_failures_total") == {"prepare_failed": 2}
    assert second[("mooncake_rl_update_rebuilds_total", ())] == 1  # the first update's
    assert second[("mooncake_rl_update_last_success", ())] == 0
    assert by_label(second, "update_last_engines") == {
        "committed": 0,
        "skipped": 0,
        "failed": 1,
        "rebuild": 0,
    }


def test_a_textfile_node_exporter_would_ignore_is_refused_at_construction(
    master: EmbeddedMaster,
) -> None:
    with pytest.raises(ConfigurationError, match=r"must end in \.prom"):
        rollout_engine(master, metrics_textfile="/var/lib/node_exporter/mooncake.txt")
