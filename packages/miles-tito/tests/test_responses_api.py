"""The OpenAI Responses route end to end: the official ``openai`` client
(``OpenAI(base_url=<session base_url>, api_key=<session key>)``), a real session server (uvicorn on
loopback), the real router and embedded engine (tiny random Llama, subprocesses).

The Responses API has no stop strings; the sessions here stop at ``"\\n"`` through their sampling
defaults (greedy, the tiny model answers ``"\\n"`` first), so turns end cleanly as agents' turns do."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from miles_contracts.chat import ParsedTurn
from miles_tito.assembly import assemble
from miles_tito.tokenizer import TitoTokenizer
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from tito_support import (
    assert_three_tool_turns_chain,
    authed,
    family_with_parser,
    greedy_engine_output,
    records,
    session_server,
)

pytestmark = pytest.mark.slow

STOP_AT_ONCE = {"sampling": {"stop": ["\n"], "temperature": 0}}
CALCULATOR = {"type": "function", "name": "calculator", "description": "arithmetic",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}


def answers_42(text: str) -> ParsedTurn:
    """Every turn reads as a sentence (greedy, the tiny model writes only newlines)."""
    return ParsedTurn(content="The answer is 42.")


@pytest.fixture(scope="module")
def answering_server(router_url: str, chatml: TitoTokenizer) -> Iterator[str]:
    tito = TitoTokenizer(chatml.tokenizer, family_with_parser(chatml.family, answers_42, "answers"))
    with session_server(router_url, tito) as url:
        yield url


def open_session(server: str, **options: Any) -> tuple[dict[str, Any], openai.OpenAI]:
    created = authed.post(f"{server}/sessions", json=options).json()
    return created, openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)


def validated(client: openai.OpenAI, request: dict[str, Any]) -> Response:
    """The answer validated against the SDK's type (its client only constructs: a missing field
    would pass unnoticed there)."""
    return Response.model_validate(client.responses.with_raw_response.create(**request).http_response.json())


def validated_events(created: dict[str, Any], request: dict[str, Any]) -> list[str]:
    """The streamed events' types, each event validated against the SDK's event union."""
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    headers = {"Authorization": f"Bearer {created['api_key']}"}
    answer = httpx.post(f"{created['base_url']}/responses", json={**request, "stream": True}, headers=headers, timeout=120)
    datas = [line.removeprefix("data: ") for line in answer.text.splitlines() if line.startswith("data: ")]
    return [adapter.validate_json(data).type for data in datas]


def ask(client: openai.OpenAI, request: dict[str, Any], *, stream: bool) -> Response:
    if not stream:
        return client.responses.create(**request)
    with client.responses.stream(**request) as events:
        return events.get_final_response()


def tool_episode(server: str, *, stream: bool, continuation: bool) -> tuple[str, list[Response]]:
    """Three tool-using turns: the model calls the calculator, the agent answers 42 each time,
    continuing from the previous response's id, or re-sending the whole input (the SDK's own output
    items echoed, as OpenAI's docs do)."""
    created, client = open_session(server, **STOP_AT_ONCE)
    items: list[Any] = [{"role": "user", "content": "6 * 7?"}]
    replies: list[Response] = []
    request: dict[str, Any] = {"model": "tiny", "instructions": "Use tools.", "tools": [CALCULATOR], "max_output_tokens": 6}
    for _ in range(3):
        if continuation and replies:
            reply = ask(client, {**request, "input": items, "previous_response_id": replies[-1].id}, stream=stream)
        else:
            reply = ask(client, {**request, "input": items}, stream=stream)
        replies.append(reply)
        call = reply.output[-1]
        assert reply.status == "completed" and call.type == "function_call" and call.name == "calculator"
        assert call.arguments == '{"expression": "6 * 7"}'
        answer = {"type": "function_call_output", "call_id": call.call_id, "output": "42"}
        items = [answer] if continuation else [*items, *reply.output, answer]
    return created["session_id"], replies


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("continuation", [True, False], ids=["previous_response_id", "full_input"])
def test_a_tool_using_episode_records_the_engines_exact_tokens(
    calls_server: str, router_url: str, chatml: TitoTokenizer, stream: bool, continuation: bool
) -> None:
    session_id, replies = tool_episode(calls_server, stream=stream, continuation=continuation)
    turns = records(calls_server, session_id)
    assert_three_tool_turns_chain(turns, chatml)
    for reply, record in zip(replies, turns, strict=True):
        assert reply.output[-1].call_id == record.message["tool_calls"][0]["id"]
        assert reply.usage is not None and reply.usage.output_tokens == len(record.output_ids)
        assert reply.usage.input_tokens == len(record.input_ids)
        assert record.output_ids == greedy_engine_output(router_url, record)
    sample = assemble(turns, max_trim_tokens=1)
    assert sample.tokens == turns[-1].input_ids + turns[-1].output_ids
    assert sum(sample.loss_mask) == sum(len(r.output_ids) for r in turns)


