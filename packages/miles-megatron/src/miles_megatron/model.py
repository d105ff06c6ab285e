"""The megatron-core model of a run: ``TransformerConfig``, ``GPTModel`` chunks, DDP, optimizer.

The bridge says what the model is (``megatron_config()``: sizes, norms, rope, experts); this module
adds how it runs (parallel sizes, precision, recomputation, fusions) and builds one ``GPTModel``
per pipeline chunk of this rank (several with interleaving), each wrapped in megatron-core's
``DistributedDataParallel``, and megatron-core's optimizer over all of them (distributed optimizer
by default). Weights are initialised (which is also where megatron-core marks how each is
sharded) and then overwritten from the checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_megatron import rope
from miles_megatron.config import MegatronSection
from miles_megatron.parallel import Layout
from miles_megatron.spec import block_spec

# CUDA kernels megatron-core fuses by default; without Transformer Engine/Apex they must be off
_NO_FUSED_KERNELS: dict[str, Any] = {
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
    "moe_permute_fusion": False,
}
# and on the CPU the jit-fused bias/activation/dropout paths too
_CPU_ONLY: dict[str, Any] = {"bias_activation_fusion": False, "bias_dropout_fusion": False, "use_cpu_initialization": True}

_RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


@dataclass(slots=True)
class ModelParts:
    """What :func:`build` made.

    :ivar chunks: the ``GPTModel`` of each virtual pipeline stage of this rank (unwrapped).
    :ivar wrapped: the same chunks as megatron-core DDP modules (what schedules and optimizer take).
    :ivar optimizer: megatron-core's optimizer over all chunks.
    :ivar config: the ``TransformerConfig`` every chunk shares.
    :ivar vocab_size / padded_vocab: real vocabulary and its size padded for tensor parallelism.
    """

    chunks: list[Any]
    wrapped: list[Any]
    optimizer: Any
    config: Any
    vocab_size: int
    padded_vocab: int
    extra: dict[str, Any] = field(default_factory=dict)


def transformer_config(megatron_config: Mapping[str, Any], options: MegatronSection, layout: Layout, *,
                       dtype: torch.dtype, device: torch.device, transformer_engine: bool, recompute: str) -> Any:
    from megatron.core.transformer import TransformerConfig

    settings = dict(megatron_config["transformer_config"])
    if settings.get("num_moe_experts"):
        if options.moe_aux_loss_coef is not None:
            settings["moe_aux_loss_coeff"] = options.moe_aux_loss_coef
        balancing = options.moe_load_balancing
        if balancing == "none" or not settings.get("moe_aux_loss_coeff"):
            settings["moe_router_load_balancing_type"], settings["moe_aux_loss_coeff"] = "none", 0.0
        else:
            settings["moe_router_load_balancing_type"] = balancing
        # routers keep a RouterReplay slot: a miles_forward wrapper (R3) can record or replay routing
        settings["moe_enable_routing_replay"] = True
    if not transformer_engine:
        settings.update(_NO_FUSED_KERNELS)
    elif not settings.get("multi_latent_attention") and not settings.get("rotary_interleaved"):
        # Transformer Engine's fused rotary embedding takes packed (THD) sequences whole; without it
        # megatron-core applies the embedding sequence by sequence, with a device sync per layer
        settings.setdefault("apply_rope_fusion", True)
    if device.type == "cpu":
        settings.update(_CPU_ONLY)
    elif device.type == "cuda":
        # megatron-core's own fused SwiGLU and bias-dropout-add (torch.compile'd functions, no
        # Transformer Engine needed). Not its GeGLU: that one is the tanh approximation of GELU,
        # which would silently change an exact-GELU model.
        swiglu = settings.get("gated_linear_unit") and settings.get("activation_func") is torch.nn.functional.silu
        settings.setdefault("bias_activation_fusion", bool(swiglu))
        settings.setdefault("bias_dropout_fusion", True)
    settings.update(_RECOMPUTE[recompute])
    low = dtype != torch.float32
    settings.update(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp, context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep, sequence_parallel=options.sequence_parallel and layout.tp > 1,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype if low else torch.float32,
        pipeline_dtype=dtype, variable_seq_lengths=layout.pp > 1,
        # micro-batches differ in length; through a pipeline megatron-core allows that with the
        # all-to-all token dispatcher only (the one to use with expert parallelism anyway)
        moe_token_dispatcher_type="alltoall",
    )
    return TransformerConfig(**settings)


def padded_vocab_size(vocab: int, options: MegatronSection, layout: Layout) -> int:
    multiple = options.vocab_multiple * layout.tp
    return -(-vocab // multiple) * multiple


def build_chunks(megatron_config: Mapping[str, Any], config: Any, layout: Layout, padded_vocab: int, *,
                 transformer_engine: bool, device: torch.device, compiled: bool = False,
                 compile_layers: bool = False, varlen: bool = False,
                 sdpa: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> list[Any]:
    """This rank's ``GPTModel`` chunks (one per virtual stage), on ``device``, weights uninitialised.

    With the local layers, rotary embeddings move into core attention (:mod:`miles_megatron.rope`),
    through ``torch.compile`` when ``compiled``; ``compile_layers``: every dense transformer layer
    goes through ``torch.compile`` (its rotary embedding traced with it); ``varlen``: core attention
    is one varlen call; ``sdpa``: the context its PyTorch attention calls run in (kernel order)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    gpt_kwargs = dict(megatron_config["gpt_model"])
    gpt_kwargs["vocab_size"] = padded_vocab
    chunks = []
    for stage in range(layout.vpp or 1):
        vp_stage = stage if layout.vpp else None
        model = GPTModel(
            config, block_spec(megatron_config, config, transformer_engine=transformer_engine, vp_stage=vp_stage),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage, **gpt_kwargs,
        )
        if not transformer_engine:
            rope.defer(model, compiled=compiled)
            for layer in model.decoder.layers:
                layer.self_attention.core_attention.varlen = varlen
                layer.self_attention.core_attention.sdpa = sdpa
            if compile_layers:
                _compile_layers(model)
        chunks.append(model.to(device))
    return chunks


