"""The shared shard describer on layers carrying vLLM's parallel-layer attributes.

Each layer here is a plain ``torch.nn.Module`` given the attributes vLLM's parallel layers
set (``output_sizes``, ``output_partition_sizes``, ``input_size_per_partition``...): the
describer reads nothing else, so these are its real inputs, and the boxes it returns are
checked by filling the region from a checkpoint tensor and comparing with numpy slicing.
"""

from __future__ import annotations

import torch

from engine_ext.placement import RegionSpec, assemble_regions, describe_shards
from engine_ext.shards import ShardSpec
from engine_ext.worker import UpdateWorker
from mooncake_rl.protocol import PLACEMENT_DIGEST, placement_digest


def layer(**attributes: object) -> torch.nn.Module:
    module = torch.nn.Module()
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def rank_is(rank: int):
    return lambda _layer, _sub: rank


def test_fused_parts_from_separate_checkpoint_tensors_land_back_to_back() -> None:
    qkv = layer(output_sizes=[8, 4, 4], output_partition_sizes=[4, 2, 2])
    meta = torch.empty(8, 3)
    regions, shards = describe_shards(
        [("m.qkv_proj.weight", qkv, "weight", meta)],
        {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
        rank_is(1),
    )
    assert [(s.tensor, s.global_offset, s.local_shape, s.region_offset) for s in shards] == [
        ("m.q_proj.weight", (4, 0), (4, 3), 0),
        ("m.k_proj.weight", (2, 0), (2, 3), 48),
        ("m.v_proj.weight", (2, 0), (2, 3), 72),
    ]
    checkpoint = {
        "m.q_proj.weight": torch.arange(24.0).view(8, 3),
        "m.k_proj.weight": 100 + torch.arange(12.0).view(4, 3),
        "m.v_proj.weight": 200 + torch.arange(12.0).view(4, 3),
    }
    filled, uncovered = assemble_regions(regions, shards, checkpoint)
    assert uncovered == []
    want = torch.cat(
        [
            checkpoint["m.q_proj.weight"][4:],
            checkpoint["m.k_proj.weight"][2:],
            checkpoint["m.v_proj.weight"][2:],
        ]
    )
    assert torch.equal(filled["m.qkv_proj.weight"], want)


def test_a_checkpoint_that_stores_the_fused_tensor_is_cut_per_part() -> None:
    """Phi-3 stores ``qkv_proj`` fused; vLLM maps it to itself ("qkv_proj": ["qkv_proj"])."""
    qkv = layer(output_sizes=[8, 4, 4], output_partition_sizes=[4, 2, 2])
    regions, shards = describe_shards(
        [("m.qkv_proj.weight", qkv, "weight", torch.empty(8, 3))],
        {"qkv_proj": ["qkv_proj"]},
        rank_is(1),
    )
    assert [(s.tensor, s.global_shape, s.global_offset) for s in shards] == [
        ("m.qkv_proj.weight", (16, 3), (4, 0)),
        ("m.qkv_proj.weight", (16, 3), (10, 0)),
        ("m.qkv_proj.weight", (16, 3), (14, 0)),
    ]
    fused = torch.arange(48.0).view(16, 3)
    filled, _ = assemble_regions(regions, shards, {"m.qkv_proj.weight": fused})
    assert torch.equal(
        filled["m.qkv_proj.weight"], torch.cat([fused[4:8], fused[10:12], fused[14:16]])
    )


def test_a_packing_it_cannot_read_is_left_undescribed() -> None:
    gate_up = layer(output_sizes=[4, 4, 4], output_partition_sizes=[4, 4, 4])
    regions, shards = describe_shards(
        [("m.gate_up_proj.weight", gate_up, "weight", torch.empty(12, 2))],
        {"gate_up_proj": ["gate_proj", "up_proj"]},
        rank_is(0),
    )
    assert [r.name for r in regions] == ["m.gate_up_proj.weight"] and shards == []
    _, uncovered = assemble_regions(regions, shards, {})
    assert uncovered == ["m.gate_up_proj.weight"]


def test_row_parallel_weights_split_their_input_dim_and_vocab_rows_follow_shard_indices() -> None:
    down = layer(input_size=8, input_size_per_partition=4)
    weight = torch.empty(3, 4)
    weight.input_dim = 1
    indices = layer(org_vocab_start_index=5, org_vocab_end_index=10)
    vocab = layer(shard_indices=indices, org_vocab_size=10)
    _, shards = describe_shards(
        [
            ("m.down_proj.weight", down, "weight", weight),
            ("m.embed.weight", vocab, "weight", torch.empty(5, 3)),
        ],
        {},
        rank_is(1),
    )
    assert [(s.global_shape, s.global_offset, s.local_shape) for s in shards] == [
        ((3, 8), (0, 4), (3, 4)),
        ((10, 3), (5, 0), (5, 3)),
    ]


def test_replicated_key_value_heads_are_boxes_of_the_checkpoint_tensors() -> None:
    """TP 2 over one key/value head: vLLM's ``output_sizes`` count it twice; both ranks hold
    the whole k and v (rank // replicas), and query rows split."""
    qkv = layer(output_sizes=[8, 4, 4], output_partition_sizes=[4, 2, 2], num_kv_head_replicas=2)

    def rank_of(_layer: torch.nn.Module, sub: int) -> int:
        return 1 if sub == 0 else 1 // 2

    _, shards = describe_shards(
        [("m.qkv_proj.weight", qkv, "weight", torch.empty(8, 3))],
        {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
        rank_of,
    )
    assert [(s.tensor, s.global_shape, s.global_offset, s.local_shape) for s in shards] == [
        ("m.q_proj.weight", (8, 3), (4, 0), (4, 3)),
        ("m.k_proj.weight", (2, 3), (0, 0), (2, 3)),
        ("m.v_proj.weight", (2, 3), (0, 0), (2, 3)),
    ]


class DescribedWorker(UpdateWorker):
    """The engine glue a description reads (the model, its ranks, the shared describer)
    over a real module; nothing lands here, so the landing glue is absent."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self.descriptions = 0

    def model(self) -> torch.nn.Module:
        return self._model

    def tp(self) -> tuple[int, int]:
        return 1, 2

    def describe_regions(self) -> tuple[list[RegionSpec], list[ShardSpec]]:
        self.descriptions += 1
        rows = [
            (f"m.{name}.weight", module, "weight", module.weight)
            for name, module in self._model.named_children()
        ]
        return describe_shards(rows, {}, rank_is(1))

    def land_compat(self, tensors):  # pragma: no cover - nothing lands in these tests
        raise AssertionError("not landed here")

    def land_direct(self, staged, fallback, in_place):  # pragma: no cover
        raise AssertionError("not landed here")


def test_a_worker_describes_itself_once_while_its_parameters_stay_the_same() -> None:
    """Placement, prepare and the landing check all ask for the description; it is made
    again only when a parameter becomes another tensor or changes shape or dtype."""
    model = torch.nn.Module()
    model.down_proj = layer(input_size_per_partition=3, tp_size=2)
    model.down_proj.weight = torch.nn.Parameter(torch.zeros(4, 3))
    worker = DescribedWorker(model)
    first = worker.regions()
    assert worker.regions() is first and worker.descriptions == 1
    served = worker._described().served(*worker.tp())
    assert served[PLACEMENT_DIGEST] == placement_digest(served)
    assert served["shards"] == [s.to_json() for s in first[1]] and len(served["shards"]) == 1
    assert worker._described().served(*worker.tp()) is served  # hashed once too
    with torch.no_grad():
        model.down_proj.weight.add_(1.0)  # new bytes in the same tensor: the same boxes
    assert worker.regions() is first and worker.descriptions == 1
    model.down_proj.weight = torch.nn.Parameter(torch.zeros(4, 3))  # reloaded: described anew
    assert worker.regions() == first and worker.descriptions == 2
    model.down_proj.weight = torch.nn.Parameter(torch.zeros(4, 5))
    (region,) = worker.regions()[0]
    assert worker.descriptions == 3 and tuple(region.shape) == (4, 5)
