"""Batched sampling with per-request parameters, returning the log-prob of each chosen token.

For a sampled request the log-prob is taken from the distribution actually sampled: logits after
penalties and the ``min_new_tokens`` ban, divided by the temperature, restricted by top-k and
top-p, renormalised. For a greedy request (``temperature`` 0, or below :data:`GREEDY_BELOW`) it
is the log-softmax of the logits after penalties and bans (temperature 1, no truncation), which
is what a teacher-forced forward of the same sequence gives.

Sampling inverts the CDF: one uniform number per request, searched in the cumulative
probabilities, so the random-number cost is one draw per row (not one per vocabulary entry). A
request with a ``sampling_seed`` draws from its own generator, so its tokens do not depend on
which other requests share the batch. That generator is seeded from the seed *and* the prompt's
length (:func:`request_seed`): SGLang keys its seeded draws on (seed, position) as well, and the
turns of one conversation sent with one seed must not reuse the same random numbers (turn 2 would
otherwise sample its first token with turn 1's first draw, coupling turns that RL treats as
independent draws).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


GREEDY_BELOW = 1e-6
"""A temperature below this samples greedily, as SGLang does (its sampling epsilon): dividing
logits by, say, 1e-300 would overflow them to inf and the softmax to NaN."""


@dataclass(slots=True)
class RowSampling:
    """Sampling state of one request (one row of the batch)."""

    temperature: float
    top_p: float
    top_k: int  # -1: off
    min_new_tokens: int
    banned_until_min: tuple[int, ...]  # token ids masked while fewer than min_new_tokens are out
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    generator: torch.Generator | None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


def request_seed(sampling_seed: int, prompt_len: int) -> int:
    """Seed of a request's generator, in ``torch.Generator.manual_seed``'s range: distinct for
    distinct (seed, prompt length) pairs while prompts are shorter than 1,000,003 tokens and seeds
    lie in [0, 9e12)."""
    return (sampling_seed * 1_000_003 + prompt_len) % 2**63


def sample(logits: torch.Tensor, rows: Sequence[RowSampling], outputs: Sequence[Sequence[int]],
           prompts: Sequence[Sequence[int]], default_generator: torch.Generator | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose one token per row.

    :param logits: ``[B, V]`` next-token logits (any float dtype).
    :param outputs: tokens each request generated so far (penalties, ``min_new_tokens``).
    :param prompts: each request's prompt (repetition penalty).
    :returns: ``(tokens [B] int64, logprobs [B] float32)``.
    """
    import torch

    with torch.inference_mode():
        return _sample(logits, rows, outputs, prompts, default_generator)


def _sample(logits: torch.Tensor, rows: Sequence[RowSampling], outputs: Sequence[Sequence[int]],
            prompts: Sequence[Sequence[int]], default_generator: torch.Generator | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    from miles_engine.invariant import token_logprobs

    edits = any(row.penalised or (row.banned_until_min and len(outputs[i]) < row.min_new_tokens)
                for i, row in enumerate(rows))
    original = logits
    logits = logits.float()
    if edits and logits is original:
        # edited in place below (penalties, bans): never the caller's tensor, which a failed batch
        # draw hands again, row by row, to the per-request retry
        logits = logits.clone()
    _apply_penalties(logits, rows, outputs, prompts)
    _ban_until_min_tokens(logits, rows, outputs)
    if all(row.greedy for row in rows):
        logprobs = token_logprobs(logits)
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(1, tokens[:, None])[:, 0]
    scaled = _truncate(logits / _column(rows, "temperature", logits.device, greedy_value=1.0), rows)
    logprobs = token_logprobs(scaled)  # [B, V]: what the trainer recomputes (true on-policy)
    cdf = logprobs.exp().cumsum_(dim=-1)  # [B, V]
    # One uniform draw in (0, 1] per row; scaled by the row's total so rounding cannot overshoot.
    uniform = 1.0 - torch.rand(len(rows), device=logits.device, generator=default_generator)
    for i, row in enumerate(rows):
        if row.generator is not None and not row.greedy:
            uniform[i] = 1.0 - torch.rand((), device=logits.device, generator=row.generator)
    sampled = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None]).clamp_(max=cdf.shape[-1] - 1)[:, 0]
    if not any(row.greedy for row in rows):
        return sampled, logprobs.gather(1, sampled[:, None])[:, 0]
    greedy = torch.tensor([row.greedy for row in rows], device=logits.device)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def _column(rows: Sequence[RowSampling], field: str, device: torch.device, *, greedy_value: float) -> torch.Tensor:
    import torch

    values = [greedy_value if row.greedy else float(getattr(row, field)) for row in rows]
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _truncate(scaled: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """Mask (``-inf``) what top-k and top-p exclude, per row; greedy rows are not truncated."""
    import torch

    top_ks = [row.top_k if row.top_k > 0 and not row.greedy else 0 for row in rows]
    if any(top_ks):
        k_max = min(max(top_ks), scaled.shape[-1])
        _, order = scaled.topk(k_max, dim=-1)  # [B, k_max]
        limit = torch.tensor([k or k_max for k in top_ks], device=scaled.device)[:, None]
        keep = torch.zeros_like(scaled, dtype=torch.bool)
        keep.scatter_(1, order, torch.arange(k_max, device=scaled.device)[None, :] < limit)
        unrestricted = torch.tensor([k == 0 for k in top_ks], device=scaled.device)
        keep |= unrestricted[:, None]
        scaled = scaled.masked_fill(~keep, float("-inf"))
    top_ps = [row.top_p if not row.greedy else 1.0 for row in rows]
    if any(p < 1.0 for p in top_ps):
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before > torch.tensor(top_ps, device=scaled.device)[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def _apply_penalties(logits: torch.Tensor, rows: Sequence[RowSampling], outputs: Sequence[Sequence[int]],
                     prompts: Sequence[Sequence[int]]) -> None:
    """OpenAI-style frequency/presence penalties on generated tokens; multiplicative repetition
    penalty (CTRL / transformers) on prompt and generated tokens. In place."""
    import torch

    for i, row in enumerate(rows):
        if not row.penalised:
            continue
        if (row.frequency_penalty or row.presence_penalty) and outputs[i]:
            ids = torch.tensor(outputs[i], device=logits.device)
            counts = torch.zeros_like(logits[i]).scatter_add_(0, ids, torch.ones_like(ids, dtype=logits.dtype))
            logits[i] -= row.frequency_penalty * counts + row.presence_penalty * (counts > 0).to(logits.dtype)
        if row.repetition_penalty != 1.0:
            seen = torch.tensor(list(prompts[i]) + list(outputs[i]), device=logits.device).unique()
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / row.repetition_penalty, values * row.repetition_penalty)


def _ban_until_min_tokens(logits: torch.Tensor, rows: Sequence[RowSampling], outputs: Sequence[Sequence[int]]) -> None:
    for i, row in enumerate(rows):
        if row.banned_until_min and len(outputs[i]) < row.min_new_tokens:
            logits[i, list(row.banned_until_min)] = float("-inf")
