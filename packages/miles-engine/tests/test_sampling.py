"""The sampler draws from the distribution it reports (large samples on a small vocabulary)."""

from __future__ import annotations

import torch
from miles_engine.sampling import RowSampling, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def row(**overrides) -> RowSampling:
    base = dict(temperature=1.0, top_p=1.0, top_k=-1, min_new_tokens=0, banned_until_min=(), frequency_penalty=0.0,
                presence_penalty=0.0, repetition_penalty=1.0, generator=None)
    return RowSampling(**{**base, **overrides})


def draw(n: int, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [row(**overrides)] * n
    return sample(LOGITS.repeat(n, 1), rows, [[]] * n, [[]] * n, torch.Generator().manual_seed(0))


def frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=len(LOGITS)).float() / len(tokens)


def test_frequencies_follow_the_tempered_distribution():
    for temperature in (1.0, 0.5, 2.0):
        tokens, logprobs = draw(40_000, temperature=temperature)
        expected = torch.softmax(LOGITS / temperature, dim=-1)
        assert torch.allclose(frequencies(tokens), expected, atol=0.01)
        assert torch.allclose(logprobs, expected.log()[tokens], atol=1e-5)


def test_truncation_never_draws_excluded_tokens_and_renormalises():
    tokens, logprobs = draw(20_000, top_k=2)
    assert set(tokens.tolist()) <= {0, 1}
    kept = torch.softmax(LOGITS[:2], dim=-1)
    assert torch.allclose(frequencies(tokens)[:2], kept, atol=0.015)
    assert torch.allclose(logprobs, kept.log()[tokens], atol=1e-5)
    tokens, _ = draw(20_000, top_p=0.7)  # p = .61, .22, .14, ...: keeps the first two
    assert set(tokens.tolist()) == {0, 1}


def test_greedy_seeded_and_banned_rows_in_one_batch():
    seeded = torch.Generator().manual_seed(5)
    rows = [row(temperature=0.0), row(generator=seeded), row(min_new_tokens=3, banned_until_min=(0,), temperature=0.0)]
    tokens, logprobs = sample(LOGITS.repeat(3, 1), rows, [[], [], [7]], [[], [], []], torch.Generator().manual_seed(1))
    assert tokens[0] == 0 and torch.isclose(logprobs[0], torch.log_softmax(LOGITS, -1)[0])
    assert tokens[2] == 1  # token 0 is banned until 3 tokens are out
    again = sample(LOGITS.repeat(1, 1), [row(generator=torch.Generator().manual_seed(5))], [[]], [[]], None)[0]
    assert again[0] == tokens[1]  # a seeded row draws the same whatever shares its batch


def test_penalties_lower_repeated_tokens():
    plain, _ = draw(1, temperature=0.0)
    assert plain.item() == 0
    rows = [row(temperature=0.0, frequency_penalty=2.0)]
    tokens, _ = sample(LOGITS[None].clone(), rows, [[0]], [[]], None)
    assert tokens.item() == 1
    rows = [row(temperature=0.0, repetition_penalty=1.9)]
    tokens, _ = sample(LOGITS[None].clone(), rows, [[]], [[0]], None)  # token 0 is in the prompt
    assert tokens.item() == 0  # 2.0 / 1.9 = 1.05 still beats 1.0
    tokens, _ = sample(LOGITS[None].clone(), [row(temperature=0.0, repetition_penalty=2.0 + 1e-3)], [[]], [[0]], None)
    assert tokens.item() == 1  # 2.0 / 2.001 < 1.0


def test_a_vanishing_temperature_is_greedy_not_an_overflow():
    """SGLang's rule: below 1e-6 a request samples greedily (1e-300 would turn logits into inf)."""
    for temperature in (1e-300, 1e-7):
        tokens, logprobs = draw(3, temperature=temperature)
        assert tokens.tolist() == [0, 0, 0]
        assert torch.allclose(logprobs, torch.log_softmax(LOGITS, -1)[0].expand(3))
