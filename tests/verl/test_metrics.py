"""The bridge's ``metrics_textfile`` refuses a name node exporters ignore; rollout rank 0
rewriting it after a real sync is checked in ``tests/verl/test_sync_e2e.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

from mooncake_rl.errors import ConfigurationError
from mooncake_rl.services import EmbeddedMaster
from tests.test_metrics import MODEL


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


def test_a_textfile_node_exporter_would_ignore_is_refused_at_construction(
    master: EmbeddedMaster,
) -> None:
    with pytest.raises(ConfigurationError, match=r"must end in \.prom"):
        rollout_engine(master, metrics_textfile="/var/lib/node_exporter/mooncake.txt")
