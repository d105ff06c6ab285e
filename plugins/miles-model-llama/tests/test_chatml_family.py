"""The ChatML/SmolLM2 chat family: same text as the stock template, tool-call parsing, registration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from miles_contracts.chat import ChatFamily
from miles_model_llama.chat import CHATML_TEMPLATE, chatml_family, parse_chatml


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from miles_models import resolve_model

    return resolve_model("smollm2-135m-instruct")


def _render(template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    return env.from_string(template).render(messages=messages, tools=None, add_generation_prompt=add_generation_prompt)


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
     {"role": "user", "content": "bye"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "system", "content": "c"},
     {"role": "user", "content": "d é ü 漢字"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_renders_like_the_stock_smollm2_template_without_tools(smollm2: Path, messages: list[dict], generation_prompt: bool) -> None:
    stock = (smollm2 / "chat_template.jinja").read_text()
    assert _render(CHATML_TEMPLATE, messages, generation_prompt) == _render(stock, messages, generation_prompt)


def test_parses_a_list_of_calls_and_keeps_the_text_around_them() -> None:
    parsed = parse_chatml('Let me check.<tool_call>[{"name": "weather", "arguments": {"city": "Paris"}}, '
                          '{"name": "time", "arguments": {}}]</tool_call>')
    assert parsed.format_error is None
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("weather", {"city": "Paris"}), ("time", {})]


def test_parses_single_objects_in_several_blocks_and_quoted_arguments() -> None:
    parsed = parse_chatml('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>\n<tool_call>{"name": "b"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("a", {"x": 1}), ("b", {})]
    assert parsed.content == ""


def test_text_without_calls_is_content() -> None:
    parsed = parse_chatml("The answer is 4.")
    assert (parsed.content, parsed.tool_calls, parsed.format_error) == ("The answer is 4.", (), None)


@pytest.mark.parametrize(("text", "problem"), [
    ('<tool_call>[{"name": "a", "arguments": {]</tool_call>', "not JSON"),
    ('<tool_call>[{"name": "a"}]', "not closed"),
    ('<tool_call>[{"arguments": {}}]</tool_call>', "no 'name'"),
    ('<tool_call>[{"name": "a", "arguments": [1]}]</tool_call>', "must be a JSON object"),
    ("<tool_call>[]</tool_call>", "empty list"),
])
def test_malformed_calls_come_back_as_text_with_a_format_error(text: str, problem: str) -> None:
    parsed = parse_chatml(text)
    assert parsed.tool_calls == ()
    assert parsed.content == text
    assert problem in (parsed.format_error or "")


def test_family_is_registered_and_named_by_the_llama_bridge() -> None:
    from miles.kernel import Kernel

    kernel = Kernel.load()
    family = kernel.chat_families().get("chatml")
    assert isinstance(family, ChatFamily)
    assert family == chatml_family()
    bridge = kernel.model_bridge({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert bridge.chat_family == "chatml"
