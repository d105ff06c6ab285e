"""A chat family that reads the tiny random model's turns as a script of tool use.

The tiny random-weight model of the tests writes no tool calls of its own. To drive harnesses
through their tool paths, the conformance server reads each turn by a hash of its decoded text: a
call of the row's tool, a call that cannot be read (an unclosed ``<tool_call>``, through the family's
real parser), or a plain answer. The tokens are the engine's; only the reading is scripted, and the
checker knows what each turn was meant to hold.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from miles_contracts.chat import ChatFamily, ParsedTurn, ToolCall

Reading = Literal["call", "malformed", "answer"]


@dataclass(frozen=True, slots=True)
class ToolScript:
    """How turns read: ``calls`` in ``period`` turns call ``tool`` with ``arguments``, one more is
    an unreadable call, the rest answer (by the hash of the turn's text)."""

    tool: str
    arguments: dict[str, Any]
    calls: int = 2
    malformed: int = 1
    period: int = 4

    def reading(self, text: str) -> Reading:
        slot = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % self.period
        if slot < self.calls:
            return "call"
        return "malformed" if slot < self.calls + self.malformed else "answer"

    def family(self, base: ChatFamily) -> ChatFamily:
        """``base`` whose parser reads turns by this script (and by ``base``'s parser for malformed ones)."""

        def parse(text: str) -> ParsedTurn:
            reading = self.reading(text)
            if reading == "call":
                return ParsedTurn(content="", tool_calls=(ToolCall(self.tool, json.dumps(self.arguments)),))
            if reading == "malformed":
                parsed = base.parse("<tool_call>" + text)  # an unclosed call: the family's own parser says so
                at = parsed.format_error_at
                return dataclasses.replace(parsed, content=text, format_error_at=None if at is None else max(at - 11, 0))
            return ParsedTurn(content=text)

        return dataclasses.replace(base, name=f"{base.name}+script", parse=parse)