def _compile_layers(model: Any) -> None:
    """``torch.compile`` each of ``model``'s transformer layers in place (parameter names unchanged).

    What fuses: the norms with their neighbours, query/key norms with the rotary embedding, the
    residual adds and casts. Core attention runs eagerly inside (``TorchAttention._packed``): the
    one graph break of a layer. MoE layers stay eager: their token routing has data-dependent
    shapes, dozens of graph breaks.
    """
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    for layer in model.decoder.layers:
        if getattr(layer, "is_moe_layer", False):
            continue
        core = layer.self_attention.core_attention
        if getattr(core, "apply_rope", None) is not None:
            core.apply_rope = rope.apply  # traced with the layer (fused with the q/k norms)
        for module in layer.modules():
            if isinstance(module, RowParallelLinear):
                module._forward_impl = functools.partial(_with_tp_group, module._forward_impl, module.tp_group)
        layer.compile()


def _with_tp_group(forward_impl: Any, group: Any, *args: Any, **kwargs: Any) -> Any:
    """megatron-core's ``RowParallelLinear`` calls its linear function with ``tp_group=None`` (its
    all-reduce comes after), and the function then warns on every call that it takes the default
    group: a graph break each time under ``torch.compile`` (a warning with a category cannot be
    moved out of the graph). The group is unused there (no dgrad all-reduce, no sequence parallel)."""
    if kwargs.get("tp_group") is None:
        kwargs["tp_group"] = group
    return forward_impl(*args, **kwargs)


def wrap_and_optimize(chunks: list[Any], config: Any, options: MegatronSection, *, lr: float, betas: tuple[float, float],
                      weight_decay: float, grad_clip: float) -> tuple[list[Any], Any]:
    """Cast to the compute dtype, wrap each chunk in megatron-core DDP, build the optimizer."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=options.grad_reduce_in_fp32, overlap_grad_reduce=options.overlap_grad_reduce,
        use_distributed_optimizer=options.distributed_optimizer,
    )
    wrapped = []
    for index, chunk in enumerate(chunks):
        module = Float16Module(config, chunk) if (config.bf16 or config.fp16) else chunk
        wrapped.append(DistributedDataParallel(config, ddp_config, module, disable_bucketing=index > 0))
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=betas[0], adam_beta2=betas[1],
        clip_grad=grad_clip, bf16=config.bf16, fp16=config.fp16, params_dtype=config.params_dtype,
        use_distributed_optimizer=options.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(optimizer_config, wrapped)
    config.finalize_model_grads_func = finalize_model_grads
    syncs = [w.no_sync for w in wrapped]
    config.no_sync_func = syncs[0] if len(syncs) == 1 else syncs
    return wrapped, optimizer


def set_learning_rate(optimizer: Any, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
