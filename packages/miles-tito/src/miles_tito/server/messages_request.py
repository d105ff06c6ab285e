"""The Anthropic Messages request (``POST /sessions/{id}/v1/messages``), read into chat messages.

A Messages request is translated into what the chat route builds from an OpenAI request (a list of
:class:`~miles_tito.messages.ChatMessage`, OpenAI-style tool specs, engine sampling), so both routes
run the same turn machinery and record the same token-exact turns:

- ``system`` (a string or text blocks) is the first message, role ``system``;
- a user message's ``tool_result`` blocks become ``tool`` messages (``tool_call_id`` = the block's
  ``tool_use_id``), in order, and its text blocks one ``user`` message after them;
- an assistant message's text blocks are its content, its ``tool_use`` blocks its tool calls (the
  ``input`` object as JSON arguments) and its ``thinking`` blocks its reasoning, which the chat
  template renders where it has a place for reasoning and drops where it has none;
- ``redacted_thinking`` blocks, ``is_error``, ``cache_control`` and ``metadata`` are accepted and
  have no effect on the tokens: no chat template of an open model has a field for them. Other keys
  of a block (``citations``, ``signature``, what newer SDKs add to the blocks they echo) are ignored:
  agents send back the SDK's own objects, and those grow fields.

Errors name the field the way Anthropic does (``messages.2.content.0.tool_use_id``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from miles_contracts.chat import ToolCall
from miles_contracts.wire.engine import SamplingParams
from miles_contracts.wire.session import SessionSampling
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miles_tito.errors import InvalidRequest
from miles_tito.messages import ChatMessage
from miles_tito.server.schema import MAX_MESSAGES, MAX_TOOLS, ChatCompletionRequest

IGNORED_FIELDS = frozenset({"metadata", "service_tier"})
"""Accepted and ignored: they do not change what is generated."""


class AnthropicTool(BaseModel):
    """A client tool: what the model may call, with a JSON Schema of its input."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (web search ...) are Anthropic's own
    cache_control: dict[str, Any] | None = None

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI spec, keys in OpenAI's order: templates render tools as JSON, so the same tool
        must render the same tokens whichever API it came through."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.input_schema
        return {"type": "function", "function": function}


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Any] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[Any] | None = None
    tools: list[AnthropicTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.as_openai() for t in self.tools] if self.tools else None

    @property
    def parse_tool_calls(self) -> bool:
        return self.tool_choice is None or self.tool_choice.type != "none"

    def sampling(self, defaults: SessionSampling, default_max_tokens: int) -> SamplingParams:
        """The chat route's sampling for the same values, so both routes sample alike."""
        chat = ChatCompletionRequest(messages=[], max_tokens=self.max_tokens, temperature=self.temperature,
                                     top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences)
        return chat.sampling(defaults, default_max_tokens)


def parse_messages_request(body: Any) -> MessagesRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        request = MessagesRequest.model_validate({k: v for k, v in body.items() if k not in IGNORED_FIELDS})
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        if error["type"] == "extra_forbidden":
            raise InvalidRequest(f"{where}: unknown parameter", param=where) from None
        raise InvalidRequest(f"{where}: {error['msg']}", param=where) from None
    choice = request.tool_choice
    if choice is not None and choice.type == "tool":
        names = {t.name for t in request.tools or ()}
        if choice.name not in names:
            raise InvalidRequest(f"tool_choice.name: {choice.name!r} is not one of the request's tools {sorted(names)}",
                                 param="tool_choice.name")
    return request


