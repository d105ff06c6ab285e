"""Chat families: what a model plugin tells the token-in-token-out (TITO) layer about its chat format.

A model plugin registers one :class:`ChatFamily` per chat format through
``miles_register_chat_families`` (``register("chatml", family)``). The family is plain data plus a
parser, so a model plugin implements it without depending on ``miles-tito``:

* ``template``: the Jinja chat template TITO renders with. It must be *prefix-invariant* at every
  point right after an assistant message: rendering a conversation, then rendering it again with
  more messages appended, must only add text at the end (``miles verify-template`` checks this).
  Where a model's stock template is not, the plugin ships a fixed one and keeps the stock one in
  ``stock_template`` for reference.
* splice rules: ``turn_end`` is the text the template writes after an assistant message (ChatML:
  ``"<|im_end|>\\n"``). A model usually stops *inside* it (after ``<|im_end|>``), so TITO appends
  the part of ``turn_end`` the model did not emit before the next messages' tokens.
  ``trim_trailing`` lists tokens the model may emit at the end of a turn that the template replaces
  when the conversation goes on (a stop token that doubles as the next role's opener); TITO drops
  at most ``max_trim_tokens`` of them.
* ``allowed_append_roles``: roles a client may append after an assistant turn.
* ``parse``: turns the decoded text of one assistant turn into content, reasoning and tool calls.
  A malformed tool call is never an exception: the parser returns the text as content and says what
  was wrong in ``format_error``.

Nothing here imports a tokenizer or Jinja; templates are strings.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ROLES = frozenset({"system", "user", "assistant", "tool"})
"""Roles a chat message may have (OpenAI's ``developer`` is read as ``system``)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the model made.

    :ivar name: function name.
    :ivar arguments: the arguments as JSON text (OpenAI's wire form), exactly as parsed.
    :ivar id: call id; parsers leave it empty and the server assigns one.
    """

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    """An assistant turn's text split into its parts.

    :ivar content: the answer text without reasoning and tool-call markup (or the whole text when a
        tool call was malformed).
    :ivar reasoning: the thinking text, when the family has a reasoning format and the model used it.
    :ivar tool_calls: well-formed tool calls, in order.
    :ivar format_error: why the text looked like a tool call but could not be parsed, else None.
    :ivar format_error_at: where in the parsed text the call that could not be read starts (a
        character offset), when the parser knows; the server turns it into the call's token span.
        None with a ``format_error``: the whole turn is taken as the malformed call.
    """

    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    format_error: str | None = None
    format_error_at: int | None = None


TurnParser = Callable[[str], ParsedTurn]
"""``parse(text) -> ParsedTurn``; never raises for any model output."""


@dataclass(frozen=True, slots=True)
class ChatFamily:
    """Everything TITO needs to know about one chat format.

    :ivar name: registered name (``tito.family``).
    :ivar template: Jinja source of the (prefix-invariant) template TITO renders with. It receives
        ``messages`` (OpenAI-style dicts; an assistant's ``reasoning_content`` and ``tool_calls``
        with ``function.arguments`` as a mapping when it is a JSON object), ``tools`` (OpenAI tool
        specs or None), ``add_generation_prompt`` and ``template_kwargs``.
    :ivar parse: splits one assistant turn's decoded text (see :data:`TurnParser`).
    :ivar turn_end: text the template writes right after an assistant message's content.
    :ivar stop_tokens: token strings that end an assistant turn; sent to the engine as stop ids.
    :ivar allowed_append_roles: roles a client may append after an assistant turn.
    :ivar trim_trailing: token strings the template replaces when a turn is followed by more messages.
    :ivar max_trim_tokens: how many trailing tokens of a turn may be replaced that way (0 = none).
    :ivar template_kwargs: extra variables the template always gets (e.g. a flag that keeps thinking
        in the history); a request may not override them.
    :ivar stock_template: the model's upstream template when ``template`` is a fix of it.
    :ivar model_types: ``config.json`` ``model_type`` values this family serves when no bridge names
        a family (data, not name matching: exact values only).
    :ivar description: one line for ``miles verify-template`` and docs.
    """

    name: str
    template: str
    parse: TurnParser
    turn_end: str
    stop_tokens: tuple[str, ...]
    allowed_append_roles: frozenset[str] = frozenset({"user", "tool", "system"})
    trim_trailing: tuple[str, ...] = ()
    max_trim_tokens: int = 0
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    stock_template: str | None = None
    model_types: tuple[str, ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        problems = []
        if not self.name:
            problems.append("name is empty")
        if not self.template.strip():
            problems.append("template is empty")
        if not self.stop_tokens:
            problems.append("stop_tokens is empty: name the token(s) that end an assistant turn")
        unknown = set(self.allowed_append_roles) - ROLES
        if unknown:
            problems.append(f"allowed_append_roles has unknown roles {sorted(unknown)}; roles are {sorted(ROLES)}")
        if self.max_trim_tokens < 0:
            problems.append(f"max_trim_tokens must be >= 0, got {self.max_trim_tokens}")
        if self.trim_trailing and self.max_trim_tokens == 0:
            problems.append("trim_trailing is set but max_trim_tokens is 0: allow at least one trimmed token")
        if problems:
            raise ValueError(f"chat family {self.name!r}: " + "; ".join(problems))
        object.__setattr__(self, "template_kwargs", dict(self.template_kwargs))


def tool_call_from_payload(payload: Any) -> ToolCall:
    """Read the common ``{"name": str, "arguments": object}`` shape of a tool call.

    ``arguments`` may also be JSON text of an object (some models quote it). Raises ``ValueError``
    saying what is wrong; parsers turn that into :attr:`ParsedTurn.format_error`.
    """
    import json

    if not isinstance(payload, dict):
        raise ValueError(f"expected a JSON object with 'name' and 'arguments', got {type(payload).__name__}")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("the call has no 'name' string")
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"'arguments' of {name!r} is a string that is not JSON ({exc.msg})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"'arguments' of {name!r} must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def unclosed_call_at(text: str, blocks: list[re.Match[str]], opener: str) -> int:
    """Where the first call tag ``opener`` that starts none of the closed ``blocks`` begins: the call
    a parser could not read (:attr:`ParsedTurn.format_error_at`)."""
    starts = {block.start() for block in blocks}
    at = text.find(opener)
    while at != -1 and at in starts:
        at = text.find(opener, at + 1)
    return at if at != -1 else text.find(opener)
