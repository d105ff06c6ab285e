"""The ChatML chat family of SmolLM2 (and other Llama-architecture ChatML models), for TITO.

SmolLM2's stock template is plain ChatML with a default system prompt and no tool support. The
family's template renders exactly the same text for conversations without tools (tested against
the stock one) and adds tools the way SmolLM2 was trained to call them: the functions listed in the
system message, calls as a JSON list inside ``<tool_call>...</tool_call>``, results as ``tool``
turns. Every message renders independently of what follows it, so the template is prefix-invariant.

Turn end: ``<|im_end|>\\n``; the model stops at ``<|im_end|>`` (the tokenizer's EOS), TITO appends
the newline. A turn that ends in ``<|endoftext|>`` instead has that token replaced by ``<|im_end|>``
(one trimmed token).
"""

from __future__ import annotations

import json
import re

from miles_contracts.chat import ChatFamily, ParsedTurn, ToolCall, tool_call_from_payload, unclosed_call_at

CHATML_TEMPLATE = r"""
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_text = messages[0].content or '' -%}
    {%- set rest = messages[1:] -%}
{%- else -%}
    {%- set system_text = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}
    {%- set rest = messages -%}
{%- endif -%}
{{- '<|im_start|>system\n' + system_text -}}
{%- if tools -%}
    {{- '\n\nYou can call these functions:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\nTo call functions, answer with a JSON list of calls inside <tool_call></tool_call> tags, '
        + 'for example <tool_call>[{"name": "get_time", "arguments": {"city": "Paris"}}]</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for message in rest -%}
    {{- '<|im_start|>' + message.role + '\n' + (message.content or '') -}}
    {%- if message.role == 'assistant' and message.tool_calls -%}
        {{- '<tool_call>[' -}}
        {%- for call in message.tool_calls -%}
            {%- if not loop.first -%}{{- ', ' -}}{%- endif -%}
            {{- '{"name": ' + (call.function.name | tojson) + ', "arguments": ' -}}
            {%- if call.function.arguments is string -%}
                {{- call.function.arguments -}}
            {%- else -%}
                {{- call.function.arguments | tojson -}}
            {%- endif -%}
            {{- '}' -}}
        {%- endfor -%}
        {{- ']</tool_call>' -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


def parse_chatml(text: str) -> ParsedTurn:
    """Split a SmolLM2 turn into content and tool calls (``<tool_call>[{...}, ...]</tool_call>``).

    A block may hold one call object or a list of them; several blocks are allowed. Anything
    malformed returns the whole text as content with ``format_error`` set.
    """
    if _OPEN not in text:
        return ParsedTurn(content=text)
    blocks = list(_CALL_BLOCK.finditer(text))
    if len(blocks) != text.count(_OPEN):
        return ParsedTurn(content=text, format_error="a <tool_call> tag is not closed by </tool_call>",
                          format_error_at=unclosed_call_at(text, blocks, _OPEN))
    calls: list[ToolCall] = []
    for number, block in enumerate(blocks, start=1):
        try:
            payload = json.loads(block.group(1))
        except json.JSONDecodeError as exc:
            return ParsedTurn(content=text, format_error=f"tool call block {number} is not JSON: {exc.msg} at char {exc.pos}",
                              format_error_at=block.start())
        items = payload if isinstance(payload, list) else [payload]
        if not items:
            return ParsedTurn(content=text, format_error=f"tool call block {number} is an empty list",
                              format_error_at=block.start())
        for item in items:
            try:
                calls.append(tool_call_from_payload(item))
            except ValueError as exc:
                return ParsedTurn(content=text, format_error=f"tool call block {number}: {exc}", format_error_at=block.start())
    content = _CALL_BLOCK.sub("", text).strip()
    return ParsedTurn(content=content, tool_calls=tuple(calls))


def chatml_family() -> ChatFamily:
    return ChatFamily(
        name="chatml",
        template=CHATML_TEMPLATE,
        parse=parse_chatml,
        turn_end="<|im_end|>\n",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        allowed_append_roles=frozenset({"user", "tool", "system"}),
        trim_trailing=("<|endoftext|>",),
        max_trim_tokens=1,
        model_types=("llama",),
        description="ChatML as SmolLM2 uses it, with tools as a JSON list in <tool_call> tags",
    )
