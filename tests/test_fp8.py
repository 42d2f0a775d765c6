"""fp8 generations: the quantizer bit for bit against vLLM's, publish -> Store -> receive."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from engine_ext.placement import RegionSpec, assemble_regions, describe_shards
from engine_ext.vllm.placement import expert_shards
from mooncake_rl.apply.process import WorkerCluster, WorkerMemory, run_planned_update
from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations import fp8
from mooncake_rl.generations.catalog import TensorSpec, publish_format, specs_of
from mooncake_rl.generations.keys import payload_key
from mooncake_rl.generations.packing import pack_name
from mooncake_rl.generations.publisher import PublishFailed, publish_local
from mooncake_rl.generations.registry import GenerationRegistry, active_generation
from mooncake_rl.generations.weights import active_weights
from mooncake_rl.plan.synthetic import shard_bytes, simulated_engines
from mooncake_rl.plan.update import RoutingCache, plan_update
from mooncake_rl.services import EmbeddedMaster
from mooncake_rl.settings import Settings
from mooncake_rl.store import StoreClient
from tests.conftest import settings_for, trainer_settings


def reference_quantizer():
    """vLLM's ``per_block_cast_to_fp8`` (DeepGEMM's), eager: vLLM wraps it in torch.compile,
    which recompiles per shape (seconds each on this CPU); the compiled one gave the same
    bytes on the shapes docs/fp8.md lists."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return inspect.unwrap(per_block_cast_to_fp8)


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


@hypothesis_settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 260),
    cols=st.integers(1, 260),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    exponent=st.integers(-12, 6),
    zero_rows=st.integers(0, 260),
    seed=st.integers(0, 2**16),
)
def test_block_quantize_is_bit_exact_with_vllms_quantizer(
    rows: int, cols: int, dtype: torch.dtype, exponent: int, zero_rows: int, seed: int
) -> None:
    """Shapes off the 128 grid (partial edge blocks), magnitudes from 2^-12 to 2^6, and
    all-zero blocks (the 1e-4 floor on the block maximum)."""
    generator = torch.Generator().manual_seed(seed)
    tensor = (torch.randn(rows, cols, generator=generator) * 2.0**exponent).to(dtype)
    tensor[:zero_rows] = 0
    weight, scale = fp8.block_quantize("w", tensor)
    want_weight, want_scale = reference_quantizer()(tensor)
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == fp8.scale_shape(tensor.shape)
    assert as_bytes(weight) == as_bytes(want_weight)
    assert as_bytes(scale) == as_bytes(want_scale)
    # What the engine computes with is e4m3's rounding of the input, block by block.
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    error = (weight.float() * expanded - tensor.float()).abs()
    assert bool((error <= tensor.float().abs() * 2**-4 + expanded * 2**-10).all())


def test_non_finite_weights_are_refused_by_name() -> None:
    tensor = torch.ones(130, 4)
    tensor[129, 0] = float("nan")
    with pytest.raises(InvariantViolation, match=r"tensor layers\.0\.w holds inf or NaN"):
        fp8.block_quantize("layers.0.w", tensor)


# DeepSeek-V3 / Kimi-K2 checkpoint names: which carry weight_scale_inv in the fp8 release.
DEEPSEEK_V3 = {
    "model.embed_tokens.weight": False,
    "model.layers.0.input_layernorm.weight": False,
    "model.layers.0.self_attn.q_a_proj.weight": True,
    "model.layers.0.self_attn.q_a_layernorm.weight": False,
    "model.layers.0.self_attn.q_b_proj.weight": True,
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": True,
    "model.layers.0.self_attn.kv_a_layernorm.weight": False,
    "model.layers.0.self_attn.kv_b_proj.weight": True,
    "model.layers.0.self_attn.o_proj.weight": True,
    "model.layers.0.post_attention_layernorm.weight": False,
    "model.layers.0.mlp.gate_proj.weight": True,
    "model.layers.0.mlp.down_proj.weight": True,
    "model.layers.3.mlp.gate.weight": False,
    "model.layers.3.mlp.gate.e_score_correction_bias": False,
    "model.layers.3.mlp.experts.17.up_proj.weight": True,
    "model.layers.3.mlp.shared_experts.down_proj.weight": True,
    "model.norm.weight": False,
    "lm_head.weight": False,
}


def test_the_quantized_set_is_deepseek_v3s() -> None:
    for name, quantized in DEEPSEEK_V3.items():
        shape = (8,) if name.endswith(("norm.weight", "_bias")) else (8, 8)
        assert fp8.quantizes(name, shape) is quantized, name
    assert not fp8.quantizes("model.layers.0.self_attn.o_proj.bias", (8, 8))
    assert not fp8.quantizes("model.layers.0.mlp.experts.w13_weight", (4, 8, 8))


