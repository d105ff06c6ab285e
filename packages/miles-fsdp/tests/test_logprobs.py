"""The chunked log-prob/entropy head matches a plain full-logits computation, values and gradients."""

from __future__ import annotations

import shutil

import pytest
import torch
from miles_fsdp.logprobs import token_logprobs


def _plain(hidden, weight, bias, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature  # [K, V]
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None]).squeeze(1), entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients_match_full_logits(temperature: float, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    k, h, v = 37, 16, 101
    hidden = torch.randn(k, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, generator=gen, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, v, (k,), generator=gen)
    w_lp = torch.randn(k, generator=gen, dtype=torch.float64)
    w_ent = torch.randn(k, generator=gen, dtype=torch.float64)

    lp, ent = token_logprobs(hidden, weight, bias, targets, temperature=temperature, chunk=8, with_entropy=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    got = [hidden.grad.clone(), weight.grad.clone()] + ([bias.grad.clone()] if with_bias else [])
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None

    ref_lp, ref_ent = _plain(hidden, weight, bias, targets, temperature)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    want = [hidden.grad, weight.grad] + ([bias.grad] if with_bias else [])

    torch.testing.assert_close(lp, ref_lp.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.float(), rtol=0, atol=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_without_entropy_gradient_is_that_of_logprobs_only() -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(20, 8, generator=gen, requires_grad=True)
    weight = torch.randn(50, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (20,), generator=gen)
    lp, ent = token_logprobs(hidden, weight, None, targets, chunk=3)
    assert ent is None
    lp.sum().backward()
    ref_lp, _ = _plain(hidden.detach().requires_grad_(), weight, None, targets, 1.0)
    grad_w = weight.grad.clone()
    weight.grad = None
    ref_lp.sum().backward()
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad_w, weight.grad, rtol=1e-5, atol=1e-5)


def test_bf16_weights_get_bf16_gradients_close_to_fp32() -> None:
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(16, 8, generator=gen)
    weight = torch.randn(40, 8, generator=gen)
    targets = torch.randint(0, 40, (16,), generator=gen)
    h16 = hidden.bfloat16().requires_grad_()
    w16 = weight.bfloat16().requires_grad_()
    lp16, _ = token_logprobs(h16, w16, None, targets, chunk=5)
    lp16.sum().backward()
    assert lp16.dtype == torch.float32 and w16.grad.dtype == torch.bfloat16
    ref, _ = _plain(h16.detach().float(), w16.detach().float(), None, targets, 1.0)
    torch.testing.assert_close(lp16, ref, rtol=0, atol=0.1)


def test_rejects_non_positive_temperature() -> None:
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2), torch.zeros(3, 2), None, torch.zeros(1, dtype=torch.long), temperature=0.0)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile's CPU backend needs a C++ compiler")
def test_compiled_head_matches_eager() -> None:
    """``compiled=True`` runs the same per-chunk maths through torch.compile (inductor's CPU backend here)."""
    gen = torch.Generator().manual_seed(3)
    k, h, v = 29, 16, 97
    hidden = torch.randn(k, h, generator=gen)
    weight = torch.randn(v, h, generator=gen)
    targets = torch.randint(0, v, (k,), generator=gen)
    w_ent = torch.randn(k, generator=gen)
    results = []
    for compiled in (False, True):
        hd, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = token_logprobs(hd, wt, None, targets, temperature=0.8, chunk=8, with_entropy=True, compiled=compiled)
        (lp.sum() + (ent * w_ent).sum()).backward()
        results.append((lp.detach(), ent.detach(), hd.grad, wt.grad))
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    # the compiled run really went through torch.compile'd kernels, forward and backward
    from miles_fsdp.logprobs import _compiled, chunk_forward, chunk_logit_grad

    assert _compiled.cache_info().currsize == 2  # before this line, only the compiled run could have filled it
    assert _compiled(chunk_forward) is not chunk_forward and _compiled(chunk_logit_grad) is not chunk_logit_grad
