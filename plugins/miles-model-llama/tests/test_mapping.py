"""The mapping primitives: megatron-core's fused layouts, and errors that name every bad tensor."""

from __future__ import annotations

import pytest
import torch
from miles_model_llama import LOCAL, BridgeError, LlamaBridge, MegatronLayout
from miles_model_llama.mapping import GATE_UP, AttentionDims, InterleaveQKV

DIMS = AttentionDims(num_heads=4, num_groups=2, head_dim=3)
HIDDEN = 5


def _labelled(first_label: int, heads: int) -> torch.Tensor:
    """``[heads * head_dim, HIDDEN]`` whose rows of head h all hold ``first_label + h``."""
    labels = torch.arange(first_label, first_label + heads, dtype=torch.float32)
    return labels.repeat_interleave(DIMS.head_dim)[:, None].expand(-1, HIDDEN).clone()


def test_fused_qkv_follows_megatron_per_group_order() -> None:
    q, k, v = _labelled(100, 4), _labelled(200, 2), _labelled(300, 2)
    fused = InterleaveQKV(DIMS).join([q, k, v])
    # megatron-core's SelfAttention reads the rows as "q1 q2 k1 v1 | q3 q4 k2 v2": per group, its
    # query heads, then its key head, then its value head.
    per_row = [100, 101, 200, 300, 102, 103, 201, 301]
    assert fused[:, 0].tolist() == [float(x) for x in per_row for _ in range(DIMS.head_dim)]
    assert fused.shape == ((4 + 2 * 2) * 3, HIDDEN)


def test_fused_qkv_split_inverts_join_for_weights_and_biases() -> None:
    transform = InterleaveQKV(DIMS)
    weights = [torch.randn(12, HIDDEN), torch.randn(6, HIDDEN), torch.randn(6, HIDDEN)]
    biases = [torch.randn(12), torch.randn(6), torch.randn(6)]
    for parts in (weights, biases):
        back = transform.split(transform.join(parts), 3)
        assert all(torch.equal(a, b) for a, b in zip(parts, back, strict=True))


def test_fc1_is_gate_then_up_as_megatron_glu_chunks_it() -> None:
    gate, up, x = torch.randn(6, HIDDEN), torch.randn(6, HIDDEN), torch.randn(2, HIDDEN)
    fc1 = GATE_UP.join([gate, up])
    first, second = torch.chunk(x @ fc1.T, 2, dim=-1)  # megatron-core's MLP.glu
    assert torch.allclose(first, x @ gate.T) and torch.allclose(second, x @ up.T)


def test_heads_not_divisible_by_groups_is_a_clear_error() -> None:
    with pytest.raises(BridgeError, match="num_attention_heads \\(6\\) must be a multiple of num_key_value_heads \\(4\\)"):
        AttentionDims(num_heads=6, num_groups=4, head_dim=8)


def test_missing_and_unexpected_hf_tensors_are_all_named(tiny_untied) -> None:
    from miles_contracts.testing.bridge import load_hf_checkpoint

    state, config = load_hf_checkpoint(tiny_untied)
    del state["model.layers.1.self_attn.k_proj.weight"]
    del state["lm_head.weight"]
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    with pytest.raises(BridgeError) as info:
        LlamaBridge().to_megatron(state, config)
    message = str(info.value)
    assert "missing: lm_head.weight, model.layers.1.self_attn.k_proj.weight" in message
    assert "unexpected (no rule reads them): model.layers.0.self_attn.rotary_emb.inv_freq" in message


def test_tied_lm_head_is_accepted_only_when_it_equals_the_embedding(tiny_dense) -> None:
    from miles_contracts.testing.bridge import load_hf_checkpoint

    state, config = load_hf_checkpoint(tiny_dense)
    embedding = state["model.embed_tokens.weight"]
    converted = LlamaBridge().to_megatron({**state, "lm_head.weight": embedding}, config)
    assert "output_layer.weight" not in converted
    with pytest.raises(BridgeError, match="lm_head.weight differs from model.embed_tokens.weight"):
        LlamaBridge().to_megatron({**state, "lm_head.weight": embedding + 1}, config)


def test_megatron_side_names_are_checked_and_extra_state_ignored(tiny_dense) -> None:
    from miles_contracts.testing.bridge import load_hf_checkpoint

    state, config = load_hf_checkpoint(tiny_dense)
    mcore = LlamaBridge(LOCAL).to_megatron(state, config)
    with_extra = {**mcore, "decoder.layers.0.self_attention.linear_qkv._extra_state": None}
    assert LlamaBridge(LOCAL).to_hf(with_extra, config).keys() == state.keys()
    with pytest.raises(BridgeError) as info:
        LlamaBridge().to_hf(mcore, config)  # local-spec names given to a Transformer Engine layout bridge
    missing, unexpected = str(info.value).splitlines()[1:3]
    assert missing.startswith("  missing:") and "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in missing
    assert unexpected.startswith("  unexpected") and "decoder.layers.0.input_layernorm.weight" in unexpected


def test_unsupported_config_lists_every_problem() -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 100, "hidden_act": "relu2", "attention_bias": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},
    }
    with pytest.raises(BridgeError) as info:
        LlamaBridge().megatron_config(config)
    message = str(info.value)
    assert "hidden_act 'relu2'" in message and "attention_bias=True with mlp_bias=False" in message
    assert "rope_type 'yarn'" in message


def test_grouped_gemm_needs_the_transformer_engine_spec() -> None:
    with pytest.raises(BridgeError, match="grouped_gemm=True needs spec='transformer_engine'"):
        MegatronLayout(spec="local", grouped_gemm=True)


def test_partial_conversion_gives_exactly_the_tensors_of_a_subset(tiny_dense) -> None:
    """A train backend streams weights out one decoder layer at a time (``partial=True``)."""
    from miles_contracts.testing.bridge import load_hf_checkpoint

    state, config = load_hf_checkpoint(tiny_dense)
    mcore = LlamaBridge().to_megatron(state, config)
    layer = {n: t for n, t in mcore.items() if n.startswith("decoder.layers.1.")}
    out = LlamaBridge().to_hf(layer, config, partial=True)
    assert out.keys() == {n for n in state if n.startswith("model.layers.1.")}
    assert all(torch.equal(out[n], state[n]) for n in out)
    with pytest.raises(BridgeError, match="missing"):
        LlamaBridge().to_hf(layer, config)  # without partial, a subset is an error
    with pytest.raises(BridgeError, match="unexpected"):
        LlamaBridge().to_hf({**layer, "decoder.layers.1.bogus.weight": torch.zeros(1)}, config, partial=True)
