"""LoRA adapters as generations (issue 53, the Store side): a PEFT adapter checked, published
under a policy name bound to its base generation, read back exactly, refused when it does
not fit, collected with its record."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mooncake_rl.generations import GenerationRegistry
from mooncake_rl.generations.commands import publish_checkpoint, verify_generation
from mooncake_rl.generations.gc import collect_garbage
from mooncake_rl.generations.keys import adapter_key, group_id
from mooncake_rl.generations.lora import (
    AdapterBase,
    AdapterRecord,
    AdapterRefused,
    check_adapter,
    load_adapter_record,
    publish_adapter,
    read_adapter,
)
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from mooncake_rl.tiny_model import make_tiny_llama, make_tiny_lora
from tests.conftest import READ_LEASE_S, settings_for
from tests.test_cli_generations import cli


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_llama(root / "base")
    return base, make_tiny_lora(base, root / "a1", seed=1), make_tiny_lora(base, root / "a2", 2)


def config_of(adapter_dir: Path) -> dict:
    return json.loads((adapter_dir / "adapter_config.json").read_text())


def test_an_adapter_that_does_not_fit_its_config_is_refused_naming_why(dirs) -> None:  # type: ignore[no-untyped-def]
    _, adapter_dir, _ = dirs
    config = config_of(adapter_dir)
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    check_adapter(config, tensors)  # the real one is accepted
    a_name = next(n for n in tensors if n.endswith("q_proj.lora_A.weight"))
    b_name = a_name.replace("lora_A", "lora_B")
    cases = [
        ({**config, "peft_type": "IA3"}, tensors, "only LORA adapters"),
        ({**config, "r": 0}, tensors, "rank r must be an integer >= 1"),
        ({**config, "r": 8}, tensors, "not of rank 8"),
        ({**config, "target_modules": ["v_proj"]}, tensors, "a module target_modules does not"),
        (config, {k: v for k, v in tensors.items() if k != b_name}, "has no lora_B weight"),
        (config, {**tensors, "model.norm.weight": torch.ones(4)}, "no lora_A or lora_B weight"),
        (config, {}, "holds no tensors"),
    ]
    for bad_config, bad_tensors, message in cases:
        with pytest.raises(AdapterRefused, match=message):
            check_adapter(bad_config, bad_tensors)


def test_the_adapter_record_round_trips_and_binds_one_base() -> None:
    record = AdapterRecord(AdapterBase("base", 3), 4, 8.0, ("q_proj", "v_proj"), {"r": 4})
    assert AdapterRecord.decode(record.encode()) == record
    assert record.refusal("base", 3) is None
    assert record.refusal("base", 4) == (
        "the adapter applies to generation 3 of 'base'; this engine serves generation 4 of 'base'"
    )
    with pytest.raises(AdapterRefused, match="needs a model and a generation"):
        AdapterBase("base", 0)


def test_an_adapter_is_a_generation_of_its_own_bound_to_its_base(settings: Settings, dirs) -> None:  # type: ignore[no-untyped-def]
    base_dir, first_dir, second_dir = dirs
    with StoreClient(settings) as store:
        base = publish_checkpoint(store, "lora-base", base_dir, "float32")
        adapters = []
        for adapter_dir in (first_dir, second_dir):
            adapter = read_adapter(adapter_dir)
            adapters.append(
                publish_adapter(
                    store, "lora-policy", adapter, AdapterBase("lora-base", base.generation)
                )
            )
            _, tensors = active_weights(store, "lora-policy")
            read = {n: t.contiguous() for n, t in tensors}
            assert read.keys() == adapter.tensors.keys()
            assert all(torch.equal(read[n], t) for n, t in adapter.tensors.items())
        assert [a.generation for a in adapters] == [1, 2]
        record = load_adapter_record(store, "lora-policy", 2)
        assert record is not None
        assert (record.base, record.rank, record.target_modules) == (
            AdapterBase("lora-base", base.generation),
            4,
            ("q_proj", "v_proj"),
        )
        assert record.config == config_of(second_dir)
        assert load_adapter_record(store, "lora-base", base.generation) is None  # weights
        assert verify_generation(store, "lora-policy")["ok"]

        # Refused before anything is claimed: a base never announced, a name of weights.
        with pytest.raises(AdapterRefused, match=r"generation 9 of 'lora-base'.*not announced"):
            publish_adapter(
                store, "lora-policy", read_adapter(first_dir), AdapterBase("lora-base", 9)
            )
        with pytest.raises(AdapterRefused, match="'lora-base' holds model weights"):
            publish_adapter(
                store, "lora-base", read_adapter(first_dir), AdapterBase("lora-base", 1)
            )
        assert GenerationRegistry(store, "lora-policy").claim(3) is None

        time.sleep(READ_LEASE_S)  # the announce's read leases
        assert collect_garbage(store, "lora-policy", keep=1, grace_s=0).deleted == (1,)
        assert store.exists([adapter_key(group_id("lora-policy", g)) for g in (1, 2)]) == [
            False,
            True,
        ]


def test_publish_lora_from_the_command_line(
    master: EmbeddedMaster, holders, dirs, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    base_dir, adapter_dir, _ = dirs
    segment = holders("lora-cli").segment
    base = cli(
        master, segment, "publish", str(base_dir), "--name", "cli-base", "--dtype", "float32"
    )
    assert base.returncode == 0, base.stderr
    lora = ["publish", "--lora", str(adapter_dir), "--name", "cli-policy", "--dtype", "float32"]
    published = cli(master, segment, *lora, "--base", "cli-base")
    assert (published.returncode, published.stdout.strip()) == (0, "1"), published.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps(config_of(adapter_dir)))
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    kept = {k: v for k, v in tensors.items() if "lora_B" not in k}
    save_file(kept, str(broken / "adapter_model.safetensors"))
    refused = cli(
        master,
        segment,
        "publish",
        "--lora",
        str(broken),
        "--name",
        "cli-policy",
        "--base",
        "cli-base",
    )
    assert refused.returncode == 2 and "has no lora_B weight" in refused.stderr
    unbound = cli(master, segment, *lora)
    assert unbound.returncode == 2 and "--lora needs --base MODEL" in unbound.stderr
    for flags, why in (
        (["--delta-every", "0"], "delta_every must be an integer >= 1"),
        (["--delta-every", "4", "--delta-max-fraction", "1.5"], "delta_max_fraction must be"),
    ):
        bad = cli(master, segment, "publish", str(base_dir), "--name", "cli-base", *flags)
        assert bad.returncode == 2 and why in bad.stderr and "nothing published" in bad.stderr
    with StoreClient(settings_for(master, "lora-cli", segment_bytes=0)) as store:
        assert GenerationRegistry(store, "cli-base").claim(2) is None  # nothing claimed
    both = cli(master, segment, "publish", str(base_dir), "--lora", str(adapter_dir), "--name", "x")
    assert both.returncode == 2 and "a checkpoint directory or --lora" in both.stderr