def chat_messages(request: MessagesRequest) -> list[ChatMessage]:
    """The conversation as chat messages (see the module docstring for the mapping)."""
    out: list[ChatMessage] = []
    if request.system is not None:
        out.append(ChatMessage("system", _text(request.system, "system")))
    open_calls: set[str] = set()  # tool_use ids of the previous assistant message
    for index, message in enumerate(request.messages):
        where = f"messages.{index}"
        if not isinstance(message, Mapping):
            raise _invalid(where, f"expected an object with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role == "user":
            out += _user_messages(message.get("content"), where, open_calls)
            open_calls = set()
        elif role == "assistant":
            assistant = _assistant_message(message.get("content"), where)
            out.append(assistant)
            open_calls = {c.id for c in assistant.tool_calls}
        else:
            raise _invalid(f"{where}.role", f"must be 'user' or 'assistant', got {role!r} (the system prompt is "
                                            "the top-level 'system' field)")
    return out


def _user_messages(content: Any, where: str, open_calls: set[str]) -> list[ChatMessage]:
    if isinstance(content, str):
        return [ChatMessage("user", content)]
    out: list[ChatMessage] = []
    texts: list[str] = []
    for k, block in enumerate(_blocks(content, where)):
        at = f"{where}.content.{k}"
        kind = block.get("type")
        if kind == "text":
            texts.append(_block_text(block, at))
        elif kind == "tool_result":
            if texts:
                raise _invalid(at, "tool_result blocks must come before the text of a user message")
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or call_id not in open_calls:
                known = sorted(open_calls) or "none"
                raise _invalid(f"{at}.tool_use_id", f"{call_id!r} answers no tool_use block of the previous "
                                                    f"assistant message (its tool_use ids: {known})")
            if not isinstance(block.get("is_error", False), bool):
                raise _invalid(f"{at}.is_error", "must be a boolean")
            result = block.get("content", "")
            out.append(ChatMessage("tool", _text(result, f"{at}.content"), tool_call_id=call_id))
        else:
            raise _invalid(f"{at}.type", f"block type {kind!r} is not supported in a user message; "
                                         "use 'text' or 'tool_result' (sessions are text-only)")
    if texts or not out:
        out.append(ChatMessage("user", "".join(texts)))
    return out


def _assistant_message(content: Any, where: str) -> ChatMessage:
    if isinstance(content, str):
        return ChatMessage("assistant", content)
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for k, block in enumerate(_blocks(content, where)):
        at = f"{where}.content.{k}"
        kind = block.get("type")
        if kind == "text":
            texts.append(_block_text(block, at))
        elif kind == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise _invalid(f"{at}.thinking", "must be a string")
            thoughts.append(thinking)
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing an open model can read
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
        else:
            raise _invalid(f"{at}.type", f"block type {kind!r} is not supported in an assistant message; "
                                         "use 'text', 'thinking' or 'tool_use'")
    return ChatMessage("assistant", "".join(texts), reasoning="".join(thoughts) if thoughts else None,
                       tool_calls=tuple(calls))


def _tool_use(block: Mapping[str, Any], at: str) -> ToolCall:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise _invalid(f"{at}.{key}", "must be a non-empty string")
    arguments = block.get("input", {})
    if not isinstance(arguments, Mapping):
        raise _invalid(f"{at}.input", f"must be an object, got {type(arguments).__name__}")
    return ToolCall(name=block["name"], arguments=json.dumps(arguments, ensure_ascii=False), id=block["id"])


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if not isinstance(content, list):
        raise _invalid(f"{where}.content", f"must be a string or a list of content blocks, got {type(content).__name__}")
    for k, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise _invalid(f"{where}.content.{k}", "a content block must be an object with a string 'type'")
    return content


def _text(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined (``system``, a ``tool_result``'s content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(where, f"must be a string or a list of text blocks, got {type(content).__name__}")
    parts = []
    for k, block in enumerate(content):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
            raise _invalid(f"{where}.{k}.type", f"block type {kind!r} is not supported here; use 'text' "
                                                "(sessions are text-only)")
        parts.append(_block_text(block, f"{where}.{k}"))
    return "".join(parts)


def _block_text(block: Mapping[str, Any], at: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _invalid(f"{at}.text", "a text block needs a string 'text'")
    return text


def _invalid(where: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {message}", param=where)