def test_formats_are_validated_with_the_fix_in_the_message() -> None:
    assert publish_format("fp8_e4m3") == "fp8_e4m3"
    with pytest.raises(InvariantViolation, match=r"no scales.*dtype 'fp8_e4m3'"):
        publish_format("float8_e4m3fn")
    with pytest.raises(InvariantViolation, match=r"unknown rollout dtype 'int8'.*fp8_e4m3"):
        publish_format("int8")
    specs = TensorSpec.stored("m.layers.0.mlp.up_proj.weight", torch.empty(300, 129), "fp8_e4m3")
    assert [(s.name, s.shape, s.dtype, s.nbytes) for s in specs] == [
        ("m.layers.0.mlp.up_proj.weight", (300, 129), "float8_e4m3fn", 300 * 129),
        ("m.layers.0.mlp.up_proj.weight_scale_inv", (3, 2), "float32", 24),
    ]


def tiny_deepseek(seed: int) -> list[tuple[str, torch.Tensor]]:
    """DeepSeek-V3 names at shapes off the 128 grid, as a trainer yields them (float32)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": (160, 200),
        "model.layers.0.input_layernorm.weight": (200,),
        "model.layers.0.self_attn.q_a_proj.weight": (136, 200),
        "model.layers.0.self_attn.kv_a_layernorm.weight": (64,),
        "model.layers.0.mlp.gate.weight": (8, 200),
        "model.layers.0.mlp.gate.e_score_correction_bias": (8,),
        "model.layers.0.mlp.experts.0.down_proj.weight": (200, 96),
        "lm_head.weight": (160, 200),
    }
    return [(n, torch.randn(s, generator=generator)) for n, s in shapes.items()]


def stored_form(model: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What an fp8 generation of ``model`` must hold, from the quantizer and plain casts."""
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in model:
        if fp8.quantizes(name, tensor.shape):
            stored[name], stored[fp8.scale_name(name)] = fp8.block_quantize(name, tensor)
        else:
            stored[name] = tensor.to(torch.bfloat16)
    return stored


def test_fp8_generation_round_trips_through_the_store_byte_exact(settings: Settings) -> None:
    """Manifest and checksums carry the fp8 weights and their scales; the Store loader
    (``--load-format mooncake``) yields them bit for bit, checked against the checksums.
    A trainer tensor named like a scale, or weights fp8 cannot hold, publish nothing."""
    model = tiny_deepseek(3)
    want = stored_form(model)
    with StoreClient(settings) as store:
        record = publish_local(store, "fp8-roundtrip", model, dtype="fp8_e4m3")
        registry = GenerationRegistry(store, "fp8-roundtrip")
        manifest = registry.load_manifest(record.generation, record.manifest_digest)
        checksums = registry.load_checksums(record.generation, record.checksums_digest).objects
        assert {s.name: s.dtype for s in specs_of(manifest)} == {
            name: str(tensor.dtype).removeprefix("torch.") for name, tensor in want.items()
        }
        assert {t.tensor_id: t.itemsize for t in manifest.tensors} == {
            name: tensor.element_size() for name, tensor in want.items()
        }
        # Each tensor (weights, scales, unquantized) has its own checksum, and so has each pack
        # of one dtype they were stored in.
        packs = {f.object_key for f in manifest.fragments}
        assert {k for k in packs if "~pack/" in k} == {
            payload_key(manifest.group_id, pack_name(0, dtype, i))
            for i, dtype in enumerate(("bfloat16", "float8_e4m3fn", "float32"))
        }
        assert set(checksums) == {payload_key(manifest.group_id, n) for n in want} | packs
        _, tensors = active_weights(store, "fp8-roundtrip")
        loaded = dict(tensors)
        name = "model.layers.0.mlp.up_proj.weight"
        clash = [(name, torch.ones(4, 4)), (fp8.scale_name(name), torch.ones(1, 1))]
        with pytest.raises(PublishFailed, match=r"duplicate tensor name '.*weight_scale_inv'"):
            publish_local(store, "fp8-refused", clash, dtype="fp8_e4m3")
        inf = [("model.layers.0.o_proj.weight", torch.full((2, 2), float("inf")))]
        with pytest.raises(PublishFailed, match=r"tensor 'model\.layers\.0\.o_proj\.weight'.*inf"):
            publish_local(store, "fp8-refused", inf, dtype="fp8_e4m3")
        assert active_generation(store, "fp8-refused") is None
    assert loaded.keys() == want.keys()
    for name, tensor in want.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert as_bytes(loaded[name]) == as_bytes(tensor), name


