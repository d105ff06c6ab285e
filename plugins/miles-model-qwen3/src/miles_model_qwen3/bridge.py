"""`Qwen3Bridge`: HF Qwen3 (dense) and Qwen3-MoE <-> megatron-core ``GPTModel``.

Qwen3 is a Llama with per-head RMS norms on queries and keys, so the table is Llama's
(:mod:`miles_model_llama.rules`) plus:

=================================================================  ===========================================
megatron-core (``decoder.layers.{i}.``)                            HF (``model.layers.{i}.``)
=================================================================  ===========================================
self_attention.q_layernorm.weight / k_layernorm.weight             self_attn.q_norm.weight / k_norm.weight
pre_mlp_layernorm.weight (MoE layers, every layer spec)            post_attention_layernorm.weight
mlp.router.weight                                                  mlp.gate.weight
mlp.experts.local_experts.{e}.linear_fc1.weight (gate; up)         mlp.experts.{e}.gate_proj / up_proj.weight
mlp.experts.local_experts.{e}.linear_fc2.weight                    mlp.experts.{e}.down_proj.weight
=================================================================  ===========================================

The MoE layer map (:meth:`Qwen3Bridge.moe_layers`, for routing replay) names each layer's router
``model.layers.{i}.mlp.gate`` and its weighting (softmax, top-k, renormalised by ``norm_topk_prob``).

Experts follow megatron-core's default ``SequentialMLP`` names; ``MegatronLayout(grouped_gemm=True)``
switches to Transformer Engine's ``TEGroupedMLP`` names (``mlp.experts.linear_fc1.weight{e}``),
same shapes. transformers 5 keeps a live model's experts packed (``mlp.experts.gate_up_proj``
``[E, 2I, hidden]`` and ``mlp.experts.down_proj`` ``[E, hidden, I]``); ``to_megatron`` accepts that
form too, ``to_hf`` writes the per-expert checkpoint form (what ``save_pretrained`` writes and
engines load).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from miles_contracts import MoeLayerMap
from miles_model_llama import (
    TRANSFORMER_ENGINE,
    BridgeError,
    MegatronLayout,
    Rule,
    WeightMap,
    architecture_matches,
)
from miles_model_llama.mapping import GATE_UP, Packed
from miles_model_llama.rules import H, M, attention_rules, dense_mlp_rules, model_rules, tied_aliases
from miles_model_llama.shape import DecoderShape, layer_spec

if TYPE_CHECKING:
    import torch


def qk_norm_rules() -> list[Rule]:
    return [
        Rule(M + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",)),
        Rule(M + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",)),
    ]


def moe_rules(layout: MegatronLayout) -> list[Rule]:
    """Norm and router of one MoE layer (experts: :func:`expert_rules`)."""
    return [
        Rule(M + layout.pre_moe_norm, (H + "post_attention_layernorm.weight",)),
        Rule(M + "mlp.router.weight", (H + "mlp.gate.weight",)),
    ]


def expert_rules(layout: MegatronLayout) -> list[Rule]:
    """One expert of one MoE layer (``{expert}`` filled per expert)."""
    e = H + "mlp.experts.{expert}."
    return [
        Rule(M + layout.expert_fc1, (e + "gate_proj.weight", e + "up_proj.weight"), GATE_UP),
        Rule(M + layout.expert_fc2, (e + "down_proj.weight",)),
    ]


def packed_experts() -> list[Packed]:
    """transformers 5's in-memory expert tensors of one layer."""
    e = H + "mlp.experts.{expert}."
    return [
        Packed(H + "mlp.experts.gate_up_proj", (e + "gate_proj.weight", e + "up_proj.weight"), GATE_UP),
        Packed(H + "mlp.experts.down_proj", (e + "down_proj.weight",)),
    ]


