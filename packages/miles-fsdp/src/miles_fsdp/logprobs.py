"""Log-probs (and entropy) of chosen tokens from hidden states, chunked over positions.

The full-vocabulary logits of a long packed sequence are the largest tensor of RL training
(``N x V`` floats; 16K tokens x 152K vocab is 10 GB in fp32). Here only the ``K`` wanted positions
(response tokens) are projected, ``chunk`` of them at a time, and the backward recomputes each
chunk's logits instead of keeping them. Peak extra memory is about three ``chunk x V`` fp32
buffers, whatever ``K`` is.

With ``s = (h W^T + b) / tau`` and ``lse = logsumexp(s)``:

* log-prob of target ``y``: ``s_y - lse``; its gradient w.r.t. ``s`` is ``onehot(y) - p``;
* entropy ``H = lse - sum_j p_j s_j``; its gradient w.r.t. ``s_j`` is ``-p_j (log p_j + H)``;

and the chain rule through ``s = z / tau`` divides both by ``tau``.

The per-chunk maths is two plain functions (:func:`chunk_forward`, :func:`chunk_logit_grad`).
Eagerly, each of their element-wise steps is a pass over a ``chunk x V`` fp32 buffer; with
``compiled=True`` they go through ``torch.compile``, which keeps the matrix multiply and fuses the
cast, softmax statistics and gradient into a few kernels that read the logits once or twice (on
the H200 the eager passes cost more than the head's matrix multiplies, see docs/benchmarks/train.md).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


def _chunks(total: int, chunk: int) -> Iterator[slice]:
    for start in range(0, total, chunk):
        yield slice(start, min(start + chunk, total))


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """``[C, V]`` fp32 logits of ``[C, H]`` hidden states, divided by the temperature."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def chunk_forward(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    temperature: float, with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(lse [C], logprobs [C], entropy [C] or None)`` of one chunk, all fp32."""
    logits = _scaled_logits(hidden, weight, bias, temperature)  # [C, V]
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(1, targets[:, None]).squeeze(1) - lse
    if not with_entropy:
        return lse, logprobs, None
    logits.sub_(lse[:, None])  # log p, in place: one [C, V] buffer less when eager
    return lse, logprobs, -logits.exp().mul_(logits).sum(dim=-1)


def chunk_logit_grad(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
    lse: torch.Tensor, entropy: torch.Tensor | None, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """``[C, V]`` gradient w.r.t. the unscaled logits ``z = h W^T + b``, in the weight's dtype."""
    logp = _scaled_logits(hidden, weight, bias, temperature).sub_(lse[:, None])
    probs = logp.exp()
    g = grad_logprobs[:, None].float()  # [C, 1]
    if grad_entropy is not None and entropy is not None:
        # d(-sum p log p)/ds_j = -p_j (log p_j + H)
        logp.add_(entropy[:, None]).mul_(grad_entropy[:, None].float()).add_(g)
        grad_s = probs.mul_(logp).neg_()
    else:
        grad_s = probs.mul_(-g)
    grad_s.scatter_add_(1, targets[:, None], g)
    if temperature != 1.0:
        grad_s.div_(temperature)
    return grad_s.to(weight.dtype)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    # chunk sizes differ only in the last chunk: dynamic shapes avoid one recompile per size
    return torch.compile(fn, dynamic=True)


def _kernels(compiled: bool) -> tuple[Callable, Callable]:
    if compiled:
        return _compiled(chunk_forward), _compiled(chunk_logit_grad)
    return chunk_forward, chunk_logit_grad


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``(hidden [K, H], weight [V, H], bias [V] | None, targets [K]) -> (logprobs [K], entropy [K])``.

    Outputs are fp32. ``entropy`` is an empty tensor when not requested.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int, with_entropy: bool, compiled: bool):
        forward_fn, _ = _kernels(compiled)
        k = hidden.shape[0]
        logprobs = torch.empty(k, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(k, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(k if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for part in _chunks(k, chunk):
            lse[part], logprobs[part], ent = forward_fn(hidden[part], weight, bias, targets[part], temperature, with_entropy)
            if with_entropy:
                entropy[part] = ent
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.set_materialize_grads(False)  # an unused output (entropy as a metric only) costs nothing
        ctx.temperature = temperature
        ctx.chunk = chunk
        ctx.compiled = compiled
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        _, grad_fn = _kernels(ctx.compiled)
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        use_entropy = grad_entropy is not None and entropy.numel() > 0
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # accumulate the weight gradient over chunks in fp32 even when the weight is bf16
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
        for part in _chunks(hidden.shape[0], ctx.chunk):
            grad_z = grad_fn(
                hidden[part], weight, bias, targets[part], lse[part],
                entropy[part] if use_entropy else None, grad_logprobs[part],
                grad_entropy[part] if use_entropy else None, ctx.temperature,
            )  # [C, V]
            if grad_hidden is not None:
                grad_hidden[part] = grad_z @ weight
            if grad_weight is not None:
                grad_weight += (grad_z.t() @ hidden[part]).float()
            if grad_bias is not None:
                grad_bias += grad_z.float().sum(dim=0)
            del grad_z
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    with_entropy: bool = False,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[K]`` (fp32) of ``targets [K]`` under ``softmax((hidden W^T + b) / temperature)``.

    :param hidden: ``[K, H]`` hidden states of the predicting positions.
    :param weight: ``[V, H]`` output-embedding weight; ``bias``: ``[V]`` or None.
    :param compiled: run the per-chunk maths through ``torch.compile`` (same results up to rounding).
    :returns: ``(logprobs [K], entropy [K] or None)``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logprobs, entropy = ChunkedTokenLogprobs.apply(
        hidden, weight, bias, targets, float(temperature), int(chunk), with_entropy, bool(compiled),
    )
    return logprobs, (entropy if with_entropy else None)


def invariant_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, *,
    temperature: float = 1.0, with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` as the embedded engine's sampler computes it (true on-policy): the
    head row by row (:func:`miles_engine.invariant.linear`), fp32 logits divided by the
    temperature as a tensor (the sampler's per-row column), one log-softmax over the whole
    vocabulary (:func:`miles_engine.invariant.token_logprobs`). Not chunked: ``K x V`` fp32 logits
    are held, which the CPU sizes true on-policy runs at allow."""
    from miles_engine import invariant

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = invariant.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / torch.full((1, 1), temperature, dtype=torch.float32, device=logits.device)
    logp = invariant.token_logprobs(logits)
    # advanced indexing returns a fresh tensor: a view output would lose FSDP's pre-backward hook
    logprobs = logp[torch.arange(targets.shape[0], device=targets.device), targets]
    return logprobs, (-(logp.exp() * logp).sum(dim=-1) if with_entropy else None)
