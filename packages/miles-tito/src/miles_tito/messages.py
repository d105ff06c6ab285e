"""Chat messages as TITO sees them: read from OpenAI request JSON, compared, handed to templates.

A client re-sends the whole history every turn, usually rebuilt from the responses it got (the
OpenAI SDK echoes ``content: null`` next to tool calls, drops ``reasoning_content``, may re-serialize
arguments). :meth:`ChatMessage.matches` therefore compares what changes the rendering and treats
those spellings as equal; the stored spelling is the one that gets rendered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles import bounded_json
from miles_contracts.chat import ROLES, ToolCall

_ROLE_ALIASES = {"developer": "system"}


class MessageError(ValueError):
    """A request message is malformed. ``index`` is its position in the request."""

    def __init__(self, index: int, message: str) -> None:
        self.index = index
        super().__init__(f"messages[{index}]: {message}")


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message. ``template_view`` is the dict a chat template receives (built once)."""

    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    template_view: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "template_view", self._template_view())

    # ------------------------------------------------------------------ reading

    @classmethod
    def from_openai(cls, data: Any, index: int) -> ChatMessage:
        if not isinstance(data, Mapping):
            raise MessageError(index, f"expected an object with 'role' and 'content', got {type(data).__name__}")
        if not isinstance(data.get("role"), str):
            raise MessageError(index, f"'role' must be a string, got {type(data.get('role')).__name__}")
        role = _ROLE_ALIASES.get(data["role"], data["role"])
        if role not in ROLES:
            raise MessageError(index, f"unknown role {data.get('role')!r}; use one of {sorted(ROLES | set(_ROLE_ALIASES))}")
        content = _content_text(data.get("content"), index)
        raw_calls = data.get("tool_calls") or ()
        if not isinstance(raw_calls, list | tuple):
            raise MessageError(index, f"tool_calls must be a list, got {type(raw_calls).__name__}")
        tool_calls = tuple(_tool_call(c, index, k) for k, c in enumerate(raw_calls))
        if tool_calls and role != "assistant":
            raise MessageError(index, f"only assistant messages carry tool_calls, this one has role {role!r}")
        reasoning = data.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise MessageError(index, "reasoning_content must be a string")
        tool_call_id = data.get("tool_call_id")
        if tool_call_id is not None and not isinstance(tool_call_id, str):
            raise MessageError(index, "tool_call_id must be a string")
        name = data.get("name")
        return cls(role, content, reasoning or None, tool_calls, tool_call_id, name if isinstance(name, str) else None)

    @classmethod
    def list_from_openai(cls, messages: Any) -> list[ChatMessage]:
        if not isinstance(messages, list) or not messages:
            raise MessageError(0, "'messages' must be a non-empty list")
        return [cls.from_openai(m, i) for i, m in enumerate(messages)]

    # ------------------------------------------------------------------ comparing

    def matches(self, stored: ChatMessage) -> bool:
        """Whether this (request) message is the ``stored`` one as a client echoes it back: its
        content may differ in whitespace (clients strip and re-flow text), its tool calls'
        arguments in JSON layout and their ids, and it may drop the reasoning."""
        if self.role != stored.role or (self.content != stored.content and _words(self.content) != _words(stored.content)):
            return False
        if self.reasoning is not None and self.reasoning != stored.reasoning \
                and _words(self.reasoning) != _words(stored.reasoning or ""):
            return False
        if self.tool_call_id and stored.tool_call_id and self.tool_call_id != stored.tool_call_id:
            return False
        if len(self.tool_calls) != len(stored.tool_calls):
            return False
        return all(
            a.name == b.name and _same_arguments(a.arguments, b.arguments)
            for a, b in zip(self.tool_calls, stored.tool_calls, strict=True)
        )

    def looks_like(self, stored: ChatMessage) -> bool:
        """Whether the two differ only where :meth:`matches` is strict but a client plausibly
        re-spelled the message: whitespace anywhere (inside words too), reasoning, tool-call ids. A
        request that forks on such a difference is counted as a ``spurious`` fork
        (:mod:`miles_tito.conversation`): a client habit to learn about."""
        if self.role != stored.role or "".join(self.content.split()) != "".join(stored.content.split()):
            return False
        if len(self.tool_calls) != len(stored.tool_calls):
            return False
        return all(a.name == b.name and "".join(a.arguments.split()) == "".join(b.arguments.split())
                   or _same_arguments(a.arguments, b.arguments)
                   for a, b in zip(self.tool_calls, stored.tool_calls, strict=True))

    def difference(self, stored: ChatMessage) -> str:
        """What differs from ``stored``, in words (for error messages)."""
        if self.role != stored.role:
            return f"role is {self.role!r}, the session has {stored.role!r}"
        if self.content != stored.content:
            return f"content is {_clip(self.content)!r}, the session has {_clip(stored.content)!r}"
        if self.reasoning is not None and self.reasoning != stored.reasoning:
            return "reasoning_content differs from the session's"
        if len(self.tool_calls) != len(stored.tool_calls):
            return f"has {len(self.tool_calls)} tool calls, the session has {len(stored.tool_calls)}"
        return "tool calls or tool_call_id differ from the session's"

    # ------------------------------------------------------------------ writing

    def to_openai(self) -> dict[str, Any]:
        """The message as OpenAI JSON (what a response carries and a client echoes)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.role == "assistant" and self.tool_calls:
            out["content"] = self.content or None
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def _template_view(self) -> dict[str, Any]:
        view: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            view["reasoning_content"] = self.reasoning
        if self.tool_calls:
            view["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments_view(c.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            view["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            view["name"] = self.name
        return view


def template_views(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    return [m.template_view for m in messages]


# ---------------------------------------------------------------------------- helpers


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise MessageError(index, f"content part of type {kind!r} is not supported: sessions are text-only")
            parts.append(part["text"])
        return "".join(parts)
    raise MessageError(index, f"content must be a string, a list of text parts or null, got {type(content).__name__}")


def _tool_call(data: Any, index: int, k: int) -> ToolCall:
    function = data.get("function") if isinstance(data, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise MessageError(index, f"tool_calls[{k}] must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, Mapping):
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise MessageError(index, f"tool_calls[{k}].function.arguments must be a JSON string")
    call_id = data.get("id") or ""
    return ToolCall(name=function["name"], arguments=arguments, id=call_id if isinstance(call_id, str) else "")


def _arguments_view(arguments: str) -> Any:
    """Templates expect arguments as a mapping; keep the text when it is not a JSON object."""
    try:
        parsed = bounded_json.loads(arguments)
    except ValueError:  # not JSON, or nested too deeply to hand a template (json.loads overflowed: a 500)
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def _words(text: str) -> list[str]:
    return text.split()


def _same_arguments(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return bool(bounded_json.loads(a) == bounded_json.loads(b))
    except ValueError:
        return False


def _clip(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
