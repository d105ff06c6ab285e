"""The session server end to end: the real ``openai`` client, a real session server (uvicorn on
loopback), the real router and embedded engine (tiny random Llama, subprocesses)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from miles_contracts.wire.auth import auth_headers
from miles_contracts.wire.session import SessionView
from miles_tito.assembly import assemble
from miles_tito.tokenizer import TitoTokenizer
from tito_support import (
    LONG_GENERATION,
    always_malformed,
    authed,
    family_with_parser,
    session_server,
    wait_until_generating,
)

pytestmark = pytest.mark.slow

# Greedy, the tiny model answers "\n" first: stopping there gives a turn that ends by a stop.
STOP_AT_ONCE = {"temperature": 0, "stop": ["\n"]}

CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "arithmetic",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}


def open_session(server: str, **body: Any) -> tuple[str, openai.OpenAI]:
    created = authed.post(f"{server}/sessions", json=body or None).json()
    return created["session_id"], openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)


def view(server: str, session_id: str) -> SessionView:
    return SessionView.model_validate(authed.get(f"{server}/sessions/{session_id}").json())


def test_multi_turn_tool_calls_keep_every_turns_tokens(calls_server: str, chatml: TitoTokenizer) -> None:
    session_id, client = open_session(calls_server)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "6 * 7?"}]
    for _ in range(3):
        response = client.chat.completions.create(model="m", messages=messages, tools=[CALCULATOR], max_tokens=6, **STOP_AT_ONCE)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.function.name == "calculator" and call.id.startswith("call_")
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})

    state = view(calls_server, session_id)
    records = state.records
    assert len(records) == 3 and not any(r.rolled_back for r in records)
    for previous, current in zip(records, records[1:], strict=False):
        turn_k = previous.input_ids + previous.output_ids
        assert current.input_ids[: len(turn_k)] == turn_k  # the tokens of turn k are unchanged in turn k+1
        between = chatml.decode(current.input_ids[len(turn_k) :])
        assert between.endswith("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert state.token_ids == records[-1].input_ids + records[-1].output_ids

    sample = assemble(records, max_trim_tokens=state.max_trim_tokens)
    assert sample.tokens == state.token_ids
    assert state.trajectory is not None and state.trajectory_error is None  # GET shows the loss mask too
    assert (state.trajectory.loss_mask, state.trajectory.rollout_logprobs) == (sample.loss_mask, sample.rollout_logprobs)
    assert sum(sample.loss_mask) == sum(len(r.output_ids) for r in records)
    start = len(records[0].input_ids)
    for r in records:  # mask 1 and the engine's log-probs exactly on what each turn sampled
        span = slice(len(r.input_ids) - start, len(r.input_ids) - start + len(r.output_ids))
        assert sample.loss_mask[span] == [1] * len(r.output_ids)
        assert sample.rollout_logprobs[span] == r.output_logprobs
    assert all(lp == 0.0 for m, lp in zip(sample.loss_mask, sample.rollout_logprobs, strict=True) if m == 0)
    assert sample.weight_versions == [r.weight_version for r in records]


def test_streaming_returns_the_same_message_the_session_recorded(calls_server: str) -> None:
    session_id, client = open_session(calls_server)
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=[CALCULATOR], max_tokens=5, stream=True, **STOP_AT_ONCE,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    calls = [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
    finish = [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]
    usage = [chunk.usage for chunk in chunks if chunk.usage]
    record = view(calls_server, session_id).records[0]
    assert finish == ["tool_calls"]
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        (t["id"], t["function"]["name"], t["function"]["arguments"]) for t in record.message["tool_calls"]]
    assert usage[0].completion_tokens == len(record.output_ids) and usage[0].prompt_tokens == len(record.input_ids)


def test_plain_chat_through_the_router_with_logprobs_and_session_defaults(chat_server: str) -> None:
    session_id, client = open_session(chat_server, metadata={"task": 1}, sampling={"max_tokens": 7, "temperature": 0.0})
    response = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}], logprobs=True)
    record = view(chat_server, session_id).records[0]
    assert response.choices[0].finish_reason in ("stop", "length")
    assert len(record.output_ids) <= 7  # the session's default max_tokens applied
    assert [t.logprob for t in response.choices[0].logprobs.content] == record.output_logprobs
    assert response.usage.completion_tokens == len(record.output_ids)
    assert response.choices[0].message.content == record.message["content"]
    again = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}])
    assert again.choices[0].message.content == response.choices[0].message.content  # temperature 0 by default
    state = view(chat_server, session_id)
    assert state.metadata == {"task": 1} and [r.rolled_back for r in state.records] == [True, False]
    assert authed.get(f"{chat_server}/sessions/{session_id}/v1/models").json()["data"][0]["id"] == "tiny"
    info = authed.get(f"{chat_server}/server_info").json()
    assert info["family"] == "chatml" and info["model"] == "tiny" and info["sessions"] >= 1


def test_a_malformed_tool_call_is_text_and_the_turn_is_marked(router_url: str, chatml: TitoTokenizer) -> None:
    tito = TitoTokenizer(chatml.tokenizer, family_with_parser(chatml.family, always_malformed, "malformed"))
    with session_server(router_url, tito) as server:
        session_id, client = open_session(server)
        response = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tools=[CALCULATOR], max_tokens=4)
        record = view(server, session_id).records[0]
    message = response.choices[0].message
    assert response.choices[0].finish_reason in ("stop", "length") and not message.tool_calls
    assert message.content.startswith("<tool_call>")
    if record.finish_reason == "stop":
        assert "not closed" in (record.format_error or "")
        assert assemble([record], max_trim_tokens=1).exit_reason.value == "format_error"
    else:  # cut off by max_tokens: not the model's format mistake
        assert record.format_error is None


def test_100_concurrent_sessions_each_stay_exact(chat_server: str) -> None:
    asyncio.run(_hundred_sessions(chat_server))


async def _hundred_sessions(chat_server: str) -> None:
    async def one(http: httpx.AsyncClient, n: int) -> SessionView:
        session = (await http.post(f"{chat_server}/sessions")).json()
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"count to {n}"}]
        for turn in range(2):
            response = await http.post(f"{session['base_url']}/chat/completions",
                                       json={"model": "m", "messages": messages, "max_tokens": 3, "temperature": 1.0})
            assert response.status_code == 200, response.text
            messages += [response.json()["choices"][0]["message"], {"role": "user", "content": f"again {turn}"}]
        return SessionView.model_validate((await http.delete(f"{chat_server}/sessions/{session['session_id']}")).json())

    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(headers=auth_headers(), timeout=300, limits=limits) as http:
        open_before = (await http.get(f"{chat_server}/server_info")).json()["sessions"]
        views = await asyncio.gather(*(one(http, n) for n in range(100)))
        assert (await http.get(f"{chat_server}/server_info")).json()["sessions"] == open_before  # all deleted
    assert len({v.session_id for v in views}) == 100
    for v in views:
        first, second = v.records
        assert second.input_ids[: len(first.input_ids) + len(first.output_ids)] == first.input_ids + first.output_ids
        assert f"count to {views.index(v)}" in v.messages[0]["content"]


def test_two_racing_requests_on_one_session_are_serialised(chat_server: str) -> None:
    asyncio.run(_racing_requests(chat_server))


async def _racing_requests(chat_server: str) -> None:
    async with httpx.AsyncClient(headers=auth_headers(), timeout=120) as http:
        session = (await http.post(f"{chat_server}/sessions")).json()
        url = f"{session['base_url']}/chat/completions"
        first = (await http.post(url, json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 3})).json()
        body = {"messages": [{"role": "user", "content": "a"}, first["choices"][0]["message"], {"role": "user", "content": "b"}], "max_tokens": 3}
        racing = await asyncio.gather(http.post(url, json=body), http.post(url, json=body))
        assert [r.status_code for r in racing] == [200, 200]
        state = SessionView.model_validate((await http.get(f"{chat_server}/sessions/{session['session_id']}")).json())
    # The second request retried the turn the first produced: one rolled back, the chain intact.
    assert [r.rolled_back for r in state.records] == [False, True, False]
    last, base = state.records[2], state.records[0]
    assert last.input_ids[: len(base.input_ids) + len(base.output_ids)] == base.input_ids + base.output_ids
    assert state.token_ids == last.input_ids + last.output_ids
    assert state.records[1].input_ids == last.input_ids  # both saw the same prompt


def test_delete_waits_for_the_request_in_flight_and_keeps_its_turn(chat_server: str, engine_url: str) -> None:
    asyncio.run(_delete_during_request(chat_server, engine_url))


async def _delete_during_request(chat_server: str, engine_url: str) -> None:
    async with httpx.AsyncClient(headers=auth_headers(), timeout=300) as http:
        session = (await http.post(f"{chat_server}/sessions")).json()
        url = f"{session['base_url']}/chat/completions"
        long = {"messages": [{"role": "user", "content": "write"}], **LONG_GENERATION}
        in_flight = asyncio.create_task(http.post(url, json=long))
        await wait_until_generating(engine_url)
        queued = asyncio.create_task(http.post(url, json=long))
        await asyncio.sleep(0.2)  # the queued request reaches the server and waits for the session lock
        deleted = await http.delete(f"{chat_server}/sessions/{session['session_id']}")
        answered, refused = await in_flight, await queued
        after = await http.post(url, json=long)
    assert deleted.status_code == 200 and answered.status_code == 200
    final = SessionView.model_validate(deleted.json())
    assert len(final.records) == 1 and len(final.records[0].output_ids) == LONG_GENERATION["max_tokens"] and final.closed
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_closing"
    assert after.status_code == 404 and after.json()["error"]["code"] == "session_not_found"
