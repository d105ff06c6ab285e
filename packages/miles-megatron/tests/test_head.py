"""The vocabulary-parallel log-prob head (one rank here; tests/test_multirank.py runs it at TP=2)
matches full logits in values and gradients, eager and through torch.compile."""

from __future__ import annotations

import shutil

import pytest
import torch
from miles_megatron.head import VocabParallelLogprobs


def _reference(hidden, weight, targets, temperature):
    logp = torch.log_softmax(torch.nn.functional.linear(hidden, weight).float() / temperature, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def _run(hidden, weight, targets, *, temperature, compiled, with_entropy=True, vocab_start=0):
    hd, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = VocabParallelLogprobs.apply(hd, wt, targets, vocab_start, None, temperature, 8, with_entropy, compiled)
    gen = torch.Generator().manual_seed(7)
    loss = (lp * torch.randn(lp.shape, generator=gen, dtype=lp.dtype)).sum()
    if with_entropy:
        loss = loss + (ent * torch.randn(ent.shape, generator=gen, dtype=ent.dtype)).sum()
    loss.backward()
    return lp.detach(), ent.detach(), hd.grad, wt.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_values_and_gradients_match_full_logits(temperature: float, with_entropy: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    k, h, v = 37, 16, 101
    hidden = torch.randn(k, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, v, (k,), generator=gen)
    got = _run(hidden, weight, targets, temperature=temperature, compiled=False, with_entropy=with_entropy)

    hd, wt = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = _reference(hd, wt, targets, temperature)
    gen = torch.Generator().manual_seed(7)
    loss = (lp * torch.randn(lp.shape, generator=gen, dtype=lp.dtype)).sum()
    if with_entropy:
        loss = loss + (ent * torch.randn(ent.shape, generator=gen, dtype=ent.dtype)).sum()
    loss.backward()
    fp32 = {"rtol": 1e-4, "atol": 1e-5}  # the head's softmax maths is fp32 whatever the input dtype
    torch.testing.assert_close(got[0], lp.detach().float(), **fp32)
    if with_entropy:
        torch.testing.assert_close(got[1], ent.detach().float(), **fp32)
    torch.testing.assert_close(got[2], hd.grad, **fp32)
    torch.testing.assert_close(got[3], wt.grad, **fp32)


def test_targets_outside_this_ranks_rows_contribute_no_logit() -> None:
    """A rank holding rows [50, 101) of the vocabulary: a target below 50 is another rank's; its
    target logit share is 0 (the all-reduce over ranks adds the owner's)."""
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(5, 8, generator=gen), torch.randn(51, 8, generator=gen)
    targets = torch.tensor([3, 60, 49, 100, 50])
    lp, _, _, _ = _run(hidden, weight, targets, temperature=1.0, compiled=False, vocab_start=50)
    lse = torch.logsumexp(hidden @ weight.t(), dim=-1)
    owned = torch.tensor([False, True, False, True, True])
    want = torch.where(owned, (hidden @ weight.t()).gather(1, (targets - 50).clamp(0)[:, None]).squeeze(1), 0.0) - lse
    torch.testing.assert_close(lp, want)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile's CPU backend needs a C++ compiler")
def test_compiled_head_matches_eager() -> None:
    """``megatron.compile`` runs the same per-chunk maths through torch.compile (inductor's CPU backend here)."""
    from miles_megatron.head import chunk_logit_grad, chunk_logits, chunk_sums, compile_kernel

    compile_kernel.cache_clear()
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(29, 16, generator=gen), torch.randn(97, 16, generator=gen)
    targets = torch.randint(0, 97, (29,), generator=gen)
    eager = _run(hidden, weight, targets, temperature=0.8, compiled=False)
    compiled = _run(hidden, weight, targets, temperature=0.8, compiled=True)
    for want, got in zip(eager, compiled, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(compile_kernel(f) is not f for f in (chunk_logits, chunk_sums, chunk_logit_grad))
    assert compile_kernel.cache_info().currsize == 3
