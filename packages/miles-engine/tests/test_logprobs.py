"""The logprob the engine returns for each sampled token equals a teacher-forced forward's.

Teacher forcing: the same transformers model, fed prompt + completion in one forward, with the
same processing the sampler applied (temperature, top-k, top-p, renormalised). fp32 on CPU: the
difference is rounding only. The max difference is printed (``-s``) and asserted below 1e-4.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch
from transformers import AutoModelForCausalLM

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 28, 7, 99, 1024], [1, 2000, 3000, 4000, 5000, 6000, 7000, 42]]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(dense_path):
    model = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32)
    return model.eval()


def processed_logprobs(logits: torch.Tensor, params: dict) -> torch.Tensor:
    """``[T, V]`` logits -> log-probs of the distribution the engine samples from."""
    temperature = params.get("temperature", 1.0)
    if temperature == 0.0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature
    top_k = params.get("top_k", -1)
    if top_k > 0:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    top_p = params.get("top_p", 1.0)
    if top_p < 1.0:
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) > top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def teacher_forced(model, prompt: list[int], output: list[int], params: dict) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # [T, V]
    predicting = logits[len(prompt) - 1 : len(prompt) + len(output) - 1]  # rows that predicted each output token
    logprobs = processed_logprobs(predicting, params)
    return logprobs.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("params", [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 50},
    {"temperature": 1.3, "top_p": 0.9},
    {"temperature": 0.8, "top_k": 200, "top_p": 0.95},
], ids=["greedy", "t1", "t0.7-k50", "t1.3-p0.9", "t0.8-k200-p0.95"])
def test_logprobs_match_teacher_forcing(dense, reference, params):
    bodies = [{"input_ids": p, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 20, "ignore_eos": True, "sampling_seed": 7 + i, **params}} for i, p in enumerate(PROMPTS)]
    # Concurrently, so the logprobs come from batched decode steps of different lengths.
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        outs = list(pool.map(dense.generate, bodies))
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        returned = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
        assert [entry[1] for entry in out["meta_info"]["output_token_logprobs"]] == out["output_ids"]
        expected = teacher_forced(reference, prompt, out["output_ids"], params)
        worst = max(worst, max(abs(a - b) for a, b in zip(returned, expected, strict=True)))
    print(f"\nmax |engine logprob - teacher-forced logprob| ({params}): {worst:.3e}")
    assert worst < TOLERANCE
