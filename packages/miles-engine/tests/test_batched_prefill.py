"""New requests admitted in the same iteration are prefilled in one left-padded forward; what each
gets back (tokens, log-probs, routed experts) is what it would get alone (teacher forcing)."""

from __future__ import annotations

import asyncio

import numpy as np
import torch
from miles_contracts.wire.engine import GenerateRequest, decode_routed_experts
from miles_engine import Engine
from transformers import AutoModelForCausalLM

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 28], [1, 2000, 3000, 4000, 5000, 6000, 7000, 42, 9, 10]]


async def _together(engine: Engine, bodies: list[dict]) -> list:
    await engine.pause("in_place")  # hold admission so every request is waiting at once
    tasks = [asyncio.ensure_future(engine.generate(GenerateRequest.model_validate(b))) for b in bodies]
    await asyncio.sleep(0.2)
    await engine.resume()
    return await asyncio.gather(*tasks)


def test_greedy_logprobs_of_a_batched_prefill_match_teacher_forcing(dense_path) -> None:
    engine = Engine(dense_path, device="cpu")
    try:
        bodies = [{"input_ids": p, "return_logprob": True,
                   "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0.0}} for p in PROMPTS]
        outs = asyncio.run(_together(engine, bodies))
        stats = engine.server_info()["stats"]
    finally:
        engine.shutdown()
    assert stats["prefill_requests"] == 3 and stats["prefill_forwards"] == 1
    model = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = prompt + out.output_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        predicting = torch.log_softmax(logits[len(prompt) - 1 : len(ids) - 1], dim=-1)
        expected = predicting.gather(1, torch.tensor(out.output_ids)[:, None])[:, 0]
        assert out.output_ids == predicting.argmax(dim=-1).tolist()  # greedy: the argmax each time
        assert torch.allclose(torch.tensor(out.logprobs()), expected, atol=1e-4)


def test_routed_experts_of_a_batched_prefill_match_the_routers(moe_path) -> None:
    engine = Engine(moe_path, device="cpu")
    try:
        bodies = [{"input_ids": p, "return_routed_experts": True,
                   "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "sampling_seed": i}}
                  for i, p in enumerate(PROMPTS)]
        outs = asyncio.run(_together(engine, bodies))
        assert engine.server_info()["stats"]["prefill_forwards"] == 1
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    top_k = model.config.num_experts_per_tok
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens = prompt + out.output_ids
        with torch.no_grad():
            router_logits = model(torch.tensor([tokens[:-1]]), output_router_logits=True).router_logits
        expected = torch.stack([r.reshape(len(tokens) - 1, -1).topk(top_k, dim=-1).indices for r in router_logits], dim=1)
        got = np.frombuffer(decode_routed_experts(out.meta_info.routed_experts), dtype="<i4")
        np.testing.assert_array_equal(got.reshape(expected.shape), expected.numpy().astype(np.int32))


def test_an_idle_engine_gathers_a_trickling_burst_into_one_prefill(dense_path) -> None:
    """Requests reaching an idle engine a few ms apart are prefilled together (``prefill_wait_ms``)."""

    async def trickle(engine: Engine) -> list:
        tasks = []
        for i, prompt in enumerate(PROMPTS * 2):
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "sampling_seed": i}}
            tasks.append(asyncio.ensure_future(engine.generate(GenerateRequest.model_validate(body))))
            await asyncio.sleep(0.03)  # 30 ms apart: without the wait, each would be its own prefill
        return await asyncio.gather(*tasks)

    # a generous gap (the test machine is shared): arrivals 30 ms apart never leave it quiet that long
    engine = Engine(dense_path, device="cpu", prefill_gap_ms=400.0, prefill_wait_ms=10_000.0)
    try:
        outs = asyncio.run(trickle(engine))
        stats = engine.server_info()["stats"]
    finally:
        engine.shutdown()
    assert [len(out.output_ids) for out in outs] == [3] * 6
    assert stats["prefill_requests"] == 6 and stats["prefill_forwards"] == 1
    assert stats["gathered_waits"] >= 5


def test_engine_options_reject_negative_waits(dense_path) -> None:
    import pytest

    with pytest.raises(ValueError, match="prefill_wait_ms must be >= 0.*prefill_gap_ms must be >= 0"):
        Engine(dense_path, device="cpu", prefill_wait_ms=-1.0, prefill_gap_ms=-1.0)
