"""The batch-invariant MoE ops of ``miles_engine.invariant_moe`` (fp32 CPU): the router and the
experts of the tiny Qwen3-MoE give a token the same bits alone, in a batch of 3 and of 64; the
top-k outputs are summed in rank order; then the whole tiny MoE model, padded, packed, prefilled
and decoded, with the routing each router reports. Equality, never a tolerance (except against
transformers' own batched forward, which the invariant one must match to rounding)."""

from __future__ import annotations

import pytest
import torch
from miles_engine import invariant, invariant_moe
from miles_engine.routing import RoutingCapture


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _model(path, *, install: bool = True, device: str = "cpu"):
    """fp32 on the CPU; bf16 on CUDA (the Triton kernels)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=invariant.register())
    model.to(device)
    if install:
        invariant.install_linears(model)
    return model.eval()


@pytest.fixture(scope="module")
def moe_model(moe_path):
    return _model(moe_path)


def _layer(model):
    return model.model.layers[0].mlp  # Qwen3MoeSparseMoeBlock: .gate (router), .experts


def test_the_router_gives_a_token_the_same_logits_experts_and_weights_in_batches_of_1_3_and_64(moe_path, moe_model):
    router = _layer(moe_model).gate
    hidden = torch.randn(64, 64)
    with torch.no_grad():
        alone = router(hidden[5:6])
        for batch in (hidden[3:6], hidden):
            together = router(batch)
            row = 2 if batch.shape[0] == 3 else 5
            for a, b in zip(alone, together, strict=True):
                assert torch.equal(b[row : row + 1], a)
        # transformers' own router (batched F.linear) picks the same experts, weights to rounding
        reference = _layer(_model(moe_path, install=False)).gate(hidden)
        ours = router(hidden)
    assert torch.equal(ours[2], reference[2])
    assert torch.allclose(ours[1], reference[1], atol=1e-6) and torch.allclose(ours[0], reference[0], atol=1e-6)


def test_experts_give_a_token_the_same_bits_whatever_the_other_tokens_routed_to(moe_path, moe_model):
    experts = _layer(moe_model).experts
    hidden = torch.randn(64, 64)
    index = torch.randint(0, 4, (64, 2))
    index[:, 1] = (index[:, 0] + 1 + torch.randint(0, 3, (64,))) % 4  # two different experts per token
    weights = torch.rand(64, 2)
    with torch.no_grad():
        alone = experts(hidden[9:10], index[9:10], weights[9:10])
        assert torch.equal(experts(hidden[7:10], index[7:10], weights[7:10])[2:], alone)
        assert torch.equal(experts(hidden, index, weights)[9:10], alone)
        reference = _layer(_model(moe_path, install=False)).experts(hidden, index, weights)
        assert torch.allclose(experts(hidden, index, weights), reference, atol=1e-6)
        assert experts(hidden[:0], index[:0], weights[:0]).shape == (0, 64)


def test_the_top_k_outputs_are_summed_in_rank_order(moe_model):
    experts = _layer(moe_model).experts
    x = torch.randn(1, 64)
    index, weights = torch.tensor([[3, 1]]), torch.tensor([[0.7, 0.3]])

    def one(expert: int, weight: torch.Tensor) -> torch.Tensor:
        h = experts._apply_gate(invariant.linear(x, experts.gate_up_proj[expert]))
        return invariant.linear(h, experts.down_proj[expert]) * weight

    with torch.no_grad():
        assert torch.equal(experts(x, index, weights), one(3, weights[:, :1]) + one(1, weights[:, 1:]))


def test_gradients_are_transformers_own(moe_path, moe_model):
    ours, theirs = _layer(_model(moe_path)), _layer(_model(moe_path, install=False))
    hidden = torch.randn(1, 12, 64)
    for block in (ours, theirs):
        block.train()
        block(hidden).square().sum().backward()
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        assert torch.allclose(a.grad, b.grad, atol=1e-5), name


def test_the_tiny_moe_model_is_batch_invariant_and_routes_alike_end_to_end(moe_model):
    _check_alone_padded_packed(moe_model, "cpu")


@pytest.mark.gpu
def test_on_cuda_in_bf16_the_tiny_moe_model_is_batch_invariant_and_routes_alike(moe_path):
    """The same ops on the Triton kernels (``invariant_triton``: the experts' and the router's
    linears; softmax and top-k over a token's own expert scores)."""
    _check_alone_padded_packed(_model(moe_path, device="cuda"), "cuda")


def _check_alone_padded_packed(model, device):
    capture = RoutingCapture(model)
    ids = torch.randint(3, 1000, (3, 13)).to(device)
    lengths = [13, 6, 9]
    try:
        with torch.no_grad():
            alone, routed = [], []
            for r, n in enumerate(lengths):
                alone.append(model(input_ids=ids[r : r + 1, :n]).logits[0])
                routed.append(capture.take())
            pad = (torch.arange(13)[None, :] < torch.tensor(lengths)[:, None]).long().to(device)
            padded = model(input_ids=ids, attention_mask=pad).logits
            padded_routes = capture.take().view(3, 13, 2, 2)
            packed_ids = torch.cat([ids[r, :n] for r, n in enumerate(lengths)])[None]
            positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
            packed = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits[0]
            packed_routes = capture.take()
    finally:
        capture.close()
    starts = [0, 13, 19]
    for r, n in enumerate(lengths):
        assert torch.equal(padded[r, :n], alone[r])
        assert torch.equal(packed[starts[r] : starts[r] + n], alone[r])
        # routing of every (token, MoE layer) pair, in the router's own rank order
        assert torch.equal(padded_routes[r, :n], routed[r])
        assert torch.equal(packed_routes[starts[r] : starts[r] + n], routed[r])


def test_a_moe_decode_over_the_cache_equals_the_prefill(moe_model):
    model = moe_model
    ids = torch.randint(3, 1000, (1, 12))
    with torch.no_grad():
        whole = model(input_ids=ids).logits[0]
        first = model(input_ids=ids[:, :7], use_cache=True)
        rest = model(input_ids=ids[:, 7:], past_key_values=first.past_key_values, use_cache=True).logits[0]
        cache = model(input_ids=ids[:, :7], use_cache=True).past_key_values
        step = model(input_ids=ids[:, 7:8], past_key_values=cache, use_cache=True).logits[0]
    assert torch.equal(rest, whole[7:])
    assert torch.equal(step, whole[7:8])


def test_a_moe_model_it_cannot_route_is_refused_by_name():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(NotImplementedError, match=r"MixtralForCausalLM, 4 experts .* router classes \['MixtralTopKRouter'\]"):
        invariant.install_linears(MixtralForCausalLM(config))
    assert "Qwen3MoeTopKRouter" in invariant_moe.ROUTERS
