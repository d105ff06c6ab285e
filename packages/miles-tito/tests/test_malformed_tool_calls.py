"""A tool call the parser cannot read is never dropped silently: each wire API returns the turn as
plain text (no call, a finish reason that is not a tool call), the record keeps the call with status
``malformed`` and its token span, the trajectory sample counts it, and the step's metrics show it.

Real parts: the official ``openai`` and ``anthropic`` SDKs as clients, a real session server on
loopback, the real router and embedded engine (tiny random Llama). The tiny model writes no tool
calls of its own, so the session's chat family reads the second half of every turn as an
unreadable call (its parser, below, is the only stand-in)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest
from miles.loop.rollout import tool_call_metrics
from miles_contracts import Sample
from miles_contracts.chat import ParsedTurn
from miles_contracts.wire.session import TurnRecord
from miles_tito.assembly import assemble
from miles_tito.tokenizer import TitoTokenizer
from tito_support import authed, records, session_server

pytestmark = pytest.mark.slow

CALCULATOR_OPENAI = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
CALCULATOR_ANTHROPIC = {"name": "calculator", "input_schema": {"type": "object"}}
# Seeded sampling as the session's defaults: the same turn every time, whatever the API (greedy,
# the tiny model writes only newlines)
SEEDED: dict[str, Any] = {"max_tokens": 12, "temperature": 1.0, "seed": 11}
MAX_TOKENS = SEEDED["max_tokens"]


def second_half_unreadable(text: str) -> ParsedTurn:
    """The whole text as content, the call that could not be read starting half way through."""
    return ParsedTurn(content=text, format_error="tool call 1 is not JSON", format_error_at=len(text) // 2)


@pytest.fixture(scope="module")
def server(router_url: str, chatml: TitoTokenizer) -> Any:
    family = dataclasses.replace(chatml.family, name="half-unreadable", parse=second_half_unreadable)
    with session_server(router_url, TitoTokenizer(chatml.tokenizer, family)) as url:
        yield url


def stop_after_a_few_characters(send: Callable[[dict[str, Any]], str]) -> str:
    """A stop string that ends the turn ``send(extra)`` samples (seeded: the same every time) after a
    few characters: a turn that hits ``max_tokens`` is cut off, not malformed. ``send`` runs in a
    session of its own and returns the turn's text."""
    text = send({})
    for size in (3, 2, 1):
        stop = text[-size:]
        if len(stop) == size and text.find(stop) > 1:
            return stop
    raise AssertionError(f"the tiny model's seeded answer {text!r} gives no usable stop string")


def new_session(server: str, **sampling: Any) -> dict[str, Any]:
    return authed.post(f"{server}/sessions", json={"sampling": {**SEEDED, **sampling}}).json()


def check_record(record: TurnRecord, tokenizer: Any) -> None:
    assert record.finish_reason == "stop" and record.format_error == "tool call 1 is not JSON"
    [call] = record.malformed_tool_calls
    text = str(record.message["content"])
    at = len(text) // 2
    start, end = call.span
    assert call.status == "malformed" and call.text == text[at:]
    # the span starts at the token that holds the call's first character and covers the rest of the text
    assert len(tokenizer.decode(record.output_ids[:start])) <= at < len(tokenizer.decode(record.output_ids[:start + 1]))
    # (a stop string may end the text inside the span's last token)
    assert text[at:] in tokenizer.decode(record.output_ids[start:end]) and end <= len(record.output_ids)
    sample = assemble([record], max_trim_tokens=1)
    assert sample.exit_reason is not None and sample.exit_reason.value == "format_error"
    prompt = len(record.input_ids)
    assert sample.metadata["tool_calls"] == {"parsed": 0, "malformed": 1, "malformed_calls": [
        {"turn": record.turn, "error": call.error, "span": [start, end]}]}
    assert sample.tokens[prompt + start:prompt + end] == record.output_ids[start:end]
    assert all(sample.loss_mask[start:end])  # the model wrote them: they stay in the loss


def test_chat_completions_returns_the_unreadable_call_as_text(server: str, chatml: TitoTokenizer) -> None:
    def send(extra: dict[str, Any], created: dict[str, Any] | None = None) -> Any:
        created = created or new_session(server)
        client = openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "6 * 7?"}],
                                              tools=[CALCULATOR_OPENAI], max_tokens=MAX_TOKENS, **extra)

    stop = stop_after_a_few_characters(lambda extra: send(extra).choices[0].message.content or "")
    created = new_session(server)
    reply = send({"stop": [stop]}, created)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls and choice.message.content
    [record] = records(server, created["session_id"])
    assert record.message["content"] == choice.message.content
    check_record(record, chatml.tokenizer)


def test_anthropic_messages_returns_the_unreadable_call_as_a_text_block(server: str, chatml: TitoTokenizer) -> None:
    def send(extra: dict[str, Any], created: dict[str, Any] | None = None) -> Any:
        created = created or new_session(server)
        client = anthropic.Anthropic(base_url=created["base_url"].removesuffix("/v1"), api_key=created["api_key"],
                                     max_retries=0)
        return client.messages.create(model="tiny", max_tokens=MAX_TOKENS, tools=[CALCULATOR_ANTHROPIC],
                                      messages=[{"role": "user", "content": "6 * 7?"}], **extra)

    stop = stop_after_a_few_characters(lambda extra: "".join(b.text for b in send(extra).content if b.type == "text"))
    created = new_session(server)
    reply = send({"stop_sequences": [stop]}, created)
    assert reply.stop_reason in ("end_turn", "stop_sequence") and [b.type for b in reply.content] == ["text"]
    [record] = records(server, created["session_id"])
    assert reply.content[0].text == record.message["content"]  # type: ignore[union-attr]
    check_record(record, chatml.tokenizer)


def test_responses_returns_the_unreadable_call_as_output_text(server: str, chatml: TitoTokenizer) -> None:
    def send(extra: dict[str, Any], created: dict[str, Any] | None = None) -> Any:
        created = created or new_session(server)
        client = openai.OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
        return client.responses.create(model="tiny", input="6 * 7?", max_output_tokens=MAX_TOKENS,
                                       tools=[{"type": "function", "name": "calculator", "parameters": {"type": "object"}}])

    stop = stop_after_a_few_characters(lambda extra: send(extra).output_text)
    created = new_session(server, stop=[stop])  # the Responses API has no stop parameter: the session's default
    reply = send({}, created)
    assert [item.type for item in reply.output] == ["message"] and reply.status == "completed"
    [record] = records(server, created["session_id"])
    assert reply.output_text == record.message["content"]
    check_record(record, chatml.tokenizer)


def test_the_step_metrics_count_read_and_unreadable_calls() -> None:
    samples = [Sample(metadata={"tool_calls": {"parsed": 2, "malformed": 1}}),
               Sample(metadata={"tool_calls": {"parsed": 0, "malformed": 2}}), Sample()]
    assert tool_call_metrics(samples) == {"rollout/tool_calls": 2.0, "rollout/tool_calls_malformed": 3.0}
    assert tool_call_metrics([Sample()]) == {}  # no session recorded calls: no new keys
