"""The Anthropic Messages route end to end: the official ``anthropic`` client, a real session server
(uvicorn on loopback), the real router and embedded engine (tiny random Llama, subprocesses).

The SDK appends ``/v1/messages`` to its ``base_url``, so it gets the session's ``base_url`` without
its ``/v1``."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest
from miles_contracts.wire.auth import auth_headers
from miles_tito.assembly import assemble
from miles_tito.tokenizer import TitoTokenizer
from tito_support import assert_three_tool_turns_chain, authed, greedy_engine_output, records

pytestmark = pytest.mark.slow

# Greedy, the tiny model answers "\n" first: stopping there gives a turn that ends by a stop sequence.
# The SDK (2.x) has no temperature argument any more; clients of other models send it in extra_body.
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}
STOP_AT_ONCE: dict[str, Any] = {"stop_sequences": ["\n"], **GREEDY}
CALCULATOR = {"name": "calculator", "description": "arithmetic",
              "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}}}


def open_session(server: str) -> tuple[dict[str, Any], anthropic.Anthropic]:
    created = authed.post(f"{server}/sessions").json()
    base_url = created["base_url"].removesuffix("/v1")
    return created, anthropic.Anthropic(base_url=base_url, api_key=created["api_key"], max_retries=0)


def tool_episode(server: str, *, stream: bool) -> tuple[str, list[anthropic.types.Message]]:
    """Three tool-using turns: the model calls the calculator, the user answers 42 each time."""
    created, client = open_session(server)
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "6 * 7?"}]}]
    replies = []
    for _ in range(3):
        request: dict[str, Any] = {"model": "tiny", "max_tokens": 6, "system": "Use tools.", "messages": messages,
                                   "tools": [CALCULATOR], **STOP_AT_ONCE}
        if stream:
            with client.messages.stream(**request) as events:
                reply = events.get_final_message()
        else:
            reply = client.messages.create(**request)
        replies.append(reply)
        call = reply.content[-1]
        assert reply.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "calculator"
        assert call.input == {"expression": "6 * 7"}
        messages.append({"role": "assistant", "content": reply.content})  # the SDK's objects, as its docs do
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "42"}]}]})
    return created["session_id"], replies


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_using_episode_records_the_engines_exact_tokens(
    calls_server: str, router_url: str, chatml: TitoTokenizer, stream: bool
) -> None:
    session_id, replies = tool_episode(calls_server, stream=stream)
    turns = records(calls_server, session_id)
    assert_three_tool_turns_chain(turns, chatml)
    for reply, record in zip(replies, turns, strict=True):
        assert reply.content[-1].id == record.message["tool_calls"][0]["id"]
        assert reply.usage.output_tokens == len(record.output_ids)
        assert reply.usage.input_tokens == len(record.input_ids)
        assert record.output_ids == greedy_engine_output(router_url, record)
    sample = assemble(turns, max_trim_tokens=1)
    assert sample.tokens == turns[-1].input_ids + turns[-1].output_ids
    assert sum(sample.loss_mask) == sum(len(r.output_ids) for r in turns)


def test_the_messages_route_records_the_turns_the_chat_route_records(calls_server: str) -> None:
    """One conversation through both APIs: the same prompt tokens, the same sampled tokens."""
    session_id, _ = tool_episode(calls_server, stream=False)
    via_messages = records(calls_server, session_id)
    created = authed.post(f"{calls_server}/sessions").json()
    url = f"{created['base_url']}/chat/completions"
    tools = [{"type": "function", "function": {"name": CALCULATOR["name"], "description": CALCULATOR["description"],
                                               "parameters": CALCULATOR["input_schema"]}}]
    chat: list[dict[str, Any]] = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "6 * 7?"}]
    for _ in range(3):
        body = {"messages": chat, "tools": tools, "max_tokens": 6, "temperature": 0, "stop": ["\n"]}
        message = authed.post(url, json=body, timeout=120).json()["choices"][0]["message"]
        chat += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "42"}]
    via_chat = records(calls_server, created["session_id"])
    assert [(r.input_ids, r.output_ids) for r in via_messages] == [(r.input_ids, r.output_ids) for r in via_chat]


def test_a_streamed_reply_assembles_into_the_whole_one(chat_server: str) -> None:
    request = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "Hello"}], **GREEDY}
    _, client = open_session(chat_server)
    whole = client.messages.create(**request)
    created, streaming = open_session(chat_server)
    with streaming.messages.stream(**request) as events:
        kinds = [event.type for event in events]
        streamed = events.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    record = records(chat_server, created["session_id"])[0]
    assert streamed.content[0].text == record.message["content"]


def test_thinking_streams_as_a_thinking_block_and_maps_back_onto_the_recorded_reasoning(thinking_server: str) -> None:
    request: dict[str, Any] = {"model": "tiny", "max_tokens": 3, "tools": [CALCULATOR], **GREEDY,
                               "messages": [{"role": "user", "content": "6 * 7?"}]}
    _, client = open_session(thinking_server)
    whole = client.messages.create(**request)
    created, client = open_session(thinking_server)
    with client.messages.stream(**request) as events:
        streamed = events.get_final_message()
    assert [b.type for b in whole.content] == [b.type for b in streamed.content] == ["thinking", "tool_use"]
    assert streamed.content[0].thinking == whole.content[0].thinking == "six times seven"
    call = streamed.content[1]
    request["messages"] += [  # the reply echoed back, thinking block included, as agents do
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in streamed.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "42"}]}]
    client.messages.create(**request)
    first, second = records(thinking_server, created["session_id"])
    assert not first.rolled_back and first.message["reasoning_content"] == "six times seven"
    assert second.input_ids[: len(first.input_ids) + len(first.output_ids)] == first.input_ids + first.output_ids


def test_stop_reasons_max_tokens_and_stop_sequence(chat_server: str) -> None:
    _, client = open_session(chat_server)
    cut = client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "Hi"}], **GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 1
    _, client = open_session(chat_server)
    stopped = client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}], **STOP_AT_ONCE)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "\n")


@pytest.mark.parametrize(("body", "field"), [
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "42"}]}]},
     "messages.2.content.0.tool_use_id"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stop": ["x"]}, "stop"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
])
def test_a_malformed_request_gets_400_in_anthropics_shape_naming_the_field(
    chat_server: str, body: dict[str, Any], field: str
) -> None:
    _, client = open_session(chat_server)
    with pytest.raises(anthropic.BadRequestError) as raised:  # the SDK's own POST: create() checks arguments itself
        client.post("/v1/messages", cast_to=httpx.Response, body=body)
    error = raised.value
    assert error.status_code == 400 and error.response.headers["x-should-retry"] == "false"
    assert error.body["type"] == "error" and error.body["error"]["type"] == "invalid_request_error"
    assert error.body["error"]["message"].startswith(f"{field}:"), error.body


def test_the_session_key_in_x_api_key_reaches_its_own_session_only(chat_server: str) -> None:
    created, client = open_session(chat_server)
    other, _ = open_session(chat_server)
    hello = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert client.messages.create(**hello).role == "assistant"
    bearer = anthropic.Anthropic(base_url=created["base_url"].removesuffix("/v1"), auth_token=created["api_key"], max_retries=0)
    assert bearer.messages.create(**hello).role == "assistant"  # Authorization: Bearer <key> works as well
    stranger = anthropic.Anthropic(base_url=created["base_url"].removesuffix("/v1"), api_key="x" * 43, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as raised:
        stranger.messages.create(**hello)
    assert raised.value.body["error"]["type"] == "authentication_error"
    elsewhere = anthropic.Anthropic(base_url=other["base_url"].removesuffix("/v1"), api_key=created["api_key"], max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        elsewhere.messages.create(**hello)
    key = {"x-api-key": created["api_key"]}  # nor does it open the records or the server's own routes
    assert httpx.get(f"{chat_server}/sessions/{created['session_id']}", headers=key).status_code == 401
    assert httpx.post(f"{chat_server}/sessions", headers=key).status_code == 401
    run_token = {"x-api-key": auth_headers()["Authorization"].removeprefix("Bearer ")}  # the run's token is Bearer-only
    assert httpx.get(f"{chat_server}/server_info", headers=run_token).status_code == 401


def test_a_deleted_sessions_messages_route_answers_not_found(chat_server: str) -> None:
    created, client = open_session(chat_server)
    assert authed.delete(f"{chat_server}/sessions/{created['session_id']}").status_code == 200
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["error"]["type"] == "not_found_error"
