"""The modules the backend trains and scores with, and how they are sharded.

``PolicyModel`` wraps a Hugging Face causal LM (actor, reference or teacher) and returns log-probs
of wanted tokens only, through the chunked head of :mod:`miles_fsdp.logprobs`; the HF module stays
reachable as ``.hf`` with its own parameter names, which are the names weights travel under.
``ValueModel`` is the critic: the same architecture's decoder with a one-output linear head.

Sharding follows FSDP2 practice: one ``fully_shard`` unit per decoder layer (the classes HF lists in
``_no_split_modules``), then one for the wrapper, which then owns the embeddings, final norm and
output head (tied or not: a tied weight must live in one unit, and it does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from miles_fsdp.logprobs import invariant_token_logprobs, token_logprobs
from miles_fsdp.lora import train_only_adapters

if TYPE_CHECKING:
    from pathlib import Path

    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedModel

# config attributes that change logits after the output projection; the chunked head does not
# apply them, so such models are refused rather than scored wrongly
_UNSUPPORTED_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass(frozen=True, slots=True)
class Precision:
    """``param``: dtype of the stored (sharded, optimised) weights; ``compute``: dtype of the maths."""

    param: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype

    @property
    def mixed(self) -> bool:
        return self.param != self.compute


def resolve_precision(model_dtype: str, device: torch.device, reduce_dtype: str = "float32") -> Precision:
    """``auto``: bf16 compute with fp32 master weights on CUDA, fp32 on CPU (bf16 is ~20x slower there)."""
    name = model_dtype if model_dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    compute = getattr(torch, name)
    reduce = torch.float32 if compute == torch.float32 else getattr(torch, reduce_dtype)
    return Precision(param=torch.float32, compute=compute, reduce=reduce)


def check_supported(hf_config: Any) -> None:
    for attr in _UNSUPPORTED_LOGIT_TRANSFORMS:
        value = getattr(hf_config, attr, None)
        if value not in (None, 1.0, 0.0):
            raise NotImplementedError(
                f"model config sets {attr}={value}: the fsdp backend's chunked log-prob head does not apply "
                f"this logit transform yet, so log-probs would be wrong; use a model without it"
            )


def base_model(hf: PreTrainedModel) -> nn.Module:
    """The decoder stack of a ``*ForCausalLM`` (``hf.model`` for Llama/Qwen)."""
    return getattr(hf, hf.base_model_prefix)


class PolicyModel(nn.Module):
    """A causal LM that returns log-probs (and entropy) of wanted tokens; the FSDP root unit."""

    def __init__(self, hf: PreTrainedModel, *, invariant: bool = False) -> None:
        """``invariant``: the true on-policy forward (:mod:`miles_engine.invariant`): linears row by
        row and the head's log-probs computed as the engine's sampler computes them."""
        super().__init__()
        check_supported(hf.config)
        self.hf = hf
        self.invariant = invariant
        if invariant:
            from miles_engine.invariant import install_linears

            install_linears(hf)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        hidden_index: torch.Tensor,
        target_ids: torch.Tensor,
        *,
        temperature: float = 1.0,
        chunk: int = 1024,
        with_entropy: bool = False,
        compiled: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[K]`` log-probs of ``target_ids`` predicted at flat positions ``hidden_index``."""
        out = base_model(self.hf)(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False,
        )
        hidden = out.last_hidden_state  # [b, t, H]
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, hidden_index)  # [K, H]
        head = self.hf.get_output_embeddings()
        if self.invariant:
            return invariant_token_logprobs(hidden, head.weight, head.bias, target_ids, temperature=temperature,
                                            with_entropy=with_entropy)
        return token_logprobs(
            hidden, head.weight, head.bias, target_ids, temperature=temperature, chunk=chunk, with_entropy=with_entropy,
            compiled=compiled,
        )


class ValueModel(nn.Module):
    """Critic: a decoder stack plus ``value_head: Linear(H, 1)``; returns values at wanted positions."""

    def __init__(self, base: PreTrainedModel, hidden_size: int, init_std: float = 0.0) -> None:
        super().__init__()
        self.base = base
        self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        if init_std > 0:
            nn.init.normal_(self.value_head.weight, std=init_std)
        else:
            nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self) -> Any:
        return self.base.config

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        hidden_index: torch.Tensor,
    ) -> torch.Tensor:
        """``[K]`` fp32 values of the states at flat positions ``hidden_index``."""
        out = self.base(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False)
        hidden = out.last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, hidden_index)  # [K, H]
        # addmv returns a fresh [K] tensor: a view output would lose FSDP's pre-backward hook
        return torch.addmv(self.value_head.bias, hidden, self.value_head.weight[0]).float()


def load_causal_lm(path: str | Path, attn_implementation: str) -> PreTrainedModel:
    """fp32 HF causal LM from a folder (fp32 master weights; compute precision comes from FSDP)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attn_implementation)


def load_value_model(path: str | Path, attn_implementation: str, init_std: float) -> ValueModel:
    from transformers import AutoModel
    from transformers.utils import logging

    logging.disable_progress_bar()
    base = AutoModel.from_pretrained(str(path), dtype=torch.float32, attn_implementation=attn_implementation)
    return ValueModel(base, base.config.hidden_size, init_std)


def decoder_layers(module: PolicyModel | ValueModel) -> list[nn.Module]:
    """Submodules whose class HF marks as not to be split (the decoder layers)."""
    hf = module.hf if isinstance(module, PolicyModel) else module.base
    names = set(getattr(hf, "_no_split_modules", None) or ())
    layers = [m for m in hf.modules() if type(m).__name__ in names]
    if not layers:
        raise NotImplementedError(
            f"{type(hf).__name__} lists no decoder layer classes in _no_split_modules; the fsdp backend "
            f"needs them to shard layer by layer"
        )
    return layers


def enable_activation_checkpointing(hf: PreTrainedModel) -> None:
    """Recompute each decoder layer in backward (non-reentrant, which FSDP2 needs).

    transformers 5.2x renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``;
    both spellings are supported so the same code runs on older installs.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(hf, "activation_checkpointing_enable"):
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def prepare_and_shard(
    module: PolicyModel | ValueModel,
    *,
    mesh: DeviceMesh,
    precision: Precision,
    trainable: bool,
    gradient_checkpointing: bool = False,
    compile_layers: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Freeze or not, enable activation checkpointing, compile, then ``fully_shard`` layers and root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    module.requires_grad_(trainable)
    if trainable:
        train_only_adapters(module)  # with LoRA adapters, the base stays frozen
    hf = module.hf if isinstance(module, PolicyModel) else module.base
    if gradient_checkpointing and trainable:
        enable_activation_checkpointing(hf)
    policy = MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=precision.reduce) if precision.mixed else MixedPrecisionPolicy()
    layers = decoder_layers(module)
    for layer in layers:
        if compile_layers:
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    module.train(trainable)
    return module