def test_the_responses_route_records_the_turns_the_chat_route_records(calls_server: str) -> None:
    """One conversation through both APIs: the same prompt tokens, the same sampled tokens."""
    session_id, _ = tool_episode(calls_server, stream=False, continuation=True)
    via_responses = records(calls_server, session_id)
    created = authed.post(f"{calls_server}/sessions", json=STOP_AT_ONCE).json()
    url = f"{created['base_url']}/chat/completions"
    tools = [{"type": "function", "function": {"name": CALCULATOR["name"], "description": CALCULATOR["description"],
                                               "parameters": CALCULATOR["parameters"]}}]
    chat: list[dict[str, Any]] = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "6 * 7?"}]
    for _ in range(3):
        body = {"messages": chat, "tools": tools, "max_tokens": 6}
        message = authed.post(url, json=body, timeout=120).json()["choices"][0]["message"]
        chat += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "42"}]
    via_chat = records(calls_server, created["session_id"])
    assert [(r.input_ids, r.output_ids) for r in via_responses] == [(r.input_ids, r.output_ids) for r in via_chat]


def without_ids(response: Response) -> list[dict[str, Any]]:
    """The output items without their ids (each response names its items afresh)."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k != "id"} for item in response.output]


def test_a_streamed_response_assembles_into_the_whole_one(answering_server: str) -> None:
    request = {"model": "tiny", "max_output_tokens": 5, "input": "Hello"}
    _, client = open_session(answering_server, **STOP_AT_ONCE)
    whole = validated(client, request)
    created, client = open_session(answering_server, **STOP_AT_ONCE)
    with client.responses.stream(**request) as events:
        seen = [(event.type, event.sequence_number) for event in events]
        streamed = events.get_final_response()
    assert streamed.output_text == whole.output_text == "The answer is 42."
    assert without_ids(streamed) == without_ids(whole)
    assert (streamed.status, streamed.usage, streamed.id.startswith("resp_")) == ("completed", whole.usage, True)
    assert [n for _, n in seen] == list(range(len(seen)))
    assert [kind for kind, _ in seen] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    record = records(answering_server, created["session_id"])[0]
    assert streamed.output_text == record.message["content"]
    assert validated_events(open_session(answering_server, **STOP_AT_ONCE)[0], request) == [kind for kind, _ in seen]


def test_function_calls_stream_as_argument_events(calls_server: str) -> None:
    request = {"model": "tiny", "max_output_tokens": 6, "input": "6 * 7?", "tools": [CALCULATOR]}
    _, client = open_session(calls_server, **STOP_AT_ONCE)
    with client.responses.stream(**request) as events:
        kinds = [event.type for event in events]
        streamed = events.get_final_response()
    whole = validated(open_session(calls_server, **STOP_AT_ONCE)[1], request)
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert validated_events(open_session(calls_server, **STOP_AT_ONCE)[0], request) == kinds
    assert [i["type"] for i in without_ids(streamed)] == [i["type"] for i in without_ids(whole)] == ["function_call"]
    assert streamed.output[0].arguments == whole.output[0].arguments == '{"expression": "6 * 7"}'


def test_reasoning_comes_back_as_a_reasoning_item_and_maps_onto_the_recorded_reasoning(thinking_server: str) -> None:
    request: dict[str, Any] = {"model": "tiny", "max_output_tokens": 3, "tools": [CALCULATOR],
                               "input": [{"role": "user", "content": "6 * 7?"}]}
    _, client = open_session(thinking_server, **STOP_AT_ONCE)
    whole = validated(client, request)
    created, client = open_session(thinking_server, **STOP_AT_ONCE)
    streamed = ask(client, request, stream=True)
    assert [i.type for i in whole.output] == [i.type for i in streamed.output] == ["reasoning", "function_call"]
    assert "response.reasoning_text.delta" in validated_events(open_session(thinking_server, **STOP_AT_ONCE)[0], request)
    assert streamed.output[0].content[0].text == whole.output[0].content[0].text == "six times seven"
    call = streamed.output[1]
    request["input"] += [*streamed.output, {"type": "function_call_output", "call_id": call.call_id, "output": "42"}]
    client.responses.create(**request)  # the whole input re-sent, the reasoning item echoed as agents do
    first, second = records(thinking_server, created["session_id"])
    assert not first.rolled_back and first.message["reasoning_content"] == "six times seven"
    assert second.input_ids[: len(first.input_ids) + len(first.output_ids)] == first.input_ids + first.output_ids


def test_max_output_tokens_makes_the_response_incomplete(chat_server: str) -> None:
    _, client = open_session(chat_server)
    cut = validated(client, {"model": "tiny", "input": "Hi", "max_output_tokens": 1, "temperature": 0})
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.usage is not None and cut.usage.output_tokens == 1
    _, client = open_session(chat_server)
    events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=1, temperature=0, stream=True))
    last = events[-1]  # a cut turn ends in response.incomplete, as OpenAI streams it
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert without_ids(last.response) == without_ids(cut) and last.response.output_text == cut.output_text
    cut_request = {"model": "tiny", "input": "Hi", "max_output_tokens": 1, "temperature": 0}
    assert validated_events(open_session(chat_server)[0], cut_request)[-1] == "response.incomplete"
    _, client = open_session(chat_server, **STOP_AT_ONCE)
    done = client.responses.create(model="tiny", input="Hi", max_output_tokens=8)
    assert (done.status, done.incomplete_details) == ("completed", None)


def test_an_unknown_previous_response_id_is_a_400_naming_it(chat_server: str) -> None:
    _, client = open_session(chat_server)
    first = client.responses.create(model="tiny", input="Hi", max_output_tokens=1)
    _, other = open_session(chat_server)
    for id_, session in [("resp_nope", client), (first.id, other)]:  # never made, or another session's
        with pytest.raises(openai.BadRequestError) as raised:
            session.responses.create(model="tiny", input="again", max_output_tokens=1, previous_response_id=id_)
        assert raised.value.param == "previous_response_id" and id_ in raised.value.message


def test_a_session_remembers_only_its_latest_responses(chat_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The map behind previous_response_id is bounded (a session key must not grow it without end);
    the bound is lowered here so that the test needs four turns, not sixty-five."""
    from miles_tito.server import service

    monkeypatch.setattr(service, "RESPONSES_KEPT", 3)
    _, client = open_session(chat_server, **STOP_AT_ONCE)
    ids = [client.responses.create(model="tiny", input="Hi", max_output_tokens=2).id]
    for _ in range(3):
        ids.append(client.responses.create(model="tiny", input="on", max_output_tokens=2, previous_response_id=ids[-1]).id)
    with pytest.raises(openai.BadRequestError) as raised:  # the oldest fell out of the map
        client.responses.create(model="tiny", input="on", max_output_tokens=2, previous_response_id=ids[0])
    assert raised.value.param == "previous_response_id"
    retried = client.responses.create(model="tiny", input="on", max_output_tokens=2, previous_response_id=ids[2])
    assert retried.status == "completed"  # a kept one that is not the latest: its next turn is generated again


@pytest.mark.parametrize(("body", "field"), [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_x", "output": "42"}]},
     "input.1.call_id"),
    ({"input": [{"role": "assistant", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                          "arguments": {"a": 1}}]}, "input.1.arguments"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "tools": [CALCULATOR], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": []}, "input"),
])
def test_a_malformed_request_gets_400_naming_the_field(chat_server: str, body: dict[str, Any], field: str) -> None:
    _, client = open_session(chat_server)
    with pytest.raises(openai.BadRequestError) as raised:  # the SDK's own POST: its types would refuse some bodies
        client.post("/responses", cast_to=httpx.Response, body={"model": "tiny", **body})
    error = raised.value
    assert error.status_code == 400 and error.response.headers["x-should-retry"] == "false"
    assert error.param == field and error.body["message"].startswith(f"{field}:"), error.body


def test_a_deleted_sessions_responses_route_answers_not_found(chat_server: str) -> None:
    created, client = open_session(chat_server)
    assert authed.delete(f"{chat_server}/sessions/{created['session_id']}").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="hi", max_output_tokens=2)
