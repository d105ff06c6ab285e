"""The session server's wire APIs as an agent drives them, for ``miles bench session --apis``.

One :class:`Conversation` per session: ``request(prompt)`` appends a user message and returns the
turn's body, ``answered(reply)`` echoes the reply into the history the way the API's SDK users do
(the message, the content blocks, the output items as they came back). Every turn re-sends the
whole history, as an agent does, except ``responses-chained``, which continues from the previous
response's id with only the new message (the Responses API's ``previous_response_id``).
"""

from __future__ import annotations

from typing import Any, Protocol

SYSTEM = "You are a helpful assistant."


class Conversation(Protocol):
    path: str
    """The route under the session's ``/v1``."""

    def request(self, prompt: str) -> dict[str, Any]: ...

    def answered(self, reply: dict[str, Any]) -> None: ...


class ChatConversation:
    """OpenAI Chat Completions: ``messages``, the reply's ``choices[0].message`` echoed."""

    path = "chat/completions"

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]

    def request(self, prompt: str) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": prompt})
        return {"model": "m", "messages": self.messages, "max_tokens": self.max_tokens, "temperature": 0}

    def answered(self, reply: dict[str, Any]) -> None:
        self.messages.append(reply["choices"][0]["message"])


class MessagesConversation:
    """Anthropic Messages: top-level ``system``, user text blocks, the reply's content blocks echoed."""

    path = "messages"

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.messages: list[dict[str, Any]] = []

    def request(self, prompt: str) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": [{"type": "text", "text": prompt}]})
        return {"model": "m", "max_tokens": self.max_tokens, "system": SYSTEM, "messages": self.messages, "temperature": 0}

    def answered(self, reply: dict[str, Any]) -> None:
        self.messages.append({"role": "assistant", "content": reply["content"]})


class ResponsesConversation:
    """OpenAI Responses, the whole input every turn: ``instructions``, ``input_text`` message items,
    the reply's ``output`` items echoed."""

    path = "responses"

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.items: list[dict[str, Any]] = []

    def request(self, prompt: str) -> dict[str, Any]:
        self.items.append(_user_item(prompt))
        return {"model": "m", "instructions": SYSTEM, "input": self.items, "max_output_tokens": self.max_tokens,
                "temperature": 0}

    def answered(self, reply: dict[str, Any]) -> None:
        self.items += reply["output"]


class ChainedResponsesConversation:
    """OpenAI Responses continued by ``previous_response_id``: only the new message is sent."""

    path = "responses"

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.previous: str | None = None

    def request(self, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "m", "instructions": SYSTEM, "input": [_user_item(prompt)],
                                "max_output_tokens": self.max_tokens, "temperature": 0}
        if self.previous is not None:
            body["previous_response_id"] = self.previous
        return body

    def answered(self, reply: dict[str, Any]) -> None:
        self.previous = reply["id"]


def _user_item(prompt: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}


CONVERSATIONS: dict[str, type[ChatConversation | MessagesConversation | ResponsesConversation | ChainedResponsesConversation]] = {
    "chat": ChatConversation,
    "messages": MessagesConversation,
    "responses": ResponsesConversation,
    "responses-chained": ChainedResponsesConversation,
}
"""``--apis`` names; the first three are the default."""
