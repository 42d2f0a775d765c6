"""Model and cluster shapes for benchmarks and tests, generated from public configs.

Tensor names follow the Hugging Face checkpoints. Each tensor says how a TP engine shards
it: ``column`` (output dim 0 split), ``row`` (input dim 1 split), ``replicated`` (every
rank holds it: norms, MLA down-projections, the router) or ``expert`` (one routed expert,
owned whole by one rank: EP over the instance's TP ranks, experts in contiguous blocks).

Rollout weights are bf16, or fp8 (:func:`quantized`: e4m3 with a float32
``weight_scale_inv`` per 128x128 block, the DeepSeek-V3 / Kimi-K2 checkpoint convention,
chosen by the publisher's own rule, :func:`mooncake_rl.generations.fp8.quantizes`).
Two instance layouts (:class:`Target`): ``tp`` shards as above; ``ep`` is wide expert
parallelism, the layout vLLM runs with ``--data-parallel-size N --enable-expert-parallel``
(TP 1 per rank): every routed expert lives on exactly one of the instance's N GPUs, and
every other tensor (attention, dense MLPs, shared experts, embeddings, norms) is whole on
each GPU (data-parallel attention), so instances may span several nodes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mooncake.reshard.weight import (
    OwnershipAxis,
    ParallelRank,
    PlacementFragment,
    ReplicatedAxis,
    SplitAxis,
    TensorDescriptor,
    WeightManifest,
    WeightPlacementPart,
)

from mooncake_rl.errors import InvariantViolation
from mooncake_rl.generations import catalog, fp8
from mooncake_rl.generations.packing import Placement
from mooncake_rl.plan.demand import DirectDemand
from mooncake_rl.plan.topology import Topology, Worker

ITEMSIZE = {name: dtype.itemsize for name, dtype in catalog.ROLLOUT_DTYPES.items()}
KINDS = ("column", "row", "replicated", "expert")
LAYOUTS = ("tp", "ep")
DTYPES = ("bfloat16", "fp8")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str
    dtype: str = "bfloat16"
    layer_id: int | None = None
    expert_id: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvariantViolation(f"{self.name}: unknown shard kind {self.kind}")
        if self.dtype not in ITEMSIZE:
            raise InvariantViolation(f"{self.name}: unknown dtype {self.dtype}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class ModelShape:
    name: str
    tensors: tuple[TensorSpec, ...]
    num_experts: int = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def parameters(self) -> int:
        """Weight elements (fp8 scales excluded)."""
        return sum(
            math.prod(t.shape) for t in self.tensors if not t.name.endswith(fp8.SCALE_SUFFIX)
        )


def quantized(model: ModelShape) -> ModelShape:
    """The fp8 checkpoint of ``model``: each quantizable weight in e4m3, followed by its
    ``<name>_scale_inv`` (float32, one per 128 x 128 block, sharded like the weight)."""
    tensors: list[TensorSpec] = []
    for spec in model.tensors:
        if not fp8.quantizes(spec.name, spec.shape):
            tensors.append(spec)
            continue
        tensors += [
            dataclasses.replace(spec, dtype=fp8.FP8_DTYPE),
            dataclasses.replace(
                spec,
                name=fp8.scale_name(spec.name),
                shape=fp8.scale_shape(spec.shape),
                dtype=fp8.SCALE_DTYPE,
            ),
        ]
    return dataclasses.replace(model, name=f"{model.name}-fp8", tensors=tuple(tensors))


def model_shape(name: str, dtype: str = "bfloat16") -> ModelShape:
    """``MODELS[name]`` with rollout weights in ``dtype`` (``bfloat16`` or ``fp8``)."""
    if name not in MODELS:
        raise InvariantViolation(f"unknown model {name!r}; one of {sorted(MODELS)}")
    if dtype not in DTYPES:
        raise InvariantViolation(f"unknown rollout dtype {dtype!r}; one of {DTYPES}")
    model = MODELS[name]()
    return quantized(model) if dtype == "fp8" else model


# meta-llama/Meta-Llama-3-70B config.json: num_hidden_layers 80, hidden_size 8192,
# intermediate_size 28672, num_attention_heads 64, num_key_value_heads 8 (head_dim 128),
# vocab_size 128256, torch_dtype bfloat16, tie_word_embeddings false.
LLAMA3_70B = dict(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, head_dim=128,
                  vocab=128256)  # fmt: skip

# moonshotai/Kimi-K2-Instruct config.json (DeepseekV3ForCausalLM): num_hidden_layers 61,
# first_k_dense_replace 1, hidden_size 7168, intermediate_size 18432, moe_intermediate_size
# 2048, n_routed_experts 384, n_shared_experts 1, q_lora_rank 1536, kv_lora_rank 512,
# qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, num_attention_heads 64,
# vocab_size 163840. The router's e_score_correction_bias is kept in float32.
KIMI_K2 = dict(layers=61, first_dense=1, hidden=7168, intermediate=18432, moe_intermediate=2048,
               experts=384, shared=1, q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64,
               v_head=128, heads=64, vocab=163840)  # fmt: skip

# deepseek-ai/DeepSeek-V3 config.json: num_hidden_layers 61, first_k_dense_replace 3,
# hidden_size 7168, intermediate_size 18432, moe_intermediate_size 2048, n_routed_experts 256,
# n_shared_experts 1, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
# qk_rope_head_dim 64, v_head_dim 128, num_attention_heads 128, vocab_size 129280 (671B
# parameters). The multi-token-prediction module (num_nextn_predict_layers 1, stored as
# model.layers.61) is left out: engines load it only for speculative decoding.
DEEPSEEK_V3 = dict(layers=61, first_dense=3, hidden=7168, intermediate=18432,
                   moe_intermediate=2048, experts=256, shared=1, q_lora=1536, kv_lora=512,
                   qk_nope=128, qk_rope=64, v_head=128, heads=128, vocab=129280)  # fmt: skip


# A small DeepSeek-V3-shaped MoE (same tensor kinds, 69M parameters) for quick runs.
SMALL_MOE = dict(layers=4, first_dense=1, hidden=1024, intermediate=2816, moe_intermediate=256,
                 experts=16, shared=1, q_lora=256, kv_lora=128, qk_nope=32, qk_rope=16, v_head=32,
                 heads=8, vocab=8192)  # fmt: skip


def llama(
    name: str, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
    head_dim: int, vocab: int,
) -> ModelShape:  # fmt: skip
    """A dense Llama: fused-friendly q/k/v and gate/up column shards, o/down row shards."""
    t = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), "column")]
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"model.layers.{i}."
        t += _gqa_attention(p, i, hidden, q, kv)
        t += [
            TensorSpec(p + name, shape, kind, layer_id=i)
            for name, shape, kind in (
                ("mlp.gate_proj.weight", (intermediate, hidden), "column"),
                ("mlp.up_proj.weight", (intermediate, hidden), "column"),
                ("mlp.down_proj.weight", (hidden, intermediate), "row"),
            )
        ]
    t += [
        TensorSpec("model.norm.weight", (hidden,), "replicated"),
        TensorSpec("lm_head.weight", (vocab, hidden), "column"),
    ]
    return ModelShape(name, tuple(t))


def _gqa_attention(
    p: str, layer: int, hidden: int, q: int, kv: int, qk_norm: int = 0
) -> list[TensorSpec]:
    """A decoder layer's norms and GQA projections (q/k RMSNorms per head when ``qk_norm``
    gives their width, as Qwen3's)."""
    rows = [
        ("input_layernorm.weight", (hidden,), "replicated"),
        ("self_attn.q_proj.weight", (q, hidden), "column"),
        ("self_attn.k_proj.weight", (kv, hidden), "column"),
        ("self_attn.v_proj.weight", (kv, hidden), "column"),
        ("self_attn.o_proj.weight", (hidden, q), "row"),
    ]
    if qk_norm:
        rows += [
            ("self_attn.q_norm.weight", (qk_norm,), "replicated"),
            ("self_attn.k_norm.weight", (qk_norm,), "replicated"),
        ]
    rows.append(("post_attention_layernorm.weight", (hidden,), "replicated"))
    return [TensorSpec(p + name, shape, kind, layer_id=layer) for name, shape, kind in rows]


