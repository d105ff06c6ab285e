"""The layer spec a model is built with, and the names its weights travel under.

A bridge's ``megatron_config()`` names a megatron-core layer-spec function. With Transformer
Engine (GPU) that spec is used as is. Without it, the model is built from megatron-core's local
spec with two substitutions, since the local spec's own modules cannot run our layouts:

* norms: megatron-core's ``WrappedTorchNorm`` refuses sequence parallelism, so norms are
  PyTorch's ``RMSNorm`` / ``LayerNorm`` whose weights carry the ``sequence_parallel`` mark that
  makes ``finalize_model_grads`` sum their gradients over tensor-parallel ranks;
* core attention: megatron-core's ``DotProductAttention`` supports neither packed (THD)
  sequences nor context parallelism; :class:`miles_megatron.attention.TorchAttention` does both
  with PyTorch's scaled-dot-product attention.

Bridges name tensors as the Transformer Engine spec does (megatron-core's checkpoint names); the
local spec keeps two norms as modules of their own. :func:`local_name` maps a bridge name to the
local module's, exactly inverting megatron-core's ``sharded_state_dict_keys_map``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

TE_SPEC = "get_gpt_layer_with_transformer_engine_spec"
LOCAL_SPEC = "get_gpt_layer_local_spec"

# Transformer Engine name part -> local spec name part (megatron-core's keys map, inverted)
_TE_TO_LOCAL = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."), ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))


def transformer_engine_available() -> bool:
    """Transformer Engine with its PyTorch extension (the core package alone imports without it)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError, AssertionError):  # what its loader raises when the extension is missing or mismatched
        return False
    return True


def use_transformer_engine(impl: str, device: torch.device) -> bool:
    if impl == "transformer_engine":
        if not transformer_engine_available():
            raise RuntimeError("megatron.transformer_impl: transformer_engine, but Transformer Engine does not import; "
                               "install transformer-engine or use transformer_impl: local")
        if device.type != "cuda":
            raise RuntimeError("megatron.transformer_impl: transformer_engine needs a CUDA device")
        return True
    return impl == "auto" and device.type == "cuda" and transformer_engine_available()


def local_name(bridge_name: str) -> str:
    """The local-spec parameter name of a bridge (Transformer Engine) name; other names unchanged."""
    for te, local in _TE_TO_LOCAL:
        if te in bridge_name:
            return bridge_name.replace(te, local)
    return bridge_name


def _norm_class(config: Any) -> type[torch.nn.Module]:
    kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
    if config.normalization not in kinds:
        raise ValueError(f"normalization {config.normalization!r} is not supported by the local layers; use {', '.join(kinds)}")
    return kinds[config.normalization]


# Classes whose __new__ builds a plain PyTorch norm, not functions: megatron-core's build_module
# calls the classes of a spec, but gives a function back as it is (mypy wants __new__ to return
# an instance of its class, hence the ignores).


class SequenceParallelNorm:
    """A PyTorch norm over the hidden size; its weights are marked ``sequence_parallel`` so their
    gradients are summed over tensor-parallel ranks, which each saw a slice of the sequence."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        norm = _norm_class(config)(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # megatron-core reads it
        return norm


class HeadNorm:
    """A PyTorch norm over the head dimension (q/k norms); megatron-core reduces its gradients by name."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        return _norm_class(config)(hidden_size, eps=eps)


def block_spec(megatron_config: Mapping[str, Any], config: Any, *, transformer_engine: bool, vp_stage: int | None) -> Any:
    """``TransformerBlockSubmodules`` for this rank's layers (pipeline stage, virtual chunk)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    spec_config = megatron_config["layer_spec"]
    kwargs = dict(spec_config.get("kwargs") or {})
    if transformer_engine:
        from megatron.core.extensions.transformer_engine import TENorm

        layer = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            **{k: v for k, v in kwargs.items() if k != "normalization"})
        final_norm: Any = TENorm
    else:
        if kwargs.get("moe_grouped_gemm"):
            raise ValueError("the bridge asks for grouped expert GEMMs (Transformer Engine); the local layers run "
                             "experts one by one: use a bridge layout without grouped_gemm, or Transformer Engine")
        kwargs["normalization"] = config.normalization
        layer = gpt_layer_specs.get_gpt_layer_local_spec(**kwargs)
        _substitute_local_modules(layer)
        final_norm = SequenceParallelNorm
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=final_norm)


def _substitute_local_modules(layer: Any) -> None:
    from miles_megatron.attention import TorchAttention

    sub = layer.submodules
    sub.input_layernorm = SequenceParallelNorm
    sub.pre_mlp_layernorm = SequenceParallelNorm
    attention = sub.self_attention.submodules
    attention.core_attention = TorchAttention
    for name in ("q_layernorm", "k_layernorm"):
        current = getattr(attention, name, None)
        if current is not None and getattr(current, "__name__", "") != "IdentityOp":
            setattr(attention, name, HeadNorm)
