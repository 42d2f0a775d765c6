"""The YAML block of ``docs/verl.md``, composed by hydra on top of VeRL's ``ppo_trainer``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from tests.conftest import repo_root

DOCS = repo_root() / "docs" / "verl.md"


def docs_yaml() -> str:
    (block,) = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.S)
    return block


def compose_docs(directory: Path, overrides: Sequence[str] = ()) -> DictConfig:
    """The job config a user of the docs gets, with ``overrides`` as on the command line."""
    (directory / "mooncake_store_trainer.yaml").write_text(docs_yaml())
    with initialize_config_dir(config_dir=str(directory), version_base=None):
        return compose(config_name="mooncake_store_trainer", overrides=list(overrides))
