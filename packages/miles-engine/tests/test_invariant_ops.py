"""Each batch-invariant op of ``miles_engine.invariant`` on its own (fp32 CPU), then the whole
tiny model: a row gives the same bits alone, in a batch of 3 and of 64, prefilled or decoded,
packed or padded. Equality, never a tolerance."""

from __future__ import annotations

import pytest
import torch
from miles_engine import invariant


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_linear_gives_a_row_the_same_bits_in_batches_of_1_3_and_64():
    weight, bias = torch.randn(96, 64), torch.randn(96)
    rows = torch.randn(64, 64)
    alone = invariant.linear(rows[:1], weight, bias)
    assert torch.equal(invariant.linear(rows[:3], weight, bias)[:1], alone)
    assert torch.equal(invariant.linear(rows, weight, bias)[:1], alone)
    assert torch.equal(invariant.linear(rows[None, 5:6], weight, bias)[0], invariant.linear(rows, weight, bias)[5:6])
    assert torch.allclose(invariant.linear(rows, weight, bias), torch.nn.functional.linear(rows, weight, bias),
                          atol=1e-5)


def test_linear_backward_is_the_ordinary_gradient():
    weight = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(5, 16, requires_grad=True)
    invariant.linear(x, weight).square().sum().backward()
    assert weight.grad is not None and x.grad is not None
    w2, x2 = weight.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    torch.nn.functional.linear(x2, w2).square().sum().backward()
    assert torch.allclose(weight.grad, w2.grad, atol=1e-5) and torch.allclose(x.grad, x2.grad, atol=1e-5)


def test_token_logprobs_of_a_row_do_not_depend_on_the_other_rows():
    logits = torch.randn(64, 49152) * 4
    alone = invariant.token_logprobs(logits[7:8])
    assert torch.equal(invariant.token_logprobs(logits[5:8])[2:], alone)
    assert torch.equal(invariant.token_logprobs(logits)[7:8], alone)


def test_rms_norm_and_rotary_of_transformers_are_row_invariant():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    norm = LlamaRMSNorm(576)
    x = torch.randn(64, 576)
    assert torch.equal(norm(x)[9:10], norm(x[9:10]))
    assert torch.equal(norm(x[7:10])[2:], norm(x[9:10]))
    q = torch.randn(1, 4, 64, 16)
    cos, sin = torch.randn(1, 64, 16), torch.randn(1, 64, 16)
    full, _ = apply_rotary_pos_emb(q, q, cos, sin)
    one, _ = apply_rotary_pos_emb(q[:, :, 9:10], q[:, :, 9:10], cos[:, 9:10], sin[:, 9:10])
    assert torch.equal(full[:, :, 9:10], one)


def _attend(q, k, v, mask):
    return invariant.attention(torch.nn.Module(), q, k, v, mask)[0]


def test_attention_prefill_decode_and_packed_rows_agree():
    heads, kv_heads, dim, length = 4, 2, 16, 11
    q, k, v = (torch.randn(1, h, length, dim) for h in (heads, kv_heads, kv_heads))
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    prefill = _attend(q, k, v, causal)  # [1, T, H, D]
    assert torch.equal(_attend(q, k, v, None), prefill)  # None means causal
    # decode: query 7 alone over keys 0..7, inside a batch of 3 rows with longer contexts
    others = torch.randn(3, kv_heads, 20, dim)
    k3, v3 = others.clone(), others.clone()
    k3[1, :, :8], v3[1, :, :8] = k[0, :, :8], v[0, :, :8]
    q3 = torch.randn(3, heads, 1, dim)
    q3[1] = q[0, :, 7:8]
    decode_mask = (torch.arange(20)[None, :] <= torch.tensor([15, 7, 19])[:, None])[:, None, None]
    assert torch.equal(_attend(q3, k3, v3, decode_mask)[1, 0], prefill[0, 7])
    # packed: another sequence of 5 tokens first, then ours, block-diagonal causal mask
    pq, pk, pv = (torch.cat([torch.randn(1, t.shape[1], 5, dim), t], dim=2) for t in (q, k, v))
    ids = torch.tensor([0] * 5 + [1] * length)
    pos = torch.arange(5 + length)
    packed_mask = ((ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None]))[None, None]
    assert torch.equal(_attend(pq, pk, pv, packed_mask)[0, 5:], prefill[0])


def _model(path, device="cpu"):
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=invariant.register())
    model.to(device)
    invariant.install_linears(model)
    return model.eval()


# on CUDA (bf16) the same checks run the Triton kernels (invariant_triton.py)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_the_tiny_model_is_batch_invariant_end_to_end(dense_path, device):
    model = _model(dense_path, device)
    ids = torch.randint(3, 1000, (3, 13)).to(device)
    lengths = [13, 6, 9]
    with torch.no_grad():
        alone = [model(input_ids=ids[r : r + 1, :n]).logits[0] for r, n in enumerate(lengths)]
        # padded batch (right padding, a [b, t] mask), as the trainer's padded layout runs it
        pad = (torch.arange(13)[None, :] < torch.tensor(lengths)[:, None]).long().to(device)
        padded = model(input_ids=ids, attention_mask=pad).logits
        # packed: the three rows one after the other, positions restarting at 0
        packed_ids = torch.cat([ids[r, :n] for r, n in enumerate(lengths)])[None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
        packed = model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits[0]
    starts = [0, 13, 19]
    for r, n in enumerate(lengths):
        assert torch.equal(padded[r, :n], alone[r])
        assert torch.equal(packed[starts[r] : starts[r] + n], alone[r])


@pytest.mark.parametrize("device", DEVICES)
def test_a_prefill_continued_over_cached_keys_equals_one_prefill(dense_path, device):
    # what a second turn does: its tokens attend to the first turn's keys from the cache
    model = _model(dense_path, device)
    ids = torch.randint(3, 1000, (1, 12)).to(device)
    with torch.no_grad():
        whole = model(input_ids=ids).logits[0]
        first = model(input_ids=ids[:, :7], use_cache=True)
        rest = model(input_ids=ids[:, 7:], past_key_values=first.past_key_values, use_cache=True).logits[0]
        step = model(input_ids=ids[:, 7:8], past_key_values=model(input_ids=ids[:, :7], use_cache=True).past_key_values,
                     use_cache=True).logits[0]
    assert torch.equal(rest, whole[7:])
    assert torch.equal(step, whole[7:8])  # a one-token decode over the cache, too
