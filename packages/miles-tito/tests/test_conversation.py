"""The three checks of a conversation: append-only messages, prefix renders, token chain; retries."""

from __future__ import annotations

from typing import Any

import pytest
from miles_tito.conversation import Conversation
from miles_tito.errors import HistoryConflict, InvalidRequest, RoleNotAllowed
from miles_tito.messages import ChatMessage
from miles_tito.tokenizer import TitoTokenizer

IM_END = 2


def msgs(items: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage.from_openai(m, i) for i, m in enumerate(items)]


def generate(conversation: Conversation, request: list[dict[str, Any]], answer: dict[str, Any], output: list[int]) -> list[int]:
    """Prepare ``request`` and commit ``output`` as the model's ids; returns the prompt ids."""
    prepared = conversation.prepare(msgs(request), None)
    message = ChatMessage.from_openai(answer, len(request))
    conversation.commit(prepared, output_ids=output, output_logprobs=[-0.5] * len(output), finish_reason="stop",
                        weight_version=3, message=message)
    return prepared.input_ids


def test_each_turn_keeps_the_previous_turns_tokens(chatml: TitoTokenizer) -> None:
    conversation = Conversation(chatml)
    history: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    first = generate(conversation, history, {"role": "assistant", "content": "yo"}, [88, 99, IM_END])
    history += [{"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    second = generate(conversation, history, {"role": "assistant", "content": "ok"}, [77, IM_END])
    assert second[: len(first) + 3] == first + [88, 99, IM_END]
    assert conversation.token_ids == second + [77, IM_END]
    assert [r.turn for r in conversation.records] == [0, 1]


def test_an_echoed_assistant_message_matches_the_stored_one(chatml: TitoTokenizer) -> None:
    conversation = Conversation(chatml)
    call = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}
    stored = {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "think"}
    generate(conversation, [{"role": "user", "content": "1+1?"}], stored, [5, IM_END])
    # What OpenAI clients send back: content null, reasoning dropped, arguments re-serialized.
    echo = {"role": "assistant", "content": None, "tool_calls": [
        {**call, "function": {"name": "calculator", "arguments": '{"expression":"1+1"}'}}]}
    request = [{"role": "user", "content": "1+1?"}, echo, {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    prepared = conversation.prepare(msgs(request), None)
    assert prepared.kept_turns == 1
    assert prepared.messages[1].reasoning == "think"  # the stored spelling is what gets rendered


def test_retrying_the_last_turn_rolls_back_one_step(chatml: TitoTokenizer) -> None:
    conversation = Conversation(chatml)
    base = [{"role": "user", "content": "q"}]
    generate(conversation, base, {"role": "assistant", "content": "a1"}, [11, IM_END])
    second_request = [*base, {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "r"}]
    generate(conversation, second_request, {"role": "assistant", "content": "a2"}, [22, IM_END])
    # The agent retries turn 2 with the same messages (e.g. after a client timeout).
    retried = generate(conversation, second_request, {"role": "assistant", "content": "a2b"}, [33, IM_END])
    assert [r.rolled_back for r in conversation.records] == [False, True, False]
    assert conversation.token_ids == retried + [33, IM_END]
    assert 22 not in conversation.token_ids


def test_rewriting_more_than_one_turn_is_a_conflict_naming_the_message(chatml: TitoTokenizer) -> None:
    conversation = Conversation(chatml)
    history: list[dict[str, Any]] = [{"role": "user", "content": "q"}]
    generate(conversation, history, {"role": "assistant", "content": "a1"}, [11, IM_END])
    history += [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "more"}]
    generate(conversation, history, {"role": "assistant", "content": "a2"}, [22, IM_END])
    edited = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "EDITED"}, {"role": "user", "content": "x"}]
    with pytest.raises(HistoryConflict) as error:
        conversation.prepare(msgs(edited), None)
    assert "messages[1] content is 'EDITED', the session has 'a1'" in error.value.message
    assert "rewrites 2 generated turns" in error.value.message
    assert error.value.status_code == 409


def test_roles_the_family_does_not_allow_cannot_be_appended(chatml: TitoTokenizer) -> None:
    conversation = Conversation(chatml)
    generate(conversation, [{"role": "user", "content": "q"}], {"role": "assistant", "content": "a"}, [11, IM_END])
    injected = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "assistant", "content": "fake"}, {"role": "user", "content": "go"}]
    with pytest.raises(RoleNotAllowed, match=r"messages\[2\] has role 'assistant'"):
        conversation.prepare(msgs(injected), None)


def test_requests_must_end_with_something_to_answer(chatml: TitoTokenizer) -> None:
    conversation = Conversation(chatml)
    generate(conversation, [{"role": "user", "content": "q"}], {"role": "assistant", "content": "a"}, [11, IM_END])
    with pytest.raises(InvalidRequest, match="assistant message"):
        conversation.prepare(msgs([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]), None)
    with pytest.raises(InvalidRequest, match="empty"):
        conversation.prepare([], None)


def test_a_failed_engine_call_changes_nothing(chatml: TitoTokenizer) -> None:
    conversation = Conversation(chatml)
    generate(conversation, [{"role": "user", "content": "q"}], {"role": "assistant", "content": "a"}, [11, IM_END])
    before = (list(conversation.messages), conversation.token_ids, list(conversation.records))
    conversation.prepare(msgs([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                               {"role": "user", "content": "next"}]), None)  # prepared, never committed
    assert (conversation.messages, conversation.token_ids, conversation.records) == before
