"""``mooncake_rl.Ext``: the vLLM worker extension (``--worker-extension-cls mooncake_rl.Ext``).

vLLM mixes this class into each worker, so ``self`` is the vLLM Worker. Its one method,
``mooncake_call`` (vLLM refuses names that clash with the Worker's), runs the shared
:class:`engine_ext.worker.UpdateWorker` protocol. Staged bytes change live parameters only at
commit, through vLLM's own reload paths: ``reload_weights`` with full checkpoint tensors
(compat) or the layerwise reload that re-runs vLLM's post-load processing (direct; on CPU
this repacks linear weights). In direct mode, a layer whose post-load processing leaves its
parameters as loaded (unquantized layers on CUDA; norms everywhere) receives in place and is
left out of the reload.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine_ext.adapting import BuiltAdapter
from engine_ext.placement import RegionSpec
from engine_ext.shards import ShardSpec
from engine_ext.vllm.placement import describe_vllm_shards, holds_kv_cache_scales
from engine_ext.worker import UpdateWorker
from engine_ext.worker_base import (
    Comparison,
    DirectLanding,
    LandingMismatch,
    live_receivers,
    same_bytes,
)
from mooncake_rl.store import StoreClient


class VllmUpdateWorker(UpdateWorker):
    """The shared worker protocol bound to one vLLM Worker."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def model(self) -> torch.nn.Module:
        return self.worker.model_runner.get_model()

    def configs(self) -> tuple[Any, Any]:
        """(vllm_config, model_config) of the served model: what the layerwise reload reads."""
        return self.worker.vllm_config, self.worker.model_config

    def tp(self) -> tuple[int, int]:
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def describe_regions(self) -> tuple[list[RegionSpec], list[ShardSpec]]:
        return describe_vllm_shards(self.model())

    def land_compat(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Full checkpoint tensors through the model's own ``load_weights``."""
        self._reload(lambda model: model.load_weights(tensors))

    def in_place_parameters(self) -> dict[str, torch.Tensor]:
        """Parameters of layers whose post-load processing is the identity on this platform,
        and that no other layer shares (a tied ``lm_head`` derives its own kernel)."""
        model = self.model()
        verdicts = self.__dict__.setdefault("_identity_processing", {})
        holders: dict[int, list[torch.nn.Module]] = {}
        for layer in model.modules():
            for parameter in layer._parameters.values():
                if parameter is not None:
                    holders.setdefault(id(parameter), []).append(layer)
        excluded = set()
        for name, parameter in model.named_parameters():
            for layer in holders.get(id(parameter), []):
                if id(layer) not in verdicts:
                    verdicts[id(layer)] = processing_is_identity(layer)
            if not all(verdicts[id(layer)] for layer in holders.get(id(parameter), [])):
                excluded.add(name)
        return live_receivers(model, self.regions()[0], self.device(), excluded)

    def land_direct(self, landing: DirectLanding) -> None:
        """Model-format staged tensors, one layer at a time, as vLLM's layerwise reload does.

        Fallback tensors go first, through ``load_weights``: a layer they complete is
        processed at once, and one they feed only in part (a bias beside a directly received
        weight) keeps them buffered until its staged tensors join them below. Layers received
        in place load nothing: the reload puts their (already new) tensors back as they are.
        With nothing staged the reload is skipped: commit only resets the caches.
        """
        from vllm.model_executor.model_loader.reload.layerwise import (
            LAYERWISE_INFO,
            _layerwise_process,
        )
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        rows = list(landing.fallback)  # views into the staging arena: no copy
        model = self.model()
        in_place = landing.in_place
        whole = in_place_layers(model, in_place)
        # A layer received only in part in place (its bias left to the fallback) is reloaded
        # whole: its in-place tensors are fed back from their live storage.
        live = dict(model.named_parameters())
        staged = {
            **landing.staged,
            **{n: live[n].data for n in in_place if n.rpartition(".")[0] not in whole},
        }

        def feed(model: torch.nn.Module) -> None:
            model.load_weights(iter(rows))
            for module_name, layer in model.named_modules():
                info = LAYERWISE_INFO.get(layer)
                tensors = layer_tensors(module_name, layer, staged)
                if info is None or not info.can_load() or not tensors:
                    continue
                materialize_layer(layer, info)
                names = list(tensors)
                torch._foreach_copy_(
                    [getattr(layer, n).data for n in names], [tensors[n] for n in names]
                )
                _layerwise_process(layer, info)

        if staged or rows:
            self._reload(feed, whole)
        else:
            self._reset_runner_caches()

    def expect_live(
        self, expected: Mapping[str, torch.Tensor], received: Collection[str] = ()
    ) -> list[LayerReference]:
        """Each layer's expected tensors, by the layer's own parameter names, and how it is
        compared (see :meth:`compare_live`); ``received``: names received in place.

        Only the grouping runs before the pause. The fresh kernels stay in the pause:
        built while the engine served, a fresh CPU GEMM's probe output differed from the
        landed layer's now and then (about one update in ten under ``bench load``, with
        staging verified unchanged), and a bit-exact check cannot take a reference whose
        bits depend on when it was made.
        """
        model = self.model()
        named = {id(p): n for n, p in model.named_parameters() if n in expected}
        references: list[LayerReference] = []
        for module_name, layer in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            own = {
                n: t
                for n, p in layer._parameters.items()
                if p is not None
                and (t := expected.get(prefix + n, expected.get(named.get(id(p), "")))) is not None
            }
            if not own:
                continue
            method = getattr(layer, "quant_method", None)
            if getattr(getattr(method, "moe_kernel", None), "fused_experts", None) is not None:
                references.append(LayerReference(prefix, layer, own, "experts"))
            elif hasattr(method, "apply") and "weight" in own:
                # A parameter with no expected tensor that was not received in place (a
                # fused scale landed through the engine's loader) feeds the fresh kernel as
                # served: it is not checked.
                taken = frozenset(
                    n
                    for n, p in layer._parameters.items()
                    if p is not None and n not in own and prefix + n not in received
                )
                references.append(LayerReference(prefix, layer, own, "kernel", taken))
            else:
                references.append(LayerReference(prefix, layer, own, "bytes"))
        return references

    def compare_live(self, reference: list[LayerReference]) -> Comparison:
        """Each layer as served against the same layer freshly loaded with the expected
        tensors.

        vLLM keeps derived state a byte comparison cannot see (CPU GEMMs hold packed weights
        in closures; CPU experts are prepacked), so a layer with a kernel is compared through
        it: a shadow of the layer gets the expected model-format tensors and the layer's own
        ``process_weights_after_loading``, then both run one probe input and must agree
        bit for bit. Fused experts are compared with their own prepack of the expected
        tensors; tensors without a kernel are compared as bytes.
        """
        differ: list[str] = []
        unchecked: list[str] = []
        for expected in reference:
            layer, prefix = expected.layer, expected.prefix
            method = getattr(layer, "quant_method", None)
            # Host staging: one layer's expected tensors on the device at a time.
            own = {n: t.to(getattr(layer, n).device) for n, t in expected.tensors.items()}
            kernel: frozenset[str] = frozenset()
            if expected.kind == "experts":
                fresh = fresh_experts(layer, method, method.moe_kernel.fused_experts, own)
                kernel = frozenset(own)
                for n in own:
                    if fresh is None or n not in fresh:
                        unchecked.append(prefix + n)
                    elif not same_bytes(getattr(layer, n), fresh[n]):
                        differ.append(prefix + n)
            elif expected.kind == "kernel":
                probe, output, kernel = fresh_kernel(layer, method, own)
                if not torch.equal(method.apply(layer, probe), output):
                    differ.append(prefix + "weight")
            unchecked += sorted(prefix + n for n in expected.unchecked)
            differ += [
                prefix + n
                for n, tensor in own.items()
                if n not in kernel and not same_bytes(getattr(layer, n), tensor)
            ]
        return Comparison(differ, unchecked)

    def _reload(
        self, feed: Callable[[torch.nn.Module], object], received: Collection[str] = ()
    ) -> None:
        """vLLM's layerwise reload around ``feed``, then tied layers re-derived.

        A layer that loads nothing because its weights are another layer's (a tied
        ``lm_head``) would otherwise keep kernels derived from the old generation: vLLM
        restores its tensors untouched, and on CPU its packed GEMM weights go stale.
        Layers whose parameters were all received in place (``received``) load nothing on
        purpose: vLLM restores them with a "Failed to load weights" warning, which is
        silenced for the reload; any other layer that loads nothing still fails the commit.
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model()
        vllm_config, model_config = self.configs()
        with (
            set_current_vllm_config(vllm_config),
            torch.no_grad(),
            quiet_restores(bool(received)),
        ):
            initialize_layerwise_reload(model)
            feed(model)
            rederive_tied_layers(model)
            stale = [name for name in unloaded_layers(model) if name not in received]
            finalize_layerwise_reload(model, model_config)
            repack_cpu_experts(model)
        if stale:
            raise LandingMismatch(
                f"the generation loaded nothing into {stale[:5]}: they would serve the previous "
                "weights; never served, rebuild from the Store"
            )
        self._reset_runner_caches()

    def build_adapter(
        self, store: StoreClient, model: str, generation: int, serves: tuple[str, int]
    ) -> BuiltAdapter:
        """vLLM's ``LoRAModel`` of the adapter (refused unless it fits ``--max-lora-rank``
        and the modules vLLM can adapt), and the digest of a second build merged as the
        manager merges what it adds (:func:`engine_ext.vllm.lora.merged_digest`)."""
        from engine_ext.vllm.lora import (
            adapter_id,
            adapter_model,
            merged_digest,
            read_adapter_generation,
        )

        manager = self._lora_manager()
        record, tensors = read_adapter_generation(store, model, generation, serves)
        lora = adapter_model(manager, record, tensors, adapter_id(generation))
        # Its own tensors: a LoRAModel holds what it is given, and merging scales in place.
        copies = {name: t.clone() for name, t in tensors.items()}
        fresh = adapter_model(manager, record, copies, adapter_id(generation))
        return BuiltAdapter(
            generation,
            lora,
            merged_digest(manager, fresh),
            sum(t.nbytes for t in tensors.values()),
        )

    def land_adapter(self, built: BuiltAdapter) -> None:
        from engine_ext.vllm.lora import make_resident

        make_resident(self._lora_manager(), built.adapter)

    def resident_adapter(self, generation: int) -> str | None:
        from engine_ext.vllm.lora import adapter_id, held_adapter, lora_digest

        held = held_adapter(self._lora_manager(), adapter_id(generation))
        return None if held is None else lora_digest(held)

    def evict_adapter(self, generation: int) -> list[int]:
        from engine_ext.vllm.lora import adapter_id, evict, resident

        manager = self._lora_manager()
        evict(manager, adapter_id(generation))
        return sorted(resident(manager))

    def _lora_manager(self) -> Any:
        from engine_ext.admission import RequestRefused

        manager = getattr(self.worker.model_runner, "lora_manager", None)
        if manager is None:
            raise RequestRefused(
                409, "lora_disabled", "this engine runs without LoRA: start it with --enable-lora"
            )
        return manager

    def _reset_runner_caches(self) -> None:
        runner = self.worker.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(runner, reset, lambda: None)()


def processing_is_identity(layer: torch.nn.Module) -> bool:
    """Whether vLLM's post-load processing leaves ``layer`` exactly as loaded, so bytes
    written into its live parameters are what it serves.

    Layers without a quantization method are only materialized and filled by the reload.
    Otherwise the method's ``process_weights_after_loading`` runs once on a shadow of the
    layer: any parameter replaced, moved or changed, or any attribute set (CPU GEMM
    dispatch stores a packed kernel), means the layer is processed. Deferred attention
    layers and fused experts always are.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    method = getattr(layer, "quant_method", None)
    # Expert kernels keep state on the method object, which a shadow would share.
    if is_deferred_attention_layer(layer) or isinstance(method, FusedMoEMethodBase):
        return False
    if not isinstance(method, QuantizeMethodBase):
        return True
    live = {n: p for n, p in layer._parameters.items() if p is not None}
    if not live:
        return True
    shadow = shadow_layer(layer, live)
    given = dict(shadow._parameters)
    attributes = {k: v for k, v in shadow.__dict__.items() if k != "_parameters"}
    pointers = {n: p.data_ptr() for n, p in given.items() if p is not None}
    try:
        method.process_weights_after_loading(shadow)
    except Exception:  # cannot be run off the live layer: treat as processed
        return False
    after = {k: v for k, v in shadow.__dict__.items() if k != "_parameters"}
    return (
        after.keys() == attributes.keys()
        and all(after[k] is attributes[k] for k in attributes)
        and shadow._parameters.keys() == given.keys()
        and all(shadow._parameters[n] is given[n] for n in given)
        and all(given[n].data_ptr() == pointers[n] for n in pointers)
        and all(torch.equal(given[n], live[n]) for n in live)
    )


