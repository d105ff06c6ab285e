"""The radix prefix cache in a real engine (tiny random model, fp32 CPU): a multi-turn session gives
the tokens and log-probs it gives without the cache, while prefilling a fraction of the tokens; a
weight update never lets stale KV be served; a small cache evicts and stays correct; aborts and
retracts leave nothing pinned; ``/generate`` reports ``cached_tokens``.

Tolerance: greedy tokens are equal and log-probs within 1e-5. Not bitwise, because a cached turn's
answer has the KV its decode steps computed (one query at a time, the engine's grouped decode
attention), while a full prefill recomputes it with SDPA over the whole prompt; the two differ by
fp32 rounding (~1e-6 measured on these models).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engine_support import serve_engine
from miles_contracts.wire.engine import GenerateRequest, GenerateResponse
from miles_engine import Engine
from miles_models.testing import tiny_model

TOLERANCE = 1e-5


def _request(ids: list[int], max_new: int = 6, **extra: Any) -> GenerateRequest:
    return GenerateRequest.model_validate({"input_ids": ids, "return_logprob": True, **extra,
                                           "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True,
                                                               "temperature": 0.0}})


def _session(engine: Engine, first: list[int], turns: int, *, between: Any = None) -> list[GenerateResponse]:
    """``turns`` turns of one conversation: each prompt is the last one, its answer and 3 new tokens."""
    async def go() -> list[GenerateResponse]:
        history, answers = list(first), []
        for turn in range(turns):
            if between is not None and turn:
                await between(turn)
            answer = await engine.generate(_request(history))
            answers.append(answer)
            history = history + answer.output_ids + [300 + turn, 17, 1000 + turn]
        return answers

    return asyncio.run(go())


def _assert_same(cached: list[GenerateResponse], plain: list[GenerateResponse]) -> None:
    for turn, (a, b) in enumerate(zip(cached, plain, strict=True)):
        assert a.output_ids == b.output_ids, f"turn {turn}: greedy tokens differ"
        worst = max(abs(x - y) for x, y in zip(a.logprobs(), b.logprobs(), strict=True))
        assert worst <= TOLERANCE, f"turn {turn}: log-probs differ by {worst}"


@pytest.fixture(scope="module")
def plain_answers(dense_path) -> list[GenerateResponse]:
    engine = Engine(dense_path, device="cpu", disable_radix_cache=True)
    try:
        assert engine.server_info()["radix_cache"] == {"enabled": False}
        return _session(engine, [1, 504, 3458, 282], 5)
    finally:
        engine.shutdown()


def test_a_session_with_the_cache_matches_one_without_and_prefills_less(dense_path, plain_answers) -> None:
    engine = Engine(dense_path, device="cpu", disable_radix_cache=False)
    try:
        answers = _session(engine, [1, 504, 3458, 282], 5)
        info = engine.server_info()
    finally:
        engine.shutdown()
    _assert_same(answers, plain_answers)
    # turn t (t >= 1) finds everything but the 3 new tokens and the last answer token cached
    assert [a.meta_info.cached_tokens for a in answers] == [0, 9, 18, 27, 36]
    stats, cache = info["stats"], info["radix_cache"]
    assert stats["cached_prefill_tokens"] == 90 and stats["prefill_tokens"] == 4 + 4 * 4
    assert cache["hits"] == 4 and cache["pinned_tokens"] == 0


def test_a_weight_update_between_turns_never_serves_stale_kv(dense_path) -> None:
    from miles_contracts.wire.engine import UpdateWeightsFromDiskRequest

    other = tiny_model("dense", seed=1)
    first = [1, 77, 78, 79, 80]
    engine = Engine(dense_path, device="cpu", weight_dir=[str(other)], disable_radix_cache=False)

    async def go() -> tuple[list[int], GenerateResponse]:
        turn_one = await engine.generate(_request(first))
        await engine.weights.from_disk(UpdateWeightsFromDiskRequest(model_path=str(other), weight_version="1"))
        history = first + turn_one.output_ids + [300, 17, 1000]
        return history, await engine.generate(_request(history))

    try:
        history, turn_two = asyncio.run(go())
        assert engine.server_info()["radix_cache"]["invalidations"] == 1
    finally:
        engine.shutdown()
    reference = Engine(other, device="cpu", disable_radix_cache=True)
    try:
        expected = asyncio.run(reference.generate(_request(history)))
    finally:
        reference.shutdown()
    assert turn_two.meta_info.cached_tokens == 0 and turn_two.meta_info.weight_version == "1"
    _assert_same([turn_two], [expected])


def test_requests_that_span_a_weight_update_are_not_stored(dense_path) -> None:
    engine = Engine(dense_path, device="cpu", disable_radix_cache=False)

    async def go() -> dict[str, Any]:
        running = asyncio.ensure_future(engine.generate(_request([1, 2, 3, 4, 5], max_new=150)))
        while engine.server_info()["stats"]["decode_steps"] < 2:
            await asyncio.sleep(0.01)
        await engine.pause("in_place")  # it stays in the batch, mid-answer
        await engine.weights.fill_noise(7)  # every weight changes under it
        await engine.resume()
        await running
        return engine.server_info()["radix_cache"]

    try:
        cache = asyncio.run(go())
    finally:
        engine.shutdown()
    assert cache["invalidations"] == 1 and cache["skipped_stale"] == 1
    assert cache["cached_tokens"] == 0 and cache["pinned_tokens"] == 0


def test_a_small_cache_evicts_and_answers_stay_the_same(dense_path, plain_answers) -> None:
    engine = Engine(dense_path, device="cpu", radix_cache_tokens=40, disable_radix_cache=False)
    try:
        noise = [_session(engine, [1, 900 + i, 901 + i, 902 + i, 903 + i, 904 + i], 1) for i in range(4)]
        answers = _session(engine, [1, 504, 3458, 282], 5)
        cache = engine.server_info()["radix_cache"]
    finally:
        engine.shutdown()
    assert noise
    _assert_same(answers, plain_answers)
    assert cache["evicted_tokens"] > 0 and cache["cached_tokens"] <= 40 and cache["capacity_tokens"] <= 40
    assert answers[1].meta_info.cached_tokens == 9  # the live session still hits after evictions


def test_aborts_and_retracts_leave_nothing_pinned_and_retracted_requests_resume_from_the_cache(
        dense_path) -> None:
    engine = Engine(dense_path, device="cpu", disable_radix_cache=False)

    async def go() -> tuple[list[GenerateResponse], dict[str, Any]]:
        tasks = [asyncio.ensure_future(engine.generate(_request([1, 50 + i, 60, 70], max_new=300)))
                 for i in range(3)]
        while engine.server_info()["stats"]["decode_steps"] < 3:
            await asyncio.sleep(0.01)
        await engine.pause("retract")  # their KV goes to the prefix cache, the slots are freed
        retracted = engine.server_info()["radix_cache"]
        steps = engine.server_info()["stats"]["decode_steps"]
        await engine.resume()
        while engine.server_info()["stats"]["decode_steps"] < steps + 2:  # re-admitted and decoding again
            await asyncio.sleep(0.01)
        await engine.abort(None)
        done = await asyncio.gather(*tasks)
        return done, retracted

    try:
        answers, retracted = asyncio.run(go())
        cache = engine.server_info()["radix_cache"]
    finally:
        engine.shutdown()
    assert all(a.meta_info.finish_reason.type == "abort" for a in answers)
    assert retracted["cached_tokens"] >= 3 * 6 and retracted["pinned_tokens"] == 0
    assert cache["hits"] >= 3 and cache["pinned_tokens"] == 0


def test_generate_reports_cached_tokens_over_http(dense_path) -> None:
    with serve_engine(dense_path, device="cpu", disable_radix_cache=False) as running:
        body = {"input_ids": [1, 11, 12, 13, 14, 15], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True,
                                                                          "temperature": 0.0}}
        first = running.generate(body)
        again = running.generate({**body, "input_ids": body["input_ids"] + first["output_ids"] + [5]})
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == 6 + 2  # the prompt and the answer's fed tokens


@pytest.mark.gpu
def test_the_cache_with_cuda_graphs_matches_eager_decode_without_it(dense_path) -> None:
    """Prefixes copied into the slot cache that the decode graphs captured (its address never
    changes for them), several sessions in one batch, the cache growing while graphs replay."""
    firsts = [[1] + [20 + (i * 13 + j) % 300 for j in range(5 + 40 * i)] for i in range(6)]

    def sessions(engine: Engine) -> list[list[GenerateResponse]]:
        async def one(first: list[int]) -> list[GenerateResponse]:
            history, answers = list(first), []
            for turn in range(4):
                answer = await engine.generate(_request(history, max_new=12))
                answers.append(answer)
                history = history + answer.output_ids + [300 + turn, 17]
            return answers

        async def go() -> list[list[GenerateResponse]]:
            return list(await asyncio.gather(*(one(f) for f in firsts)))

        return asyncio.run(go())

    results = {}
    for cached in (True, False):
        engine = Engine(dense_path, device="cuda", dtype="float32", max_running_requests=8,
                        disable_cuda_graph=not cached, disable_radix_cache=not cached)
        try:
            results[cached] = (sessions(engine), engine.server_info())
        finally:
            engine.shutdown()
    (graphed, info), (eager, _) = results[True], results[False]
    assert info["cuda_graphs"]["replays"] > 0 and info["radix_cache"]["hits"] >= 6 * 3
    for mine, theirs in zip(graphed, eager, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert a.output_ids == b.output_ids
            worst = max(abs(x - y) for x, y in zip(a.logprobs(), b.logprobs(), strict=True))
            assert worst < 1e-3  # the graph tests' tolerance: TF32 / kernel choice differ on CUDA


def test_with_the_batch_invariant_forward_the_cache_changes_no_bit(dense_path) -> None:
    # rollout.true_on_policy: prefill, decode and a prefill over cached keys reduce in one order
    # (miles_engine.invariant), so a cached turn's log-probs are those of the uncached session
    # exactly, and the trainer's diff of 0 (tests/test_true_on_policy.py) holds with the cache on
    sessions = {}
    for cache in (False, True):
        engine = Engine(dense_path, device="cpu", disable_radix_cache=not cache, true_on_policy=True)
        try:
            sessions[cache] = _session(engine, [1, 504, 3458, 282], 5)
        finally:
            engine.shutdown()
    assert [a.meta_info.cached_tokens for a in sessions[True]] == [0, 9, 18, 27, 36]
    for turn, (cached, plain) in enumerate(zip(sessions[True], sessions[False], strict=True)):
        assert cached.output_ids == plain.output_ids, f"turn {turn}"
        assert cached.logprobs() == plain.logprobs(), f"turn {turn}: not bit-identical"
