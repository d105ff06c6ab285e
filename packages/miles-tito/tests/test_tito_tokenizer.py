"""The TITO tokenizer: first turn, appended messages, splice rules, the render-level check."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from miles_tito.errors import TemplateNotPrefixInvariant
from miles_tito.messages import ChatMessage
from miles_tito.tokenizer import TitoTokenizer

IM_END, NEWLINE, ENDOFTEXT = 2, 198, 0


def msgs(*items: dict[str, Any]) -> list[ChatMessage]:
    return [ChatMessage.from_openai(m, i) for i, m in enumerate(items)]


def test_first_turn_is_the_tokenized_template(chatml: TitoTokenizer, tokenizer: Any) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert chatml.first_turn_ids(msgs(*conversation), None) == tokenizer.encode(expected, add_special_tokens=False)


def test_appended_messages_extend_the_models_own_ids(chatml: TitoTokenizer, tokenizer: Any) -> None:
    history = msgs({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"})
    prompt = chatml.first_turn_ids(history[:1], None)
    # The model's ids for its answer need not be the canonical tokenization of its text: TITO keeps them.
    sampled = tokenizer.encode("hel", add_special_tokens=False) + tokenizer.encode("lo", add_special_tokens=False) + [IM_END]
    ids, trimmed = chatml.appended_ids(history, prompt + sampled, msgs({"role": "user", "content": "bye"}), None)
    assert trimmed == 0
    assert ids[: len(prompt) + len(sampled)] == prompt + sampled
    assert ids[len(prompt) + len(sampled)] == NEWLINE  # the splice closes the turn as the template does
    tail = tokenizer.decode(ids[len(prompt) + len(sampled) :])
    assert tail == "\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n"


def test_splice_closes_truncated_turns_and_replaces_endoftext(chatml: TitoTokenizer) -> None:
    assert chatml.splice([5, 6, IM_END]) == ([5, 6, IM_END, NEWLINE], 0)
    assert chatml.splice([5, 6, IM_END, NEWLINE]) == ([5, 6, IM_END, NEWLINE], 0)
    assert chatml.splice([5, 6]) == ([5, 6, IM_END, NEWLINE], 0)  # cut off by the length limit
    assert chatml.splice([5, 6, ENDOFTEXT]) == ([5, 6, IM_END, NEWLINE], 1)
    assert chatml.splice([5, ENDOFTEXT, ENDOFTEXT]) == ([5, ENDOFTEXT, IM_END, NEWLINE], 1)  # at most max_trim_tokens


def test_window_and_full_render_checks_give_the_same_ids(tokenizer: Any, qwen3: TitoTokenizer) -> None:
    full = TitoTokenizer(tokenizer, qwen3.family, render_check="full")
    history = msgs(
        {"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"}, {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    )
    appended = msgs({"role": "tool", "tool_call_id": "c", "content": "42"}, {"role": "tool", "tool_call_id": "d", "content": "43"})
    base = [7, 8, 9, IM_END]
    assert qwen3.appended_ids(history, base, appended, None) == full.appended_ids(history, base, appended, None)


def test_a_template_that_rerenders_history_is_refused_naming_the_message(tokenizer: Any, qwen3: TitoTokenizer) -> None:
    stock = TitoTokenizer(tokenizer, dataclasses.replace(qwen3.family, template=qwen3.family.stock_template or ""))
    history = msgs({"role": "user", "content": "Is 91 prime?"}, {"role": "assistant", "content": "No.", "reasoning_content": "7 * 13"})
    with pytest.raises(TemplateNotPrefixInvariant) as error:
        stock.appended_ids(history, [1, 2, IM_END], msgs({"role": "user", "content": "And 97?"}), None)
    assert "messages[1] (assistant)" in error.value.message
    assert error.value.status_code == 422
    # The fixed template keeps the reasoning of earlier turns, so the same request is fine.
    ids, _ = qwen3.appended_ids(history, [1, 2, IM_END], msgs({"role": "user", "content": "And 97?"}), None)
    assert ids[:4] == [1, 2, IM_END, NEWLINE]


def test_stop_tokens_must_exist_in_the_tokenizer(tokenizer: Any, chatml: TitoTokenizer) -> None:
    foreign = dataclasses.replace(chatml.family, stop_tokens=("<|eot_id|>",))
    with pytest.raises(ValueError, match="does not fit this model"):
        TitoTokenizer(tokenizer, foreign)
