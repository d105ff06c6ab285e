"""A tool call the parser could not read, located in the turn's tokens.

The chat family's parser says what was wrong (``ParsedTurn.format_error``) and, when it can, where
in the text the unreadable call starts (``format_error_at``). The record keeps the call with the
span of ``output_ids`` that holds it, so a reward, a filter or a reader of the trajectory can find
the exact tokens, and nothing the model wrote is lost between the engine and the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from miles_contracts.chat import ParsedTurn
from miles_contracts.wire.session import MalformedToolCall


def malformed_tool_call(parsed: ParsedTurn, text: str, ids: Sequence[int],
                        decode: Callable[[Sequence[int]], str]) -> MalformedToolCall | None:
    """The unreadable call of a turn whose ``ids`` decode to ``text`` (None when the parser read
    every call). Its span runs from the token where the call starts to the token that ends the text."""
    if parsed.format_error is None:
        return None
    at = parsed.format_error_at if parsed.format_error_at is not None and 0 <= parsed.format_error_at < len(text) else 0
    start = _tokens_before(at, ids, decode)
    end = max(start, _tokens_covering(len(text), ids, decode))
    return MalformedToolCall(error=parsed.format_error, span=(start, end), text=text[at:])


def _tokens_before(offset: int, ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int:
    """The most leading tokens whose text ends at or before ``offset`` (the call's first token is next)."""
    low, high = 0, len(ids)
    while low < high:
        middle = (low + high + 1) // 2
        if len(decode(ids[:middle])) <= offset:
            low = middle
        else:
            high = middle - 1
    return low


def _tokens_covering(length: int, ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int:
    """The fewest leading tokens whose text is at least ``length`` characters long."""
    low, high = 0, len(ids)
    while low < high:
        middle = (low + high) // 2
        if len(decode(ids[:middle])) >= length:
            high = middle
        else:
            low = middle + 1
    return low
