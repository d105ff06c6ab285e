"""The OpenAI Responses request (``POST /sessions/{id}/v1/responses``), read into chat messages.

Like the Messages route, a Responses request is translated into what the chat route builds (a list
of :class:`~miles_tito.messages.ChatMessage`, OpenAI chat tool specs, engine sampling), so all
routes run the same turn machinery and record the same token-exact turns:

- ``instructions`` is the first message, role ``system``; it is not part of the conversation a
  response is remembered with, so a continuation (``previous_response_id``) carries the new
  request's instructions, not the old one's (OpenAI's rule);
- ``input`` is a string (one ``user`` message) or a list of items: ``message`` items (role ``user``,
  ``assistant``, ``system`` or ``developer``, which reads as ``system`` as on the chat route;
  content a string or ``input_text`` / ``output_text`` parts, joined), ``function_call`` items,
  ``function_call_output`` items (a ``tool`` message, ``tool_call_id`` = its ``call_id``) and
  ``reasoning`` items;
- consecutive assistant-side items (``reasoning``, an assistant ``message``, ``function_call`` s)
  are one assistant message: reasoning, text, tool calls, which is how a model turn is rendered and
  how the server answers one, so echoing a response's ``output`` back reproduces the recorded turn;
- a ``reasoning`` item's ``content`` texts (or, when it has none, its ``summary`` texts) are the
  assistant's reasoning, which the chat template renders where it has a place for reasoning and
  drops where it has none (the Messages route's rule for ``thinking`` blocks); ``encrypted_content``
  is dropped (OpenAI's, unreadable to an open model);
- ``tools`` are flat (``{"type": "function", "name", "description", "parameters"}``) and become the
  chat route's nested specs, keys in its order (templates render tools as JSON); ``strict`` is
  accepted and dropped (no constrained decoding, no template renders it).

Item keys the SDK echoes (``id``, ``status``, ``annotations``, ``logprobs`` ...) are ignored.
Errors name the field dotted (``input.3.call_id``), with the parameter in ``param``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from miles_contracts.chat import ToolCall
from miles_contracts.wire.engine import SamplingParams
from miles_contracts.wire.session import SessionSampling
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from miles_tito.errors import InvalidRequest
from miles_tito.messages import ChatMessage
from miles_tito.server.schema import MAX_MESSAGES, MAX_TOOLS, ChatCompletionRequest

IGNORED_FIELDS = frozenset({"store", "metadata", "user"})
"""Accepted and ignored: they do not change what is generated."""
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text"})


class FunctionTool(BaseModel):
    """A function the model may call. Built-in tools (``web_search``, ``file_search`` ...) run on
    OpenAI's side: nothing here could run them, so their ``type`` is refused."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # not enforced: the engine has no constrained decoding

    def as_chat(self) -> dict[str, Any]:
        """The chat route's spec, keys in its order, so the same tool renders the same tokens."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextConfig(BaseModel):
    """``text``: only plain text output (no ``json_schema`` / ``json_object``: no constrained decoding)."""

    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint for OpenAI's models; nothing reads it here


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | Annotated[list[Any], Field(max_length=MAX_MESSAGES)]  # the bound is on items, not on a string's length
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=200)
    stream: bool = False
    text: TextConfig | None = None

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [t.as_chat() for t in self.tools] if self.tools else None

    @property
    def parse_tool_calls(self) -> bool:
        return self.tool_choice != "none"

    def sampling(self, defaults: SessionSampling, default_max_tokens: int) -> SamplingParams:
        """The chat route's sampling for the same values, so both routes sample alike."""
        chat = ChatCompletionRequest(messages=[], max_tokens=self.max_output_tokens, temperature=self.temperature,
                                     top_p=self.top_p)
        return chat.sampling(defaults, default_max_tokens)


