"""The Qwen3 chat family for TITO: ChatML turns, ``<think>`` reasoning, hermes-style tool calls.

The model thinks inside ``<think>...</think>`` at the start of its turn, then answers; each tool call
is its own block ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; tool results come
back grouped in one user turn as ``<tool_response>`` blocks.

Two templates ship in ``templates/``: ``qwen3_stock.jinja`` reproduces the upstream template's
history rules, which break prefix invariance (see its header), and ``qwen3_fixed.jinja`` is the one
TITO renders with. ``miles verify-template qwen3 --stock`` shows the difference.
"""

from __future__ import annotations

import json
import re
from importlib import resources

from miles_contracts.chat import ChatFamily, ParsedTurn, ToolCall, tool_call_from_payload, unclosed_call_at

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_CALL_OPEN = "<tool_call>"
_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def template(name: str) -> str:
    """Text of a bundled template: ``"qwen3_fixed"`` or ``"qwen3_stock"``."""
    return resources.files("miles_model_qwen3").joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


def split_reasoning(text: str) -> tuple[str | None, str]:
    """``(reasoning, rest)``. A turn cut off inside ``<think>`` is all reasoning and no answer."""
    if _THINK_CLOSE in text:
        head, _, rest = text.partition(_THINK_CLOSE)
        return head.split(_THINK_OPEN, 1)[-1].strip("\n"), rest.lstrip("\n")
    stripped = text.lstrip()
    if stripped.startswith(_THINK_OPEN):
        return stripped[len(_THINK_OPEN) :].strip("\n"), ""
    return None, text


def parse_qwen3(text: str) -> ParsedTurn:
    """Split a Qwen3 turn into reasoning, content and hermes tool calls; never raises."""
    reasoning, rest = split_reasoning(text)
    if _CALL_OPEN not in rest:
        return ParsedTurn(content=rest, reasoning=reasoning)
    blocks = list(_CALL_BLOCK.finditer(rest))
    offset = len(text) - len(rest)  # ``rest`` is the end of ``text`` (after the thinking)
    if len(blocks) != rest.count(_CALL_OPEN):
        return ParsedTurn(content=rest, reasoning=reasoning, format_error="a <tool_call> tag is not closed by </tool_call>",
                          format_error_at=offset + unclosed_call_at(rest, blocks, _CALL_OPEN))
    calls: list[ToolCall] = []
    for number, block in enumerate(blocks, start=1):
        try:
            calls.append(tool_call_from_payload(json.loads(block.group(1))))
        except json.JSONDecodeError as exc:
            error = f"tool call {number} is not JSON: {exc.msg} at char {exc.pos}"
            return ParsedTurn(content=rest, reasoning=reasoning, format_error=error, format_error_at=offset + block.start())
        except ValueError as exc:
            return ParsedTurn(content=rest, reasoning=reasoning, format_error=f"tool call {number}: {exc}",
                              format_error_at=offset + block.start())
    return ParsedTurn(content=_CALL_BLOCK.sub("", rest).strip(), reasoning=reasoning, tool_calls=tuple(calls))


def qwen3_family() -> ChatFamily:
    return ChatFamily(
        name="qwen3",
        template=template("qwen3_fixed"),
        stock_template=template("qwen3_stock"),
        parse=parse_qwen3,
        turn_end="<|im_end|>\n",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        allowed_append_roles=frozenset({"user", "tool", "system"}),
        trim_trailing=("<|endoftext|>",),
        max_trim_tokens=1,
        model_types=("qwen3", "qwen3_moe"),
        description="Qwen3: <think> reasoning, hermes <tool_call> JSON, history thinking kept (fixed template)",
    )
