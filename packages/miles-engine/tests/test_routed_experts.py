"""``return_routed_experts`` on a real server (tiny random Qwen3-MoE: 2 MoE layers, 4 experts,
top-2): the experts the engine reports for every token equal the router's own top-k on a
teacher-forced forward of the same tokens."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest
import torch
from miles_contracts.wire.engine import decode_routed_experts
from miles_models.testing import router_top_k
from transformers import AutoModelForCausalLM

PROMPTS = [[1, 504, 3458, 282, 4649], [1, 77, 88], [1, 1000, 2000, 3000, 4000, 5000, 6000]]


@pytest.fixture(scope="module")
def reference(moe_path):
    return AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()


def test_routed_experts_equal_the_routers_top_k(moe, reference):
    info = moe.get("/get_model_info").json()
    layers, top_k = info["num_moe_layers"], info["moe_top_k"]
    assert (layers, top_k) == (2, 2)
    bodies = [{"input_ids": p, "return_routed_experts": True,
               "sampling_params": {"max_new_tokens": 10 + i, "ignore_eos": True, "sampling_seed": i}}
              for i, p in enumerate(PROMPTS)]
    with cf.ThreadPoolExecutor(len(bodies)) as pool:  # batched decode steps
        outs = list(pool.map(moe.generate, bodies))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens = prompt + out["output_ids"]
        raw = decode_routed_experts(out["meta_info"]["routed_experts"])
        got = np.frombuffer(raw, dtype="<i4").reshape(len(tokens) - 1, layers, top_k)
        expected = router_top_k(reference, tokens[:-1])
        np.testing.assert_array_equal(got, expected)


def test_routed_experts_of_an_aborted_request_cover_what_was_fed(moe):
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(moe.generate, {"input_ids": PROMPTS[0], "rid": "cut", "return_routed_experts": True,
                                             "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})
        from engine_support import wait_until

        wait_until(lambda: moe.info()["running"] == 1)
        moe.post("/abort_request", {"rid": "cut"})
        out = running.result()
    raw = decode_routed_experts(out["meta_info"]["routed_experts"])
    rows = len(raw) // (4 * 2 * 2)
    assert rows == len(PROMPTS[0]) + len(out["output_ids"]) - 1


def test_routed_experts_on_a_dense_model_is_a_clear_400(dense):
    answer = dense.post("/generate", {"input_ids": [1, 2], "return_routed_experts": True})
    assert answer.status_code == 400
    assert "mixture-of-experts" in answer.json()["detail"]


def test_routed_experts_start_len_returns_only_the_rows_from_there(moe) -> None:
    """SGLang's ``routed_experts_start_len``: a later turn asks only for positions it lacks."""
    body = {"input_ids": PROMPTS[2], "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0.0}}
    full = moe.generate(body)
    part = moe.generate({**body, "routed_experts_start_len": 5})
    rows = np.frombuffer(decode_routed_experts(full["meta_info"]["routed_experts"]), dtype="<i4").reshape(-1, 2, 2)
    tail = np.frombuffer(decode_routed_experts(part["meta_info"]["routed_experts"]), dtype="<i4").reshape(-1, 2, 2)
    assert part["output_ids"] == full["output_ids"] and len(rows) == len(PROMPTS[2]) + 4 - 1
    np.testing.assert_array_equal(tail, rows[5:])
    too_far = moe.post("/generate", {**body, "routed_experts_start_len": len(PROMPTS[2]) + 1})
    assert too_far.status_code == 400 and "routed_experts_start_len" in too_far.json()["detail"]
