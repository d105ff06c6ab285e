"""The checks of a conversation: repeated messages, prefix renders, token chain; retries. The
graph's forks and branches: test_trajectory_graph.py."""

from __future__ import annotations

from typing import Any

import pytest
from miles_tito.conversation import Conversation
from miles_tito.errors import InvalidRequest, RoleNotAllowed
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
    assert prepared.base is conversation.head and prepared.fork is None
    assert prepared.messages[1].reasoning == "think"  # the stored spelling is what gets rendered


def test_retrying_the_last_turn_keeps_the_attempt_on_a_retried_branch(chatml: TitoTokenizer) -> None:
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
    # the new attempt continues the first branch; the abandoned one is branch 1, marked retried
    assert [r.branch for r in conversation.records] == [0, 1, 0]
    assert [(b.cause, b.retried, b.parent_branch, b.fork_turn) for b in conversation.branches] == [
        ("root", False, None, None), ("retry", True, 0, 0)]


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