def deepseek_v3(
    name: str, layers: int, first_dense: int, hidden: int, intermediate: int,
    moe_intermediate: int, experts: int, shared: int, q_lora: int, kv_lora: int, qk_nope: int,
    qk_rope: int, v_head: int, heads: int, vocab: int,
) -> ModelShape:  # fmt: skip
    """DeepSeek-V3 architecture (MLA + MoE), every routed expert its own tensor."""
    t = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), "column")]
    for i in range(layers):
        p = f"model.layers.{i}."
        t += [
            TensorSpec(p + name, shape, kind, layer_id=i)
            for name, shape, kind in (
                ("input_layernorm.weight", (hidden,), "replicated"),
                ("self_attn.q_a_proj.weight", (q_lora, hidden), "replicated"),
                ("self_attn.q_a_layernorm.weight", (q_lora,), "replicated"),
                ("self_attn.q_b_proj.weight", (heads * (qk_nope + qk_rope), q_lora), "column"),
                ("self_attn.kv_a_proj_with_mqa.weight", (kv_lora + qk_rope, hidden), "replicated"),
                ("self_attn.kv_a_layernorm.weight", (kv_lora,), "replicated"),
                ("self_attn.kv_b_proj.weight", (heads * (qk_nope + v_head), kv_lora), "column"),
                ("self_attn.o_proj.weight", (hidden, heads * v_head), "row"),
                ("post_attention_layernorm.weight", (hidden,), "replicated"),
            )
        ]
        if i < first_dense:
            t += _mlp(p + "mlp.", hidden, intermediate, i)
            continue
        t += [
            TensorSpec(p + "mlp.gate.weight", (experts, hidden), "replicated", layer_id=i),
            TensorSpec(p + "mlp.gate.e_score_correction_bias", (experts,), "replicated",
                       "float32", layer_id=i),
        ]  # fmt: skip
        t += _mlp(p + "mlp.shared_experts.", hidden, moe_intermediate * shared, i)
        expert_shapes = (
            ("gate_proj", (moe_intermediate, hidden)),
            ("up_proj", (moe_intermediate, hidden)),
            ("down_proj", (hidden, moe_intermediate)),
        )
        t += [
            TensorSpec(
                f"{p}mlp.experts.{e}.{name}.weight", shape, "expert", layer_id=i, expert_id=e
            )
            for e in range(experts)
            for name, shape in expert_shapes
        ]
    t += [
        TensorSpec("model.norm.weight", (hidden,), "replicated"),
        TensorSpec("lm_head.weight", (vocab, hidden), "column"),
    ]
    return ModelShape(name, tuple(t), num_experts=experts)


