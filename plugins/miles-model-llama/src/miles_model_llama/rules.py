"""The Llama weight table: HF checkpoint names <-> megatron-core names.

Each function returns rows for one part of the model; ``{layer}`` is filled per decoder layer.
Other Llama-like families reuse the parts they share (``miles-model-qwen3`` takes the embedding,
attention and dense-MLP rows and adds q/k norms and MoE rows).

======================================================  ==========================================
megatron-core                                           HF (``LlamaForCausalLM``)
======================================================  ==========================================
embedding.word_embeddings.weight                        model.embed_tokens.weight
decoder.layers.{i}.<input norm>                         model.layers.{i}.input_layernorm.weight
decoder.layers.{i}.self_attention.linear_qkv.weight     self_attn.{q,k,v}_proj.weight (interleaved)
decoder.layers.{i}.self_attention.linear_proj.weight    self_attn.o_proj.weight
decoder.layers.{i}.<pre-MLP norm>                       post_attention_layernorm.weight
decoder.layers.{i}.mlp.linear_fc1.weight                mlp.{gate,up}_proj.weight (stacked)
decoder.layers.{i}.mlp.linear_fc2.weight                mlp.down_proj.weight
decoder.final_layernorm.weight                          model.norm.weight
output_layer.weight (absent when tied)                  lm_head.weight
======================================================  ==========================================

The norms' megatron names depend on the layer spec (:mod:`miles_model_llama.layout`).
"""

from __future__ import annotations

from miles_model_llama.layout import MegatronLayout
from miles_model_llama.mapping import GATE_UP, AttentionDims, InterleaveQKV, Rule

M = "decoder.layers.{layer}."  # megatron-core layer prefix
H = "model.layers.{layer}."  # HF layer prefix


def model_rules(*, tied_embeddings: bool) -> list[Rule]:
    """Embedding, final norm and (untied) output layer."""
    rows = [
        Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if not tied_embeddings:
        rows.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return rows


def tied_aliases(*, tied_embeddings: bool) -> dict[str, str]:
    """A tied model's live ``state_dict()`` also lists the embedding as ``lm_head.weight``."""
    return {"lm_head.weight": "model.embed_tokens.weight"} if tied_embeddings else {}


def attention_rules(layout: MegatronLayout, dims: AttentionDims, *, bias: bool = False) -> list[Rule]:
    """Attention norm, fused QKV and output projection of one layer."""
    qkv = InterleaveQKV(dims)
    q, k, v, o = (H + f"self_attn.{p}_proj" for p in "qkvo")
    rows = [
        Rule(M + layout.input_norm, (H + "input_layernorm.weight",)),
        Rule(M + "self_attention.linear_qkv.weight", (q + ".weight", k + ".weight", v + ".weight"), qkv),
        Rule(M + "self_attention.linear_proj.weight", (o + ".weight",)),
    ]
    if bias:
        rows += [
            Rule(M + "self_attention.linear_qkv.bias", (q + ".bias", k + ".bias", v + ".bias"), qkv),
            Rule(M + "self_attention.linear_proj.bias", (o + ".bias",)),
        ]
    return rows


def dense_mlp_rules(layout: MegatronLayout, *, bias: bool = False) -> list[Rule]:
    """Pre-MLP norm and the gated MLP of one dense layer."""
    gate, up, down = (H + f"mlp.{p}_proj" for p in ("gate", "up", "down"))
    rows = [
        Rule(M + layout.pre_mlp_norm, (H + "post_attention_layernorm.weight",)),
        Rule(M + "mlp.linear_fc1.weight", (gate + ".weight", up + ".weight"), GATE_UP),
        Rule(M + "mlp.linear_fc2.weight", (down + ".weight",)),
    ]
    if bias:
        rows += [
            Rule(M + "mlp.linear_fc1.bias", (gate + ".bias", up + ".bias"), GATE_UP),
            Rule(M + "mlp.linear_fc2.bias", (down + ".bias",)),
        ]
    return rows