def parse_responses_request(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    fields = {k: v for k, v in body.items() if k not in IGNORED_FIELDS}
    _check_input(fields.get("input"))
    _refuse_builtin_tools(fields.get("tools"))
    try:
        request = ResponsesRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = _where(error["loc"])
        if error["type"] == "extra_forbidden":
            raise _invalid(where, "unknown parameter (not supported by this server)") from None
        raise _invalid(where, error["msg"]) from None
    text_format = request.text.format if request.text else None
    if text_format is not None and text_format.get("type") != "text":
        raise _invalid("text.format", f"type {text_format.get('type')!r} is not supported; only 'text' "
                                      "(no constrained decoding for json_schema / json_object)")
    if isinstance(request.tool_choice, FunctionChoice):
        names = sorted(t.name for t in request.tools or ())
        if request.tool_choice.name not in names:
            raise _invalid("tool_choice.name", f"{request.tool_choice.name!r} is not one of the request's tools {names}")
    return request


def chat_messages(request: ResponsesRequest, history: Sequence[ChatMessage] = ()) -> tuple[list[ChatMessage], list[ChatMessage]]:
    """``(prompt, conversation)``: the messages the turn renders (instructions first) and the
    conversation without the instructions (``history``, the previous response's, then the input),
    which the response is remembered with for a later ``previous_response_id``."""
    conversation = list(history) + input_messages(request.input, history)
    prompt = ([ChatMessage("system", request.instructions)] if request.instructions is not None else []) + conversation
    return prompt, conversation


def input_messages(items: str | list[Any], history: Sequence[ChatMessage] = ()) -> list[ChatMessage]:
    """``input`` as chat messages (see the module docstring). A ``function_call_output`` must answer
    a call of the assistant message before it (the previous response's, for the first ones)."""
    if isinstance(items, str):
        return [ChatMessage("user", items)]
    reader = _Reader(history[-1] if history else None)
    for index, item in enumerate(items):
        reader.read(item, f"input.{index}")
    return reader.finish()


class _Reader:
    """Reads items in order, gathering consecutive assistant-side items into one assistant message."""

    def __init__(self, last: ChatMessage | None) -> None:
        self.out: list[ChatMessage] = []
        self.open_calls = {c.id for c in last.tool_calls} if last is not None and last.role == "assistant" else set()
        self.reasoning: list[str] = []
        self.texts: list[str] = []
        self.calls: list[ToolCall] = []
        self.pending = False  # an assistant message is being gathered

    def read(self, item: Any, at: str) -> None:
        if not isinstance(item, Mapping):
            raise _invalid(at, f"an input item must be an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, at)
        elif kind == "function_call":
            self.pending = True
            self.calls.append(_function_call(item, at))
        elif kind == "function_call_output":
            self._flush()
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in self.open_calls:
                known = sorted(self.open_calls) or "none"
                raise _invalid(f"{at}.call_id", f"{call_id!r} answers no function_call of the assistant turn before it "
                                                f"(its call ids: {known})")
            self.out.append(ChatMessage("tool", _output_text(item.get("output"), f"{at}.output"), tool_call_id=call_id))
        elif kind == "reasoning":
            if self.texts or self.calls:  # reasoning opens a turn: what was gathered is the one before
                self._flush()
            self.pending = True
            self.reasoning.append(_reasoning_text(item, at))
        else:
            raise _invalid(f"{at}.type", f"item type {kind!r} is not supported; use 'message', 'function_call', "
                                         "'function_call_output' or 'reasoning' (sessions are text-only, tools run "
                                         "on the client)")

    def finish(self) -> list[ChatMessage]:
        self._flush()
        return self.out

    def _message(self, item: Mapping[str, Any], at: str) -> None:
        raw_role = item.get("role")
        role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise _invalid(f"{at}.role", f"must be one of {sorted(_ROLES)}, got {item.get('role')!r}")
        text = _content_text(item.get("content"), f"{at}.content")
        if role != "assistant":
            self._flush()
            self.out.append(ChatMessage(role, text))
            return
        if self.texts or self.calls:  # a second assistant message: a turn of its own
            self._flush()
        self.pending = True
        self.texts.append(text)

    def _flush(self) -> None:
        if not self.pending:
            return
        # an empty reasoning item (OpenAI's carry only encrypted_content) is no reasoning: "" would
        # not match a recorded turn without any, and the history would read as rewritten
        message = ChatMessage("assistant", "".join(self.texts), reasoning="".join(self.reasoning) or None,
                              tool_calls=tuple(self.calls))
        self.out.append(message)
        self.open_calls = {c.id for c in message.tool_calls}
        self.reasoning, self.texts, self.calls, self.pending = [], [], [], False


def _function_call(item: Mapping[str, Any], at: str) -> ToolCall:
    for key in ("call_id", "name"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise _invalid(f"{at}.{key}", "must be a non-empty string")
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise _invalid(f"{at}.arguments", "must be the arguments as a JSON string")
    return ToolCall(name=item["name"], arguments=arguments, id=item["call_id"])


def _reasoning_text(item: Mapping[str, Any], at: str) -> str:
    content = item.get("content")
    if content:
        return _parts_text(content, f"{at}.content", frozenset({"reasoning_text"}))
    return _parts_text(item.get("summary", []), f"{at}.summary", frozenset({"summary_text"}))


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    return _parts_text(content, where, _TEXT_PARTS)


def _output_text(output: Any, where: str) -> str:
    """A ``function_call_output``'s ``output``: a string, or text parts."""
    if isinstance(output, str):
        return output
    return _parts_text(output, where, _TEXT_PARTS)


def _parts_text(parts: Any, where: str, kinds: frozenset[str]) -> str:
    if not isinstance(parts, list):
        raise _invalid(where, f"must be a string or a list of {sorted(kinds)} parts, got {type(parts).__name__}")
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind not in kinds:
            raise _invalid(f"{where}.{k}.type", f"part type {kind!r} is not supported here; use one of {sorted(kinds)} "
                                                "(sessions are text-only)")
        text = part.get("text")
        if not isinstance(text, str):
            raise _invalid(f"{where}.{k}.text", "must be a string")
        texts.append(text)
    return "".join(texts)


def _check_input(items: Any) -> None:
    """``input``'s own errors, in words (pydantic would report its union's first branch: "should be
    a valid string" for a list that is only too long)."""
    if items is None:
        raise _invalid("input", "required: a string or a list of items")
    if not isinstance(items, str | list):
        raise _invalid("input", f"must be a string or a list of items, got {type(items).__name__}")
    if not items:
        raise _invalid("input", "must not be empty")
    if isinstance(items, list) and len(items) > MAX_MESSAGES:
        raise _invalid("input", f"{len(items)} items; a request takes at most {MAX_MESSAGES}")


def _refuse_builtin_tools(tools: Any) -> None:
    """A named 400 for OpenAI's built-in tools, before the generic schema error would bury it."""
    if not isinstance(tools, list):
        return
    for k, tool in enumerate(tools):
        if isinstance(tool, Mapping) and tool.get("type") != "function":
            raise _invalid(f"tools.{k}.type", f"tool type {tool.get('type')!r} is not supported: only 'function' tools "
                                              "(built-in tools run on OpenAI's servers; run them as functions in the agent)")


def _where(loc: Sequence[int | str]) -> str:
    # pydantic names the union member it tried ('str', 'list[any]', 'function-after' ...): not a field
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in ("str", "FunctionChoice"))))


def _invalid(where: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {message}", param=where)
