"""Log-probs (and entropy) of wanted tokens from a vocabulary-parallel output layer, in chunks.

With tensor parallelism each rank holds ``V / tp`` rows of the output weight. For ``K`` wanted
positions (response tokens only), ``chunk`` at a time, each rank projects onto its rows and the
softmax statistics are combined over ranks: one all-reduce of the maxima, one of the sums
(``sum exp``, the target's logit, ``sum exp * logit`` for the entropy). Nothing of size ``V`` ever
crosses ranks, and the backward recomputes each chunk's logits instead of keeping them, so the
extra memory is a few ``chunk x V / tp`` fp32 buffers whatever ``K`` is.

With ``s = (h W^T) / tau`` over the full vocabulary and ``lse = logsumexp(s)``: the log-prob of
``y`` is ``s_y - lse`` with gradient ``onehot(y) - p``; the entropy ``H = lse - sum p s`` has
gradient ``-p (log p + H)``. Each rank's gradient w.r.t. the hidden states covers its own rows only;
the region the hidden states enter through (``gather_from_sequence_parallel_region`` or
``copy_to_tensor_model_parallel_region``) sums them over tensor-parallel ranks in backward.
Vocabulary padding (rows added so ``V`` divides by ``tp``) is cut off and never gets probability.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist


def _chunks(total: int, chunk: int):
    for start in range(0, total, chunk):
        yield slice(start, min(start + chunk, total))


def _all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp | dist.ReduceOp.RedOpType
) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


# The per-chunk maths, as plain functions between the collectives. Eagerly each element-wise step
# is a pass over a ``chunk x V_local`` fp32 buffer; compiled (``megatron.compile``) the cast,
# softmax statistics and gradient fuse into a few kernels around the matrix multiplies.


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[C, V_local]`` fp32 logits over the temperature, and their row maxima."""
    logits = torch.nn.functional.linear(hidden, weight).float() / temperature
    return logits, logits.amax(dim=-1)


def chunk_sums(logits: torch.Tensor, top: torch.Tensor, local: torch.Tensor, mine: torch.Tensor,
               with_entropy: bool) -> torch.Tensor:
    """This rank's share of ``sum exp(s - max)``, the target's logit (where this rank holds it) and
    ``sum exp(s - max) (s - max)``, stacked ``[2 or 3, C]`` for one all-reduce."""
    shifted = logits - top[:, None]
    exp = shifted.exp()
    parts = [exp.sum(-1), logits.gather(1, local[:, None]).squeeze(1) * mine]
    if with_entropy:
        parts.append((exp * shifted).sum(-1))
    return torch.stack(parts)


def chunk_logit_grad(hidden: torch.Tensor, weight: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
                     grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None, local: torch.Tensor,
                     mine: torch.Tensor, temperature: float) -> torch.Tensor:
    """The gradient w.r.t. this rank's logits (before the temperature), in the weight's dtype:
    ``g (onehot(y) - p) - g_H p (log p + H)``, divided by the temperature."""
    logp = torch.nn.functional.linear(hidden, weight).float() / temperature - lse[:, None]
    probs = logp.exp()
    g = grad_logprobs[:, None].float()
    if grad_entropy is not None and entropy is not None:
        grad_s = -(probs * ((logp + entropy[:, None]) * grad_entropy[:, None].float() + g))
    else:
        grad_s = probs * -g
    grad_s = grad_s.scatter_add(1, local[:, None], g * mine[:, None])
    return (grad_s / temperature).to(weight.dtype)


@functools.cache
def compile_kernel(fn: Callable) -> Callable:
    """``fn`` through ``torch.compile``, once per function (the head's and :mod:`miles_megatron.rope`'s)."""
    # sizes differ between chunks and micro-batches: dynamic shapes avoid one recompile per size
    return torch.compile(fn, dynamic=True)


def _kernels(compiled: bool) -> tuple[Callable, Callable, Callable]:
    functions = (chunk_logits, chunk_sums, chunk_logit_grad)
    return tuple(compile_kernel(f) for f in functions) if compiled else functions  # type: ignore[return-value]


class VocabParallelLogprobs(torch.autograd.Function):
    """``(hidden [K, H], weight [V_local, H], targets [K]) -> (logprobs [K], entropy [K] or empty)``.

    ``vocab_start``: global index of this rank's first row; ``weight`` holds real rows only.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, vocab_start: int, group, temperature: float, chunk: int, with_entropy: bool,
                compiled: bool = False):
        logits_of, sums_of, _ = _kernels(compiled)
        k = hidden.shape[0]
        logprobs = torch.empty(k, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logprobs)
        entropy = torch.empty(k if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        local = targets - vocab_start
        mine = (local >= 0) & (local < weight.shape[0])
        local = local.clamp(0, max(weight.shape[0] - 1, 0))
        for part in _chunks(k, chunk):
            logits, top = logits_of(hidden[part], weight, temperature)  # [C, V_local], [C]
            top = _all_reduce(top, group, dist.ReduceOp.MAX)
            sums = _all_reduce(sums_of(logits, top, local[part], mine[part], with_entropy), group, dist.ReduceOp.SUM)
            del logits
            lse[part] = top + sums[0].log()
            logprobs[part] = sums[1] - lse[part]
            if with_entropy:  # H = log Z - E[s - max] with Z = sum exp(s - max)
                entropy[part] = sums[0].log() - sums[2] / sums[0]
        ctx.save_for_backward(hidden, weight, local, mine, lse, entropy)
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.chunk, ctx.compiled = temperature, chunk, compiled
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local, mine, lse, entropy = ctx.saved_tensors
        logit_grad = _kernels(ctx.compiled)[2]
        use_entropy = grad_entropy is not None and entropy.numel() > 0
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for part in _chunks(hidden.shape[0], ctx.chunk):
            grad_s = logit_grad(hidden[part], weight, lse[part], entropy[part] if use_entropy else None,
                                grad_logprobs[part], grad_entropy[part] if use_entropy else None, local[part],
                                mine[part], ctx.temperature)
            if grad_hidden is not None:
                grad_hidden[part] = grad_s @ weight
            if grad_weight is not None:
                grad_weight += (grad_s.t() @ hidden[part]).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


class ReduceForward(torch.autograd.Function):
    """Sum over ``group`` in forward, identity in backward: every rank then holds (and
    differentiates) the full values while its gradient reaches only its own contribution."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        return _all_reduce(tensor.clone(), group, dist.ReduceOp.SUM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, hidden_index: torch.Tensor, *,
                   vocab_start: int, vocab_size: int, sequence_parallel: bool, temperature: float, chunk: int,
                   with_entropy: bool, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[K]`` (fp32) of ``targets`` predicted at ``hidden_index`` of ``hidden [s, 1, H]``.

    :param hidden: the decoder's output on this rank (a sequence-parallel slice when
        ``sequence_parallel``).
    :param weight: this rank's ``[V_local, H]`` rows of the output weight, starting at global row
        ``vocab_start``; rows at or past ``vocab_size`` are padding and are cut off.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    group = parallel_state.get_tensor_model_parallel_group()
    if sequence_parallel:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=group)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=group)
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, hidden_index)  # [K, H]
    real = max(0, min(weight.shape[0], vocab_size - vocab_start))
    logprobs, entropy = VocabParallelLogprobs.apply(
        hidden, weight[:real], targets, vocab_start, group, float(temperature), int(chunk), bool(with_entropy),
        bool(compiled))
    return logprobs, (entropy if with_entropy else None)
