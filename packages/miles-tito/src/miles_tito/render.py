"""Rendering chat templates with Jinja, the way Hugging Face tokenizers do, without a tokenizer.

Same environment as ``transformers``' ``apply_chat_template`` (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that keeps non-ASCII text), so a template renders
here exactly as it does there. Compiled once per template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRenderError(ValueError):
    """The template raised while rendering (``raise_exception`` or a Jinja error)."""


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatRenderer:
    """``render(messages, tools, add_generation_prompt) -> str`` for one compiled template.

    :param template: Jinja source.
    :param template_kwargs: variables every render gets (a family's fixed kwargs).
    """

    def __init__(self, template: str, template_kwargs: Mapping[str, Any] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(template)
        except TemplateError as exc:
            raise TemplateRenderError(f"the chat template does not compile: {exc}") from exc
        self.source = template
        self.template_kwargs = dict(template_kwargs or {})

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        add_generation_prompt: bool,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        variables = {**(extra or {}), **self.template_kwargs}
        try:
            return self._template.render(
                messages=messages, tools=list(tools) if tools else None, add_generation_prompt=add_generation_prompt, **variables
            )
        except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise TemplateRenderError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from exc


def message_at(rendered: str, contents: Sequence[str], offset: int) -> int:
    """Index of the message whose rendering holds character ``offset`` of ``rendered``.

    Finds each message's content in order and picks the first one whose content ends at or after
    ``offset`` (template text before a content belongs to that message). Position-dependent
    templates make exact attribution impossible in general; this is right for role headers,
    reasoning blocks and content, which is where templates differ.
    """
    cursor = 0
    for index, content in enumerate(contents):
        found = rendered.find(content, cursor) if content else -1
        end = found + len(content) if found >= 0 else cursor
        if end >= offset and (content or index == len(contents) - 1):
            return index
        cursor = max(cursor, end)
    return max(0, len(contents) - 1)


def first_difference(a: str, b: str) -> int:
    """Offset of the first character where ``a`` and ``b`` differ (the shorter length if none)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
