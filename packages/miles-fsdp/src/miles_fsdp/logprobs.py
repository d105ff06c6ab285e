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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator


def _chunks(total: int, chunk: int) -> Iterator[slice]:
    for start in range(0, total, chunk):
        yield slice(start, min(start + chunk, total))


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """``[C, V]`` fp32 logits of ``[C, H]`` hidden states, divided by the temperature."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class ChunkedTokenLogprobs(torch.autograd.Function):
    """``(hidden [K, H], weight [V, H], bias [V] | None, targets [K]) -> (logprobs [K], entropy [K])``.

    Outputs are fp32. ``entropy`` is an empty tensor when not requested.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int, with_entropy: bool):
        k = hidden.shape[0]
        logprobs = torch.empty(k, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(k, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(k if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for part in _chunks(k, chunk):
            logits = _scaled_logits(hidden[part], weight, bias, temperature)  # [C, V]
            lse[part] = torch.logsumexp(logits, dim=-1)
            logprobs[part] = logits.gather(1, targets[part, None]).squeeze(1) - lse[part]
            if with_entropy:
                logits.sub_(lse[part, None])  # log p, in place: one [C, V] buffer less
                entropy[part] = -logits.exp().mul_(logits).sum(dim=-1)
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.set_materialize_grads(False)  # an unused output (entropy as a metric only) costs nothing
        ctx.temperature = temperature
        ctx.chunk = chunk
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        use_entropy = grad_entropy is not None and entropy.numel() > 0
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # accumulate the weight gradient over chunks in fp32 even when the weight is bf16
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
        for part in _chunks(hidden.shape[0], ctx.chunk):
            logp = _scaled_logits(hidden[part], weight, bias, ctx.temperature).sub_(lse[part, None])  # [C, V]
            probs = logp.exp()
            g = grad_logprobs[part, None].float()  # [C, 1]
            if use_entropy:
                # d(-sum p log p)/ds_j = -p_j (log p_j + H)
                ge = grad_entropy[part, None].float()
                logp.add_(entropy[part, None]).mul_(ge).add_(g)
                grad_s = probs.mul_(logp).neg_()
            else:
                grad_s = probs.mul_(-g)
            grad_s.scatter_add_(1, targets[part, None], g)
            if ctx.temperature != 1.0:
                grad_s.div_(ctx.temperature)
            grad_z = grad_s.to(weight.dtype)  # [C, V]
            del logp, probs, grad_s
            if grad_hidden is not None:
                grad_hidden[part] = grad_z @ weight
            if grad_weight is not None:
                grad_weight += (grad_z.t() @ hidden[part]).float()
            if grad_bias is not None:
                grad_bias += grad_z.float().sum(dim=0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[K]`` (fp32) of ``targets [K]`` under ``softmax((hidden W^T + b) / temperature)``.

    :param hidden: ``[K, H]`` hidden states of the predicting positions.
    :param weight: ``[V, H]`` output-embedding weight; ``bias``: ``[V]`` or None.
    :returns: ``(logprobs [K], entropy [K] or None)``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logprobs, entropy = ChunkedTokenLogprobs.apply(hidden, weight, bias, targets, float(temperature), int(chunk), with_entropy)
    return logprobs, (entropy if with_entropy else None)