def _mlp(p: str, hidden: int, intermediate: int, layer: int) -> list[TensorSpec]:
    return [
        TensorSpec(p + "gate_proj.weight", (intermediate, hidden), "column", layer_id=layer),
        TensorSpec(p + "up_proj.weight", (intermediate, hidden), "column", layer_id=layer),
        TensorSpec(p + "down_proj.weight", (hidden, intermediate), "row", layer_id=layer),
    ]


# Qwen/Qwen3-30B-A3B config.json: num_hidden_layers 48, hidden_size 2048, num_experts 128
# (moe_intermediate_size 768, num_experts_per_tok 8 active), no shared experts, every layer
# MoE (decoder_sparse_step 1, mlp_only_layers []), num_attention_heads 32, num_key_value_heads
# 4, head_dim 128 (q/k RMSNorm per head), vocab_size 151936, tie_word_embeddings false, bf16.
QWEN3_30B_A3B = dict(layers=48, hidden=2048, moe_intermediate=768, experts=128, heads=32,
                     kv_heads=4, head_dim=128, vocab=151936)  # fmt: skip


def qwen3_moe(
    name: str, layers: int, hidden: int, moe_intermediate: int, experts: int, heads: int,
    kv_heads: int, head_dim: int, vocab: int,
) -> ModelShape:  # fmt: skip
    """Qwen3-MoE (GQA attention with per-head q/k norms, routed experts only), every routed
    expert its own tensor."""
    t = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), "column")]
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        p = f"model.layers.{i}."
        t += _gqa_attention(p, i, hidden, q, kv, qk_norm=head_dim)
        t.append(TensorSpec(p + "mlp.gate.weight", (experts, hidden), "replicated", layer_id=i))
        t += [
            TensorSpec(
                f"{p}mlp.experts.{e}.{name}.weight", shape, "expert", layer_id=i, expert_id=e
            )
            for e in range(experts)
            for name, shape in (
                ("gate_proj", (moe_intermediate, hidden)),
                ("up_proj", (moe_intermediate, hidden)),
                ("down_proj", (hidden, moe_intermediate)),
            )
        ]
    t += [
        TensorSpec("model.norm.weight", (hidden,), "replicated"),
        TensorSpec("lm_head.weight", (vocab, hidden), "column"),
    ]
    return ModelShape(name, tuple(t), num_experts=experts)


