"""`LlamaBridge`: the :class:`miles_contracts.ModelBridge` of Llama-architecture models."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from miles_model_llama.layout import TRANSFORMER_ENGINE, MegatronLayout
from miles_model_llama.mapping import WeightMap
from miles_model_llama.rules import attention_rules, dense_mlp_rules, model_rules, tied_aliases
from miles_model_llama.shape import DecoderShape, layer_spec

if TYPE_CHECKING:
    import torch


def architecture_matches(hf_config: Mapping[str, Any], architectures: frozenset[str], model_types: frozenset[str]) -> bool:
    """Whether ``config.json`` names one of ``architectures`` (or, lacking ``architectures``, one
    of ``model_types``). ``architectures`` wins because it says which head the weights have: a
    ``LlamaForSequenceClassification`` is ``model_type: llama`` but has no ``lm_head``."""
    named = hf_config.get("architectures")
    if named:
        return any(a in architectures for a in named)
    return hf_config.get("model_type") in model_types


@dataclass(frozen=True, slots=True)
class LlamaBridge:
    """HF ``LlamaForCausalLM`` <-> megatron-core ``GPTModel``.

    :ivar layout: which megatron-core layer spec the megatron names follow (default: the
        Transformer Engine spec; ``miles_model_llama.LOCAL`` for the local spec).
    """

    layout: MegatronLayout = TRANSFORMER_ENGINE

    name: ClassVar[str] = "llama"
    chat_family: ClassVar[str | None] = "chatml"  # SmolLM2-Instruct's template; see miles_model_llama.chat
    architectures: ClassVar[frozenset[str]] = frozenset({"LlamaForCausalLM"})
    model_types: ClassVar[frozenset[str]] = frozenset({"llama"})

    @classmethod
    def claims(cls, hf_config: Mapping[str, Any]) -> bool:
        return architecture_matches(hf_config, cls.architectures, cls.model_types)

    def weight_map(self, hf_config: Mapping[str, Any]) -> WeightMap:
        """Every row of this model, layers expanded."""
        shape = DecoderShape.from_hf(hf_config)
        layer = [
            *attention_rules(self.layout, shape.attention, bias=shape.linear_bias),
            *dense_mlp_rules(self.layout, bias=shape.linear_bias),
        ]
        rules = [*model_rules(tied_embeddings=shape.tied_embeddings)]
        rules += [row.at(layer=i) for i in range(shape.num_layers) for row in layer]
        return WeightMap(rules, aliases=tied_aliases(tied_embeddings=shape.tied_embeddings))

    def to_megatron(
        self, hf_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any], *, partial: bool = False,
    ) -> dict[str, torch.Tensor]:
        return self.weight_map(hf_config).to_megatron(hf_state, partial=partial)

    def to_hf(
        self, mcore_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any], *, partial: bool = False,
    ) -> dict[str, torch.Tensor]:
        return self.weight_map(hf_config).to_hf(mcore_state, partial=partial)

    def moe_layers(self, hf_config: Mapping[str, Any]) -> None:
        """Llama is dense: no MoE layer map."""
        return None

    def megatron_config(self, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        """``{"transformer_config": ..., "gpt_model": ..., "layer_spec": ...}``: kwargs of
        ``TransformerConfig``, of ``GPTModel`` (besides config and spec), and the layer-spec
        function with its kwargs."""
        shape = DecoderShape.from_hf(hf_config)
        return {
            "transformer_config": shape.transformer_config(),
            "gpt_model": shape.gpt_model(),
            "layer_spec": layer_spec(self.layout),
        }
