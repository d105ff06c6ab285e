"""Which megatron-core layer spec a bridge's names follow.

megatron-core names most tensors the same way whatever the spec, but three things move:

* **norms** -- the Transformer Engine spec (``get_gpt_layer_with_transformer_engine_spec``) fuses
  the attention norm into ``linear_qkv`` and the dense-MLP norm into ``linear_fc1``
  (``...layer_norm_weight``); MoE layers keep a separate ``pre_mlp_layernorm``. The local spec
  (``get_gpt_layer_local_spec``, no Transformer Engine, what runs on CPU) has ``input_layernorm``
  and ``pre_mlp_layernorm`` modules everywhere.
* **experts** -- ``SequentialMLP`` (megatron-core's default, ``moe_grouped_gemm=False``) holds one
  MLP per expert, ``mlp.experts.local_experts.{e}.linear_fc1.weight``; Transformer Engine's
  ``TEGroupedMLP`` (``moe_grouped_gemm=True``) holds ``mlp.experts.linear_fc1.weight{e}``. Both
  store each expert's matrix in the same shape, so only the name differs.

The default, ``MegatronLayout()``, is what production megatron-core training uses: Transformer
Engine spec, sequential experts (megatron-core's default). Megatron's own distributed checkpoints
use the Transformer Engine names even for local-spec models (the local spec maps them in
``sharded_state_dict_keys_map``), so these are the canonical names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles_model_llama.mapping import BridgeError

Spec = Literal["transformer_engine", "local"]

# Per spec: where the attention norm, the dense-MLP norm and the MoE-layer norm live, relative to
# ``decoder.layers.{layer}.``.
_NORM_NAMES: dict[str, tuple[str, str, str]] = {
    "transformer_engine": (
        "self_attention.linear_qkv.layer_norm_weight",
        "mlp.linear_fc1.layer_norm_weight",
        "pre_mlp_layernorm.weight",
    ),
    "local": ("input_layernorm.weight", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.weight"),
}

# Per grouped_gemm: expert fc1 / fc2 names, relative to ``decoder.layers.{layer}.``.
_EXPERT_NAMES: dict[bool, tuple[str, str]] = {
    False: ("mlp.experts.local_experts.{expert}.linear_fc1.weight", "mlp.experts.local_experts.{expert}.linear_fc2.weight"),
    True: ("mlp.experts.linear_fc1.weight{expert}", "mlp.experts.linear_fc2.weight{expert}"),
}

# The megatron-core function that builds each spec (what ``megatron_config()["layer_spec"]`` names).
SPEC_FUNCTIONS: dict[str, str] = {
    "transformer_engine": "get_gpt_layer_with_transformer_engine_spec",
    "local": "get_gpt_layer_local_spec",
}


@dataclass(frozen=True, slots=True)
class MegatronLayout:
    """The megatron-core layer spec the converted names follow.

    :ivar spec: ``"transformer_engine"`` (default) or ``"local"``.
    :ivar grouped_gemm: experts as ``TEGroupedMLP`` (needs the Transformer Engine spec).
    """

    spec: Spec = "transformer_engine"
    grouped_gemm: bool = False

    def __post_init__(self) -> None:
        if self.spec not in _NORM_NAMES:
            raise BridgeError(f"unknown megatron layer spec {self.spec!r}; choose one of: {', '.join(_NORM_NAMES)}")
        if self.grouped_gemm and self.spec != "transformer_engine":
            raise BridgeError(
                "grouped_gemm=True needs spec='transformer_engine': megatron-core's local spec only has the "
                "legacy GroupedMLP, whose experts share one weight1/weight2 tensor; use grouped_gemm=False"
            )

    @property
    def input_norm(self) -> str:
        return _NORM_NAMES[self.spec][0]

    @property
    def pre_mlp_norm(self) -> str:
        return _NORM_NAMES[self.spec][1]

    @property
    def pre_moe_norm(self) -> str:
        return _NORM_NAMES[self.spec][2]

    @property
    def expert_fc1(self) -> str:
        return _EXPERT_NAMES[self.grouped_gemm][0]

    @property
    def expert_fc2(self) -> str:
        return _EXPERT_NAMES[self.grouped_gemm][1]


TRANSFORMER_ENGINE = MegatronLayout()
LOCAL = MegatronLayout(spec="local")
