"""``enable_deterministic_inference`` on a real server (tiny random Llama, fp32 CPU): a seeded
request gives the same tokens and the same log-prob bits alone and inside a batch."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from engine_support import serve_engine, wait_until
from miles_engine.sampling import request_seed


def _body(i: int) -> dict:
    prompt = [1, 30 + i, 50 + 2 * i, 7, 9, 11][: 2 + i]  # different lengths: different contexts in one batch
    return {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12 + 3 * i, "ignore_eos": True, "sampling_seed": 40 + i}}


def _trace(out: dict) -> list[tuple[int, float]]:
    return [(token, logprob) for logprob, token, _ in out["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def deterministic(dense_path):
    with serve_engine(dense_path, max_running_requests=8, enable_deterministic_inference=True) as running:
        yield running


def test_a_seeded_request_gives_the_same_bits_alone_and_in_a_batch(deterministic):
    bodies = [_body(i) for i in range(4)]
    alone = [_trace(deterministic.generate(b)) for b in bodies]
    deterministic.post("/pause_generation", {"mode": "in_place"})
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(deterministic.generate, b) for b in reversed(bodies)]
        wait_until(lambda: deterministic.info()["waiting"] == 4)
        deterministic.post("/continue_generation")
        batched = [_trace(f.result()) for f in reversed(futures)]
    assert deterministic.info()["stats"]["max_decode_batch"] == 4  # they really shared decode steps
    assert batched == alone  # exact floats: the numerics did not depend on the batch


def test_turns_sent_with_one_seed_draw_different_numbers():
    # the generator of a request is keyed on (seed, prompt length), as SGLang keys its draws on
    # (seed, position): a conversation's second turn does not replay the first turn's draws
    assert request_seed(7, 10) != request_seed(7, 30)
    assert request_seed(7, 10) != request_seed(8, 10)
    assert 0 <= request_seed(-5, 3) < 2**63