def test_direct_mode_lands_fp8_weights_and_scales_byte_exact(
    master: EmbeddedMaster, holders
) -> None:
    """Publish fp8, plan direct mode for a TP-2 engine, run it on real Store reads and TE
    pushes: each rank's parameters hold exactly its boxes of the fp8 weights, their float32
    scales and the bf16 tensors, each byte read from the Store once."""
    model = tiny_deepseek(5)
    with StoreClient(trainer_settings(master, holders("fp8-store"), "trainer")) as store:
        publish_local(store, "fp8-direct", model, dtype="fp8_e4m3")
        registry = GenerationRegistry(store, "fp8-direct")
        manifest = registry.load_manifest(registry.active().generation)
    engines = simulated_engines(specs_of(manifest), [("node-a", 2)], "direct")
    plan = plan_update(manifest, engines, "direct", 4096, RoutingCache())
    settings = {
        w["worker_id"]: settings_for(
            master, w["node"], segment_bytes=0, batch_bytes=4096, staging_watermark_bytes=16384
        )
        for workers in engines.values()
        for w in workers
    }
    memory = WorkerMemory(parameters=True, in_place=True)
    with WorkerCluster(settings, plan.routing.regions, memory) as cluster:
        run = run_planned_update(cluster, plan)
        digests = {w: cluster.call(w, "digest") for w in cluster.processes}
    want = stored_form(model)
    for worker, regions in shard_bytes(engines, want).items():
        assert digests[worker] == {r: xxhash.xxh3_64_hexdigest(b) for r, b in regions.items()}
    reads = sum(w["read"] for w in run["workers"].values())
    assert reads == plan.store_read_bytes == sum(t.nbytes for t in want.values())


def layer_with(block_on_layer: bool, **attributes: object) -> torch.nn.Module:
    """A layer carrying the attributes the shard describer reads (as in
    tests/engine/test_describe_shards.py): vLLM sets ``weight_block_size`` on the layer,
    SGLang on its quant method's config."""
    module = torch.nn.Module()
    for name, value in attributes.items():
        setattr(module, name, value)
    if block_on_layer:
        module.weight_block_size = [128, 128]
    else:
        module.quant_method = SimpleNamespace(
            quant_config=SimpleNamespace(weight_block_size=[128, 128])
        )
    return module


def meta(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=dtype)
    tensor.output_dim, tensor.input_dim = 0, 1
    return tensor


@pytest.mark.parametrize("block_on_layer", [True, False], ids=["vllm", "sglang"])
def test_block_scales_are_described_in_blocks(block_on_layer: bool) -> None:
    """Rank 1 of 2: a merged qkv (separate q/k/v checkpoint tensors) and a row-parallel
    o_proj. Their ``weight_scale_inv`` boxes are the weights' boxes counted in blocks, so
    regions assembled from separately quantized checkpoint tensors hold each part's block
    rows back to back, and this rank's block columns of o_proj."""
    qkv = layer_with(
        block_on_layer, output_sizes=[512, 256, 256], output_partition_sizes=[256, 128, 128]
    )
    o_proj = layer_with(
        block_on_layer,
        input_size=512,
        input_size_per_partition=256,
        output_size=300,
        output_size_per_partition=300,
    )
    rows = [
        ("a.qkv_proj.weight", qkv, "weight", meta((512, 300), torch.float8_e4m3fn)),
        ("a.qkv_proj.weight_scale_inv", qkv, "weight_scale_inv", meta((4, 3), torch.float32)),
        ("a.o_proj.weight", o_proj, "weight", meta((300, 256), torch.float8_e4m3fn)),
        ("a.o_proj.weight_scale_inv", o_proj, "weight_scale_inv", meta((3, 2), torch.float32)),
    ]
    regions, shards = describe_shards(
        rows, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, lambda _layer, _sub: 1
    )
    generator = torch.Generator().manual_seed(0)
    checkpoint: dict[str, torch.Tensor] = {}
    for name, shape in [("q_proj", (512, 300)), ("k_proj", (256, 300)), ("v_proj", (256, 300))]:
        w, s = fp8.block_quantize(name, torch.randn(shape, generator=generator))
        checkpoint[f"a.{name}.weight"], checkpoint[f"a.{name}.weight_scale_inv"] = w, s
    w, s = fp8.block_quantize("o", torch.randn(300, 512, generator=generator))
    checkpoint["a.o_proj.weight"], checkpoint["a.o_proj.weight_scale_inv"] = w, s
    filled, uncovered = assemble_regions(regions, shards, checkpoint)
    assert uncovered == []

    def part(kind: str, name: str, start: int, stop: int) -> torch.Tensor:
        return checkpoint[f"a.{name}.{kind}"][start:stop]

    want = {
        "a.qkv_proj.weight": [part("weight", "q_proj", 256, 512)]
        + [part("weight", n, 128, 256) for n in ("k_proj", "v_proj")],
        "a.qkv_proj.weight_scale_inv": [part("weight_scale_inv", "q_proj", 2, 4)]
        + [part("weight_scale_inv", n, 1, 2) for n in ("k_proj", "v_proj")],
        "a.o_proj.weight": [checkpoint["a.o_proj.weight"][:, 256:]],
        "a.o_proj.weight_scale_inv": [checkpoint["a.o_proj.weight_scale_inv"][:, 2:]],
    }
    for name, pieces in want.items():
        assert as_bytes(filled[name]) == as_bytes(torch.cat(pieces)), name


