"""Every request is bounded, a client's mistake is a 4xx with the reason, one bad request never
harms another, and a paused or stuck engine fails requests with a clear error instead of hanging."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
from security_support import MAX_BODY, free_port

GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}


@pytest.mark.parametrize(("sampling", "says"), [
    ({"top_k": 2**63}, "top_k"),  # once accepted, then overflowed inside the batched step
    ({"top_k": 2**31}, "top_k"),
    ({"sampling_seed": 2**64}, "sampling_seed"),
    ({"max_new_tokens": 2**40}, "max_new_tokens"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": "x" * 5000}, "stop strings are at most"),
    ({"stop_token_ids": [1] * 5000}, "stop_token_ids"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"max_new_tokens": 2, "min_new_tokens": 5}, "min_new_tokens"),
])
def test_sampling_values_the_kernels_cannot_take_are_a_400(engine, sampling: dict, says: str) -> None:
    answer = engine.client.post("/generate", json={"input_ids": [1, 2], "sampling_params": sampling})
    assert answer.status_code == 400 and says in answer.json()["detail"], answer.text


def test_a_body_over_the_limit_is_a_413_that_names_the_limit(engine, router, session_server) -> None:
    big = {"text": "a" * (MAX_BODY + 10)}
    for served, path in ((engine, "/generate"), (router, "/generate"), (session_server, "/sessions")):
        answer = served.client.post(path, json=big)
        assert answer.status_code == 413, answer.text
        assert f"the limit is {MAX_BODY} bytes" in answer.text
    assert engine.client.post("/generate", json=GOOD).status_code == 200


def test_a_streamed_body_and_a_get_body_are_bounded_too(engine) -> None:
    """Without Content-Length the guard counts what arrives; a GET that carries a body (SGLang's
    /weights_checker takes one) is bounded like a POST."""
    json_type = {"content-type": "application/json"}
    chunks = iter([b'{"text": "', b"a" * (MAX_BODY // 2), b"a" * (MAX_BODY // 2 + 10), b'"}'])
    streamed = engine.client.post("/generate", content=chunks, headers=json_type)  # chunked: no length
    assert streamed.status_code == 413 and f"the limit is {MAX_BODY} bytes" in streamed.text
    got = engine.client.request("GET", "/weights_checker", content=b"{" + b" " * (MAX_BODY + 10) + b"}", headers=json_type)
    assert got.status_code == 413, got.text
    not_json = engine.client.request("GET", "/weights_checker", content=b"x=1", headers={"content-type": "text/plain"})
    assert not_json.status_code == 415, not_json.text
    assert engine.client.post("/generate", json=GOOD).status_code == 200


def test_a_huge_text_is_refused_before_it_is_tokenized(engine) -> None:
    """A near-limit text cannot fit the 128-token context by its length alone: a 400 says so at
    once (tokenizing it held the tokenizer for seconds; /health waited 33 s once). Long texts that
    can fit are tokenized off the event loop: packages/miles-engine/tests/test_large_texts.py."""
    text = "hello world " * (MAX_BODY // 13)
    answer = engine.client.post("/generate", json={"text": text})
    assert answer.status_code == 400 and "context length is 128" in answer.text, answer.text
    assert f"'text' has {len(text)} characters" in answer.text
    assert engine.client.get("/health").status_code == 200


def test_session_requests_get_a_400_with_the_reason(session_server) -> None:
    session = session_server.client.post("/sessions").json()
    chat = f"{session['base_url']}/chat/completions"
    hi = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        ({"messages": [{"role": ["user"], "content": "hi"}]}, "'role' must be a string"),
        ({"messages": [{"role": 7, "content": "hi"}]}, "'role' must be a string"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": 5}]}, "tool_calls must be a list"),
        ({"messages": hi, "max_tokens": 2, "min_tokens": 5}, "min_new_tokens"),
        ({"messages": hi, "logit_bias": {"50256": -100}}, "logit_bias is not supported"),
        ({"messages": hi, "tools": [tool] * 129}, "tools"),
        ({"messages": hi * 4097}, "messages"),
        ({"messages": hi, "stop": ["x"] * 65}, "stop"),
        ({"messages": hi, "top_k": 2**63}, "top_k"),
        ({"messages": [{"role": "user", "content": "word " * 400}]}, "context"),  # longer than the context
    ]
    for body, says in cases:
        answer = session_server.client.post(chat, json=body)
        assert answer.status_code == 400, (body.keys(), answer.text[:300])
        assert says in answer.json()["error"]["message"], answer.text[:300]
    assert session_server.client.post(chat, json={"messages": hi, "max_tokens": 2}).status_code == 200


def test_a_request_that_fails_in_a_batched_step_fails_alone(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection (validation now stops every value known to break the sampler): the batched
    draw raises whenever the poisoned request is in the batch; only that request is aborted, its
    batch-mates finish with every token."""
    import miles_engine.scheduler as scheduler

    real = scheduler.sample

    def poisoned(logits, rows, *args, **kwargs):
        if any(row.temperature == 0.777 for row in rows):
            raise RuntimeError("injected sampling fault")
        return real(logits, rows, *args, **kwargs)

    monkeypatch.setattr(scheduler, "sample", poisoned)
    healthy = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
    poison = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 24, "temperature": 0.777}}
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(engine.client.post, "/generate", json=body) for body in (healthy, poison, healthy, healthy)]
        answers = [f.result().json() for f in futures]
    bad = answers.pop(1)
    assert bad["meta_info"]["finish_reason"]["type"] == "abort"
    assert "injected sampling fault" in bad["meta_info"]["finish_reason"]["message"]
    assert all(len(a["output_ids"]) == 24 and a["meta_info"]["finish_reason"]["type"] == "length" for a in answers)


def test_a_paused_engine_is_unhealthy_and_its_waiting_requests_end_with_a_reason(engine) -> None:
    assert engine.client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    try:
        health = engine.client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "paused"
        started = time.monotonic()
        held = engine.client.post("/generate", json=GOOD).json()  # paused_request_timeout is 2 s here
        assert held["meta_info"]["finish_reason"]["type"] == "abort"
        assert "paused_request_timeout" in held["meta_info"]["finish_reason"]["message"]
        assert time.monotonic() - started < 30
    finally:
        engine.client.post("/continue_generation")
    assert engine.client.get("/health").status_code == 200


def test_a_weight_group_nobody_hosts_fails_within_its_timeout(engine) -> None:
    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "group_name": "nobody"}
    answer = engine.client.post("/init_weights_update_group", json=body)  # weight_group_timeout is 2 s here
    assert answer.status_code == 400, answer.text
    assert f"at 127.0.0.1:{port}" in answer.json()["message"] and "after 2 s" in answer.json()["message"]
    hosting = engine.client.post("/init_weights_update_group", json={**body, "rank_offset": 0})
    assert hosting.status_code == 400 and "never does" in hosting.json()["message"]  # an engine never hosts a group
    assert engine.client.get("/health").status_code == 200