@dataclass(frozen=True, slots=True)
class MoeShape:
    """The MoE settings of a Qwen3-MoE ``config.json``."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    normalize_top_k: bool
    aux_loss_coef: float

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> MoeShape | None:
        """None for a dense model. Raises :class:`BridgeError` for layouts megatron cannot build
        from one layer spec (dense layers mixed into an MoE model)."""
        experts = int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)
        if not experts:
            return None
        dense_layers = hf_config.get("mlp_only_layers") or []
        step = int(hf_config.get("decoder_sparse_step", 1))
        if dense_layers or step != 1:
            raise BridgeError(
                f"Qwen3-MoE with dense layers (mlp_only_layers={dense_layers}, decoder_sparse_step={step}) is not "
                f"supported yet: this bridge maps models whose every layer is MoE (all released Qwen3-MoE models)"
            )
        return cls(
            num_experts=experts,
            top_k=int(hf_config["num_experts_per_tok"]),
            ffn_hidden_size=int(hf_config["moe_intermediate_size"]),
            normalize_top_k=bool(hf_config.get("norm_topk_prob", True)),
            aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.0)),
        )

    def transformer_config(self, layout: MegatronLayout) -> dict[str, Any]:
        return {
            "num_moe_experts": self.num_experts,
            "moe_router_topk": self.top_k,
            "moe_ffn_hidden_size": self.ffn_hidden_size,
            "moe_router_score_function": "softmax",
            # HF: softmax over all experts, top-k, renormalise when norm_topk_prob. megatron-core
            # without pre-softmax takes top-k logits then softmax over them: the same numbers.
            "moe_router_pre_softmax": not self.normalize_top_k,
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": self.aux_loss_coef,
            "moe_grouped_gemm": layout.grouped_gemm,
        }


@dataclass(frozen=True, slots=True)
class Qwen3Bridge:
    """HF ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` <-> megatron-core ``GPTModel``.

    :ivar layout: megatron-core layer spec the names follow (see :mod:`miles_model_llama.layout`).
    """

    layout: MegatronLayout = TRANSFORMER_ENGINE

    name: ClassVar[str] = "qwen3"
    chat_family: ClassVar[str | None] = "qwen3"
    architectures: ClassVar[frozenset[str]] = frozenset({"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})
    model_types: ClassVar[frozenset[str]] = frozenset({"qwen3", "qwen3_moe"})

    @classmethod
    def claims(cls, hf_config: Mapping[str, Any]) -> bool:
        return architecture_matches(hf_config, cls.architectures, cls.model_types)

    def weight_map(self, hf_config: Mapping[str, Any]) -> WeightMap:
        shape, moe = DecoderShape.from_hf(hf_config), MoeShape.from_hf(hf_config)
        layer = [*attention_rules(self.layout, shape.attention, bias=shape.linear_bias), *qk_norm_rules()]
        layer += moe_rules(self.layout) if moe else dense_mlp_rules(self.layout, bias=shape.linear_bias)
        experts = expert_rules(self.layout) if moe else []
        rules = model_rules(tied_embeddings=shape.tied_embeddings)
        for i in range(shape.num_layers):
            rules += [row.at(layer=i) for row in layer]
            rules += [row.at(layer=i, expert=e) for e in range(moe.num_experts if moe else 0) for row in experts]
        packed = [p.at(layer=i) for i in range(shape.num_layers) for p in packed_experts()] if moe else []
        return WeightMap(rules, aliases=tied_aliases(tied_embeddings=shape.tied_embeddings), packed=packed)

    def to_megatron(
        self, hf_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any], *, partial: bool = False,
    ) -> dict[str, torch.Tensor]:
        return self.weight_map(hf_config).to_megatron(hf_state, partial=partial)

    def to_hf(
        self, mcore_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any], *, partial: bool = False,
    ) -> dict[str, torch.Tensor]:
        return self.weight_map(hf_config).to_hf(mcore_state, partial=partial)

    def moe_layers(self, hf_config: Mapping[str, Any]) -> MoeLayerMap | None:
        """The MoE layer map (routing replay): every layer of a Qwen3-MoE model routes through
        ``mlp.gate`` (``Qwen3MoeTopKRouter``): softmax over all experts in float32, top-k, then the
        chosen scores renormalised when ``norm_topk_prob``. None for dense Qwen3."""
        moe = MoeShape.from_hf(hf_config)
        if moe is None:
            return None
        layers = DecoderShape.from_hf(hf_config).num_layers
        return MoeLayerMap(
            num_layers=layers, moe_layers=tuple(range(layers)), num_experts=moe.num_experts, top_k=moe.top_k,
            hf_router="model.layers.{layer}.mlp.gate", scoring="softmax", normalize_top_k=moe.normalize_top_k,
        )

    def megatron_config(self, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        """``{"transformer_config", "gpt_model", "layer_spec"}`` as for :class:`miles_model_llama.LlamaBridge`."""
        shape, moe = DecoderShape.from_hf(hf_config), MoeShape.from_hf(hf_config)
        transformer = {**shape.transformer_config(), "qk_layernorm": True}
        if moe:
            transformer.update(moe.transformer_config(self.layout))
        return {
            "transformer_config": transformer,
            "gpt_model": shape.gpt_model(),
            "layer_spec": layer_spec(self.layout, num_experts=moe.num_experts if moe else None, qk_layernorm=True),
        }