MODELS = {
    "llama-70b": lambda: llama("llama-70b", **LLAMA3_70B),
    "deepseek-v3": lambda: deepseek_v3("deepseek-v3", **DEEPSEEK_V3),
    "kimi-k2": lambda: deepseek_v3("kimi-k2", **KIMI_K2),
    "small": lambda: deepseek_v3("small", **SMALL_MOE),
    "qwen3-30b-a3b": lambda: qwen3_moe("qwen3-30b-a3b", **QWEN3_30B_A3B),
}


def weight_manifest(
    model: ModelShape,
    generation: int,
    placements: Mapping[str, Sequence[Placement]] | None = None,
) -> WeightManifest:
    """The manifest the publisher announces (``catalog.build_manifest``: each tensor's
    contiguous bytes in its own Store object, or where ``placements`` put it in a pack),
    its descriptors carrying the layer and expert ids the placements declare."""
    specs = [catalog.TensorSpec(spec.name, spec.shape, spec.dtype) for spec in model.tensors]
    manifest = catalog.build_manifest(
        model.name, generation, specs, "1970-01-01T00:00:00Z", placements
    )
    return dataclasses.replace(
        manifest, tensors=tuple(_descriptor(spec, (), ()) for spec in model.tensors)
    )


def _descriptor(spec: TensorSpec, shard_dims, axes) -> TensorDescriptor:
    return TensorDescriptor(
        tensor_id=spec.name,
        global_shape=spec.shape,
        dtype=spec.dtype,
        itemsize=ITEMSIZE[spec.dtype],
        shard_dims=shard_dims,
        layout_fingerprint=catalog.LAYOUT,
        parallel_axes=axes,
        layer_id=spec.layer_id,
        expert_id=spec.expert_id,
    )


def instance_parts(
    model: ModelShape, size: int, layout: str = "tp"
) -> tuple[WeightPlacementPart, ...]:
    """One engine instance's placement: one part per GPU of the instance.

    ``tp``: TP ``size`` (routed experts EP over the same ranks); ``ep``: every routed expert
    on one GPU, every other tensor whole on each (see the module docstring).
    """
    if layout not in LAYOUTS:
        raise InvariantViolation(f"unknown instance layout {layout!r}; one of {LAYOUTS}")
    if model.num_experts % size and model.num_experts:
        raise InvariantViolation(f"{model.num_experts} experts do not split over {size} GPUs")
    if layout == "ep" and not model.num_experts:
        raise InvariantViolation(f"{model.name} has no routed experts to lay out EP")
    parts = []
    for r in range(size):
        if layout == "tp":
            rank = ParallelRank(tp=r, ep=r if model.num_experts and size > 1 else 0)
        else:
            rank = ParallelRank(dp=r, ep=r)
        tensors, fragments = [], []
        for spec in model.tensors:
            placed = _placed(spec, size, r, model.num_experts, layout)
            if placed is None:
                continue
            descriptor, offset, local = placed
            tensors.append(descriptor)
            nbytes = math.prod(local) * ITEMSIZE[spec.dtype]
            fragments.append(PlacementFragment(spec.name, offset, local, nbytes, rank))
        parts.append(
            WeightPlacementPart(
                resource_id=model.name,
                revision="r0",
                weight_generation=0,
                placement_set_id=f"{model.name}/{layout}{size}",
                topology_id=f"{model.name}/{layout}{size}",
                participant_id=f"{layout}{r}",
                rank=rank,
                tensors=tuple(tensors),
                fragments=tuple(fragments),
            )
        )
    return tuple(parts)


