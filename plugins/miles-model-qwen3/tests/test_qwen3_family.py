"""The Qwen3 chat family: reasoning and hermes tool-call parsing, stock vs fixed template."""

from __future__ import annotations

import json

import pytest
from miles_contracts.chat import ChatFamily
from miles_model_qwen3.chat import parse_qwen3, qwen3_family, split_reasoning, template


def test_splits_reasoning_from_the_answer() -> None:
    parsed = parse_qwen3("<think>\n2 + 2 is 4.\n</think>\n\nThe answer is 4.")
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == ("2 + 2 is 4.", "The answer is 4.", ())


def test_a_turn_cut_off_while_thinking_is_all_reasoning() -> None:
    assert split_reasoning("<think>\nstill going") == ("still going", "")
    assert split_reasoning("no thinking here") == (None, "no thinking here")


def test_parses_hermes_calls_after_thinking() -> None:
    text = ('<think>\nneed weather\n</think>\n\nChecking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "time", "arguments": {"tz": "CET"}}\n</tool_call>')
    parsed = parse_qwen3(text)
    assert parsed.format_error is None
    assert parsed.reasoning == "need weather"
    assert parsed.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("weather", {"city": "Oslo"}), ("time", {"tz": "CET"})]


@pytest.mark.parametrize(("text", "problem"), [
    ('<tool_call>\n{"name": "weather", "arguments": {"city": }\n</tool_call>', "not JSON"),
    ('<tool_call>\n{"name": "weather"', "not closed"),
    ('<tool_call>\n["weather"]\n</tool_call>', "expected a JSON object"),
])
def test_malformed_calls_come_back_as_text_with_a_format_error(text: str, problem: str) -> None:
    parsed = parse_qwen3("<think>\nx\n</think>\n\n" + text)
    assert parsed.tool_calls == ()
    assert parsed.content == text
    assert parsed.reasoning == "x"
    assert problem in (parsed.format_error or "")


def test_family_ships_the_fixed_template_and_keeps_the_stock_one() -> None:
    from miles.kernel import Kernel

    family = Kernel.load().chat_families().get("qwen3")
    assert isinstance(family, ChatFamily)
    assert family.template == template("qwen3_fixed") == qwen3_family().template
    assert family.stock_template == template("qwen3_stock")
    assert family.template != family.stock_template


def test_verify_template_flags_the_stock_template_and_passes_the_fixed_one() -> None:
    # miles-tito is not a dependency of this plugin; the check runs where both are installed.
    verify_template = pytest.importorskip("miles_tito.verify.check").verify_template
    family = qwen3_family()
    stock = verify_template(family.stock_template or "", label="stock", allowed_append_roles=family.allowed_append_roles)
    fixed = verify_template(family.template, label="fixed", allowed_append_roles=family.allowed_append_roles)
    assert not stock.ok
    assert {b.case for b in stock.breaks} >= {"single_tool_call", "thinking", "parallel_tool_calls"}
    assert all(b.role == "assistant" for b in stock.breaks)
    assert fixed.ok, fixed.breaks
    assert fixed.checked == stock.checked > 0