def in_place_layers(model: torch.nn.Module, in_place: Collection[str]) -> set[str]:
    """Names of layers whose every parameter was received in place (a tied ``lm_head``
    holds the embedding's very Parameter, so it counts when the embedding does)."""
    received = {id(p) for n, p in model.named_parameters() if n in in_place}
    return {
        name
        for name, layer in model.named_modules()
        if (own := [p for p in layer._parameters.values() if p is not None])
        and all(id(p) in received for p in own)
    }


@contextlib.contextmanager
def quiet_restores(active: bool) -> Iterator[None]:
    """Drop vLLM's "Failed to load weights" warning while ``active``: layers received in
    place load nothing by design, and :func:`unloaded_layers` still catches real misses."""
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    def keep(record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in record.getMessage()

    if active:
        layerwise.addFilter(keep)
    try:
        yield
    finally:
        layerwise.removeFilter(keep)


def shadow_layer(layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A copy of ``layer`` holding only ``tensors`` (fresh Parameters); the live layer's
    parameters, buffers and submodules are not shared, so processing it changes nothing live."""
    shadow = object.__new__(type(layer))
    shadow.__dict__.update(layer.__dict__)
    shadow._parameters = {n: None for n in layer._parameters}
    shadow._buffers, shadow._modules = {}, {}
    for name, tensor in tensors.items():
        live = layer._parameters[name]
        fresh = torch.nn.Parameter(tensor.to(live.device).clone(), requires_grad=False)
        fresh.__dict__.update(live.__dict__)
        shadow._parameters[name] = fresh
    return shadow


def fresh_experts(
    layer: torch.nn.Module, method: Any, experts: Any, expected: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """Fused expert weights as a fresh load stores them: on CPU the experts' own prepack of
    the expected tensors; elsewhere the method's padding and kernel-format conversion (not
    run on a GPU here yet). ``None`` where that conversion cannot be reproduced."""
    from vllm.platforms import current_platform

    shadow = shadow_layer(layer, expected)
    if current_platform.is_cpu():
        experts.process_weights_after_loading(shadow)
        return {n: shadow._parameters[n] for n in expected}
    try:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
            convert_to_unquantized_kernel_format,
        )

        w13, w2 = convert_to_unquantized_kernel_format(
            method.unquantized_backend,
            moe_config=layer.moe_config,
            w13_weight=method._maybe_pad_weight(shadow.w13_weight.data),
            w2_weight=method._maybe_pad_weight(shadow.w2_weight.data),
            layer=shadow,
        )
    except Exception:  # a backend whose layout cannot be rebuilt off the live layer
        return None
    return {"w13_weight": w13, "w2_weight": w2}


def fresh_kernel(
    layer: torch.nn.Module, method: Any, expected: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, frozenset[str]]:
    """A probe input in the layer's activation dtype, what a fresh GEMM built from
    ``expected`` (its weight and, when quantized, the scales the kernel reads) outputs on
    it, and which of ``expected`` processing converts into kernel format (packed,
    requantized), which only the probe can compare. The others (an embedding's weight, a
    block-fp8 scale the CPU kernel keeps) stay comparable as bytes. A parameter the check
    has no expected tensor for (a fused scale landed through the engine's loader) enters the
    fresh kernel as served, and the caller reports it unchecked."""
    served = {n: p for n, p in layer._parameters.items() if p is not None and n not in expected}
    shadow = shadow_layer(layer, {**served, **expected})
    method.process_weights_after_loading(shadow)
    converted = frozenset(
        name
        for name, tensor in expected.items()
        if (processed := shadow._parameters.get(name)) is None or not same_bytes(processed, tensor)
    )
    weight = expected["weight"]
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(2, weight.shape[-1], generator=generator)
    probe = probe.to(getattr(layer, "params_dtype", None) or weight.dtype)
    probe = probe.to(layer.weight.device)
    return probe, method.apply(shadow, probe), converted


@dataclass(frozen=True)
class LayerReference:
    """One layer's side of the post-landing check: its expected tensors (by the layer's
    own parameter names), how it is compared, and its parameters left unchecked."""

    prefix: str
    layer: torch.nn.Module
    tensors: Mapping[str, torch.Tensor]
    kind: Literal["bytes", "kernel", "experts"]
    unchecked: frozenset[str] = frozenset()


def layer_tensors(
    module_name: str, layer: torch.nn.Module, staged: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The staged tensors that belong to ``layer`` (its own parameters only)."""
    prefix = f"{module_name}." if module_name else ""
    return {
        param_name: staged[prefix + param_name]
        for param_name in layer._parameters
        if prefix + param_name in staged
    }


def repack_cpu_experts(model: torch.nn.Module) -> None:
    """Re-run the CPU MoE kernel's prepack, which vLLM 0.32 skips on a weight update.

    ``UnquantizedFusedMoEMethod._setup_kernel`` runs ``fused_experts.
    process_weights_after_loading`` only on the first load (GPU kernels keep addresses
    captured by CUDA graphs). On CPU that step prepacks the experts into the grouped-GEMM
    layout, so without it a reload leaves unpacked new bytes where packed ones belong.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None:
            experts.process_weights_after_loading(layer)


def unloaded_layers(model: torch.nn.Module) -> list[str]:
    """Layers with parameters that the reload has not written (vLLM would warn "Failed to
    load weights" and put the old tensors back): a mixed model if served. KV-cache scales
    keep their defaults on purpose (:func:`holds_kv_cache_scales`)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return [
        name
        for name, layer in model.named_modules()
        if (info := LAYERWISE_INFO.get(layer)) is not None
        and info.can_load()
        and info.restore_metadata[0]
        and info.load_numel == 0
        and not holds_kv_cache_scales(layer)
    ]


def rederive_tied_layers(model: torch.nn.Module) -> None:
    """Re-run post-load processing for layers whose weights are a loaded layer's weights."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        _place_kernel_tensors,
    )

    def pending(layer: torch.nn.Module) -> bool:
        info = LAYERWISE_INFO.get(layer)
        return info is not None and info.can_load()

    loaded = {
        id(p) for layer in model.modules() if not pending(layer) for p in layer.parameters(False)
    }
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        if not pending(layer) or info.load_numel > 0 or info.kernel_tensors is None:
            continue
        kernel_params = list(info.kernel_tensors[0].values())
        if not kernel_params or any(id(p) not in loaded for p in kernel_params):
            continue
        _place_kernel_tensors(layer, info)
        info.reset()
        method = getattr(layer, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(layer)


class MooncakeWorkerExtension:
    """Mixed into vLLM's Worker; see the module docstring."""

    def mooncake_call(self, engine_id: str, method: str, *args: Any) -> dict[str, Any]:
        updater = getattr(self, "_mooncake_updater", None)
        if updater is None:
            updater = self._mooncake_updater = VllmUpdateWorker(self)
        return updater.call(engine_id, method, *args)


__all__ = ["MooncakeWorkerExtension"]
