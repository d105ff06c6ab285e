"""The local layers' core attention: packed causal attention equals attention over each sequence
alone, and on a GPU it runs in a fused kernel (a 3-D call to PyTorch's SDPA silently took the math
kernel, which stores every layer's score matrix: a 16K-token row ran out of the H200's memory)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from miles_megatron.attention import _attend


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA written out: ``q [h, lq, d]`` are the last ``lq`` positions of ``k, v [g, lk, d]``."""
    h, lq, _ = q.shape
    g, lk, _ = k.shape
    k, v = k.repeat_interleave(h // g, dim=0), v.repeat_interleave(h // g, dim=0)
    scores = (q.float() @ k.float().transpose(1, 2)) * scale
    visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    return (F.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v.float()).to(q.dtype)


@pytest.mark.parametrize(("lq", "lk"), [(12, 12), (5, 12)], ids=["self", "bottom-right"])
def test_attend_is_causal_gqa_attention(lq, lk):
    torch.manual_seed(0)
    q, k, v = torch.randn(4, lq, 8), torch.randn(2, lk, 8), torch.randn(2, lk, 8)
    out = _attend(q, k, v, scale=0.3, dropout=0.0)
    assert out.shape == (4, lq, 8)
    torch.testing.assert_close(out, reference(q, k, v, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("lq", "lk"), [(4096, 4096), (1024, 4096)], ids=["self", "bottom-right"])
def test_attend_runs_in_a_fused_kernel_on_gpu(lq, lk):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    # a view of [t, heads, d] transposed, as TorchAttention.forward passes it
    q = torch.randn(lq, 16, 64, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    k, v = (torch.randn(lk, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(0, 1) for _ in range(2))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # no math fallback
        out = _attend(q, k, v, scale=0.125, dropout=0.0)
    torch.testing.assert_close(out.float(), reference(q.cpu(), k.cpu(), v.cpu(), 0.125).float().cuda(),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_varlen_kernel_equals_attention_per_sequence_with_gradients():
    """``megatron.attention_kernel: varlen``: one call for all packed sequences (GQA, a custom scale)
    gives what SDPA per sequence gives, values and gradients."""
    from miles_megatron.attention import _varlen_causal, varlen_problem

    if (problem := varlen_problem()) is not None:
        pytest.skip(problem)
    torch.manual_seed(0)
    lengths = [300, 1024, 77, 600]
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    t = bounds[-1]
    leaves = [torch.randn(t, heads, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for heads in (16, 4, 4)]

    def per_sequence(q, k, v):
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        pieces = [_attend(q[:, s:e], k[:, s:e], v[:, s:e], 0.1, 0.0) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
        return torch.cat([o.transpose(0, 1) for o in pieces], dim=0)

    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    grad = torch.randn(t, 16, 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for run in (per_sequence, lambda q, k, v: _varlen_causal(q, k, v, cu, max(lengths), 0.1)):
        out = run(*leaves)
        grads = torch.autograd.grad(out, leaves, grad)
        results.append((out, *grads))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_varlen_kernel_on_the_cpu_is_a_clear_error(tiny_dense, backend_factory) -> None:
    with pytest.raises(ValueError, match="attention_kernel: varlen cannot run"):
        backend_factory(tiny_dense, megatron={"attention_kernel": "varlen"})