@pytest.mark.parametrize("block_on_layer", [True, False], ids=["vllm", "sglang"])
def test_a_fused_scale_whose_parts_start_inside_a_block_is_left_to_the_loader(
    block_on_layer: bool,
) -> None:
    """q, k and v of 64 rows each, against 128-row blocks: the engines round each part's scale
    offset up, so v's scale row lands on k's. No box can say that: the scale is left
    undescribed (direct mode lands it through the engine's loader); the weight, whose rows
    are exact, is still described part by part."""
    qkv = layer_with(block_on_layer, output_sizes=[64, 64, 64], output_partition_sizes=[64, 64, 64])
    rows = [
        ("a.qkv_proj.weight", qkv, "weight", meta((192, 64), torch.float8_e4m3fn)),
        ("a.qkv_proj.weight_scale_inv", qkv, "weight_scale_inv", meta((2, 1), torch.float32)),
    ]
    regions, shards = describe_shards(
        rows, {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}, lambda _layer, _sub: 0
    )
    assert [r.name for r in regions] == ["a.qkv_proj.weight", "a.qkv_proj.weight_scale_inv"]
    described = [(s.tensor, s.region) for s in shards]
    assert described == [
        (f"a.{n}.weight", "a.qkv_proj.weight") for n in ("q_proj", "k_proj", "v_proj")
    ]


EXPERT_SHAPES = {"gate_proj": (512, 300), "up_proj": (512, 300), "down_proj": (300, 512)}


def test_fused_expert_scales_are_described_like_their_weights() -> None:
    """vLLM's fused experts at rank 1 of 2 (intermediate 512, hidden 300), with vLLM's own
    expert mapping: ``w13_weight_scale_inv`` holds each expert's gate then up block rows of
    this rank, ``w2_weight_scale_inv`` its block columns of down_proj, like the weights."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    experts = torch.nn.Module()
    experts.get_expert_mapping = lambda: RoutedExperts.build_expert_params_mapping(
        "gate_proj", "down_proj", "up_proj", 2
    )
    experts.moe_config = SimpleNamespace(
        is_act_and_mul=True, tp_rank=1, moe_parallel_config=SimpleNamespace(tp_size=2)
    )
    experts._map_global_expert_id_to_local_expert_id = lambda expert: expert
    prefix = "m.layers.1.mlp.experts.routed_experts."
    metas = {
        "w13_weight": torch.empty(2, 512, 300, dtype=torch.float8_e4m3fn),
        "w13_weight_scale_inv": torch.empty(2, 4, 3),
        "w2_weight": torch.empty(2, 300, 256, dtype=torch.float8_e4m3fn),
        "w2_weight_scale_inv": torch.empty(2, 3, 2),
    }
    regions, shards = [], []
    for name, tensor in metas.items():
        regions.append(RegionSpec(prefix + name, tuple(tensor.shape), tensor.dtype))
        shards += expert_shards(prefix + name, experts, name, tensor) or []
    generator = torch.Generator().manual_seed(1)
    checkpoint: dict[str, torch.Tensor] = {}
    for expert in range(2):
        for proj, shape in EXPERT_SHAPES.items():
            name = f"m.layers.1.mlp.experts.{expert}.{proj}.weight"
            w, s = fp8.block_quantize(name, torch.randn(shape, generator=generator))
            checkpoint[name], checkpoint[fp8.scale_name(name)] = w, s
    filled, uncovered = assemble_regions(regions, shards, checkpoint)
    assert uncovered == []

    def of(expert: int, proj: str, suffix: str) -> torch.Tensor:
        return checkpoint[f"m.layers.1.mlp.experts.{expert}.{proj}.weight{suffix}"]

    for expert in range(2):
        for suffix, rows in (("", slice(256, 512)), ("_scale_inv", slice(2, 4))):
            w13 = torch.cat([of(expert, p, suffix)[rows] for p in ("gate_proj", "up_proj")])
            w2 = of(expert, "down_proj", suffix)[:, rows]
            assert as_bytes(filled[f"{prefix}w13_weight{suffix}"][expert]) == as_bytes(w13)
            assert as_bytes(filled[f"{prefix}w2_weight{suffix}"][expert]) == as_bytes(w2)
