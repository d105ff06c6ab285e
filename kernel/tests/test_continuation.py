"""Partial rollout's bookkeeping (miles.rollout.continuation) against a scripted engine client: the
split points and versions must be exact, which a real engine gives only with a timed weight push
(that end-to-end case is tests/test_fully_async.py)."""

from __future__ import annotations

import asyncio

from miles.rollout.continuation import MAX_EMPTY_ABORTS, engine_weight_version, generate
from miles_contracts.wire.engine import GenerateRequest, GenerateResponse, SamplingParams


class ScriptedEngine:
    """Answers call k with ``script[k]``: (ids, finish type, weight version)."""

    def __init__(self, script: list[tuple[list[int], str, str | None]]) -> None:
        self.script, self.requests = script, []

    async def generate(self, request: GenerateRequest, *, routing_key: str | None = None) -> GenerateResponse:
        ids, finish, version = self.script[min(len(self.requests), len(self.script) - 1)]
        self.requests.append(request)
        return GenerateResponse.model_validate({
            "text": "x" * len(ids), "output_ids": ids,
            "meta_info": {"id": "r", "finish_reason": {"type": finish}, "prompt_tokens": len(request.input_ids),
                          "completion_tokens": len(ids), "weight_version": version,
                          "output_token_logprobs": [[-1.0, i, None] for i in ids]},
        })


def _request(max_new_tokens: int = 6, min_new_tokens: int = 0) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens)
    return GenerateRequest(input_ids=[1, 2], sampling_params=params, return_logprob=True)


def test_a_generation_spanning_two_updates_keeps_every_token_with_its_version() -> None:
    engine = ScriptedEngine([([5, 6], "abort", "0"), ([], "abort", "1"), ([7], "abort", "1"), ([8, 9, 10], "length", "2")])
    result = asyncio.run(generate(engine, _request(min_new_tokens=4), partial_rollout=True))
    assert result.output_ids == [5, 6, 7, 8, 9, 10] and result.finish.type == "length"
    assert result.token_versions == [0, 0, 1, 2, 2, 2] and result.call_versions == [0, 1, 2]
    assert [r.input_ids for r in engine.requests] == [[1, 2], [1, 2, 5, 6], [1, 2, 5, 6], [1, 2, 5, 6, 7]]
    assert [r.sampling_params.max_new_tokens for r in engine.requests] == [6, 4, 4, 3]
    assert [r.sampling_params.min_new_tokens for r in engine.requests] == [4, 2, 2, 1]
    assert result.oldest_version == 0 and result.text == "xxxxxx"


def test_without_partial_rollout_or_after_too_many_empty_aborts_the_generation_ends_aborted() -> None:
    engine = ScriptedEngine([([5], "abort", "0")])
    assert asyncio.run(generate(engine, _request())).aborted and len(engine.requests) == 1
    stuck = ScriptedEngine([([], "abort", None)])  # e.g. a router with no healthy engine
    result = asyncio.run(generate(stuck, _request(), partial_rollout=True))
    assert result.aborted and result.output_ids == [] and len(stuck.requests) == MAX_EMPTY_ABORTS


def test_engine_weight_versions_are_ints_and_an_unnamed_one_is_the_base_model() -> None:
    assert [engine_weight_version(v) for v in (3, "7", None, "default")] == [3, 7, 0, 0]
