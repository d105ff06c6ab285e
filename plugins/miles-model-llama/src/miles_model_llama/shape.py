"""A Llama-style decoder's sizes, read from ``config.json``, and megatron-core's kwargs for it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from miles_model_llama.layout import SPEC_FUNCTIONS, MegatronLayout
from miles_model_llama.mapping import AttentionDims, BridgeError

# HF ``hidden_act`` -> name in ``torch.nn.functional`` (megatron-core wants the callable).
ACTIVATIONS: dict[str, str] = {"silu": "silu", "gelu": "gelu"}

# Llama 3.1 rope scaling as megatron-core implements it (``RotaryEmbedding._apply_scaling``):
# only the factor is a parameter, the rest is fixed.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """Sizes and switches of a Llama-style decoder (what the weight layout and megatron need).

    Built by :meth:`from_hf`, which reports every unsupported or missing setting at once.
    """

    num_layers: int
    hidden_size: int
    attention: AttentionDims
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    norm_eps: float
    tied_embeddings: bool
    linear_bias: bool
    activation: str
    rope_theta: float
    rope_scaling_factor: float | None
    initializer_range: float
    attention_dropout: float

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> DecoderShape:
        errors = [f"config.json has no {key!r}" for key in _REQUIRED if key not in hf_config]
        if errors:
            raise BridgeError("; ".join(errors))
        heads = int(hf_config["num_attention_heads"])
        hidden = int(hf_config["hidden_size"])
        activation = hf_config.get("hidden_act", "silu")
        if activation not in ACTIVATIONS:
            errors.append(f"hidden_act {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        attention_bias = bool(hf_config.get("attention_bias", False))
        mlp_bias = bool(hf_config.get("mlp_bias", False))
        if attention_bias != mlp_bias:
            errors.append(
                f"attention_bias={attention_bias} with mlp_bias={mlp_bias} cannot be expressed in megatron-core, "
                f"whose add_bias_linear switches the biases of attention and MLP together"
            )
        rope_theta, rope_factor, rope_errors = _rope(hf_config)
        errors += rope_errors
        if errors:
            raise BridgeError("unsupported config.json: " + "; ".join(errors))
        return cls(
            num_layers=int(hf_config["num_hidden_layers"]),
            hidden_size=hidden,
            attention=AttentionDims(
                num_heads=heads,
                num_groups=int(hf_config.get("num_key_value_heads") or heads),
                head_dim=int(hf_config.get("head_dim") or hidden // heads),
            ),
            ffn_hidden_size=int(hf_config["intermediate_size"]),
            vocab_size=int(hf_config["vocab_size"]),
            max_position_embeddings=int(hf_config.get("max_position_embeddings", 2048)),
            norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            linear_bias=attention_bias,
            activation=activation,
            rope_theta=rope_theta,
            rope_scaling_factor=rope_factor,
            initializer_range=float(hf_config.get("initializer_range", 0.02)),
            attention_dropout=float(hf_config.get("attention_dropout", 0.0)),
        )

    def transformer_config(self) -> dict[str, Any]:
        """Keyword arguments of ``megatron.core.transformer.TransformerConfig`` (model only: no
        parallelism, precision or fusion settings, which belong to the backend)."""
        import torch.nn.functional as F

        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.attention.num_heads,
            "num_query_groups": self.attention.num_groups,
            "kv_channels": self.attention.head_dim,
            "ffn_hidden_size": self.ffn_hidden_size,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.norm_eps,
            "gated_linear_unit": True,
            "activation_func": getattr(F, ACTIVATIONS[self.activation]),
            "add_bias_linear": self.linear_bias,
            "add_qkv_bias": self.linear_bias,
            "hidden_dropout": 0.0,
            "attention_dropout": self.attention_dropout,
            "init_method_std": self.initializer_range,
            "qk_layernorm": False,
        }

    def gpt_model(self) -> dict[str, Any]:
        """Keyword arguments of ``megatron.core.models.gpt.GPTModel`` besides config and spec."""
        theta = self.rope_theta
        kwargs: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "max_sequence_length": self.max_position_embeddings,
            "position_embedding_type": "rope",
            "rotary_base": int(theta) if float(theta).is_integer() else theta,
            "rotary_percent": 1.0,
            "share_embeddings_and_output_weights": self.tied_embeddings,
        }
        if self.rope_scaling_factor is not None:
            kwargs.update(rope_scaling=True, rope_scaling_factor=self.rope_scaling_factor)
        return kwargs


def layer_spec(layout: MegatronLayout, *, num_experts: int | None = None, qk_layernorm: bool = False) -> dict[str, Any]:
    """The megatron-core layer-spec function (in ``megatron.core.models.gpt.gpt_layer_specs``) and
    its kwargs that produce the names of ``layout``."""
    kwargs: dict[str, Any] = {"num_experts": num_experts, "moe_grouped_gemm": layout.grouped_gemm, "qk_layernorm": qk_layernorm}
    if layout.spec == "local":
        kwargs["normalization"] = "RMSNorm"  # the TE spec reads it from TransformerConfig instead
    return {"function": SPEC_FUNCTIONS[layout.spec], "kwargs": kwargs}


def _rope(hf_config: Mapping[str, Any]) -> tuple[float, float | None, list[str]]:
    """(rope_theta, llama3 scaling factor or None, errors). Reads transformers 5's
    ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling`` keys."""
    params = hf_config.get("rope_parameters") or {
        **(hf_config.get("rope_scaling") or {}),
        "rope_theta": hf_config.get("rope_theta", 10000.0),
    }
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = _ROPE_TYPES.get(kind)
    if scaling is None:
        return theta, None, [f"rope_type {kind!r} is not supported by this bridge (supported: {', '.join(_ROPE_TYPES)})"]
    factor, errors = scaling(params)
    return theta, factor, errors


def _no_scaling(params: Mapping[str, Any]) -> tuple[float | None, list[str]]:
    return None, []


def _llama3_scaling(params: Mapping[str, Any]) -> tuple[float | None, list[str]]:
    differing = {k: params.get(k) for k, v in _MEGATRON_LLAMA3_ROPE.items() if float(params.get(k, -1)) != v}
    if differing:
        return None, [f"llama3 rope scaling with {differing} differs from megatron-core's fixed {_MEGATRON_LLAMA3_ROPE}"]
    return float(params["factor"]), []


# HF rope_type -> (megatron-core rope_scaling_factor or None, errors)
_ROPE_TYPES: dict[str, Callable[[Mapping[str, Any]], tuple[float | None, list[str]]]] = {
    "default": _no_scaling,
    "llama3": _llama3_scaling,
}