def _placed(spec: TensorSpec, size: int, r: int, num_experts: int, layout: str):
    zeros = (0,) * len(spec.shape)
    if spec.kind == "expert":
        if spec.expert_id * size // num_experts != r:
            return None
        axes = (OwnershipAxis("ep"), OwnershipAxis("tp" if layout == "tp" else "dp"))
        return _descriptor(spec, (), axes), zeros, spec.shape
    if spec.kind == "replicated" or layout == "ep":
        axis = ReplicatedAxis("tp" if layout == "tp" else "dp")
        return _descriptor(spec, (), (axis,)), zeros, spec.shape
    dim = 0 if spec.kind == "column" else 1
    if spec.shape[dim] % size:
        raise InvariantViolation(f"{spec.name}: dim {dim} of {spec.shape} does not split by {size}")
    share = spec.shape[dim] // size
    offset = tuple(r * share if d == dim else 0 for d in range(len(spec.shape)))
    local = tuple(share if d == dim else n for d, n in enumerate(spec.shape))
    return _descriptor(spec, (dim,), (SplitAxis("tp", dim),)), offset, local


def parse_target(target: str) -> tuple[int, int]:
    """``"16xTP8"`` -> (16 instances, TP 8)."""
    parsed = Target.parse(target)
    if parsed.layout != "tp":
        raise InvariantViolation(f"target must look like 16xTP8, got {target!r}")
    return parsed.instances, parsed.size


@dataclass(frozen=True)
class Target:
    """Rollout engines: ``instances`` engines of ``size`` GPUs, laid out ``tp`` or ``ep``."""

    instances: int
    size: int
    layout: str = "tp"

    def __post_init__(self) -> None:
        for name in ("instances", "size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise InvariantViolation(f"{name} must be a positive int, got {value!r}")
        if self.layout not in LAYOUTS:
            raise InvariantViolation(f"unknown instance layout {self.layout!r}; one of {LAYOUTS}")

    @classmethod
    def parse(cls, text: str) -> Target:
        """``"16xTP8"`` (16 TP8 engines) or ``"4xEP32"`` (4 engines of 32 GPUs, wide EP)."""
        instances, _, rest = text.lower().partition("x")
        layout, size = rest[:2], rest[2:]
        if not instances.isdigit() or layout not in LAYOUTS or not size.isdigit():
            raise InvariantViolation(f"target must look like 16xTP8 or 4xEP32, got {text!r}")
        return cls(int(instances), int(size), layout)

    def __str__(self) -> str:
        return f"{self.instances}x{self.layout.upper()}{self.size}"


def cluster(
    model: ModelShape,
    instances: int,
    tp: int,
    workers_per_node: int = 8,
    layout: str = "tp",
) -> tuple[Topology, DirectDemand]:
    """``instances`` engines of ``tp`` GPUs (laid out ``layout``) packed onto nodes of
    ``workers_per_node`` GPUs.

    All instances share one placement (the same part objects), as identical engines do.
    """
    parts = instance_parts(model, tp, layout)
    workers, by_worker = [], {}
    for i in range(instances):
        for r in range(tp):
            g = i * tp + r
            worker_id = f"w{g:05d}"
            node = f"node{g // workers_per_node:04d}"
            rank = r if layout == "tp" else None  # EP ranks are data-parallel, not TP
            workers.append(Worker(worker_id, node, f"inst{i:04d}", rank))
            by_worker[worker_id] = parts[r]
    return Topology.of(workers), DirectDemand.of(by_worker)
