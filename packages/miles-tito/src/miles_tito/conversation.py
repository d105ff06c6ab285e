"""One conversation's exact token state, and the three checks that keep it exact.

A :class:`Conversation` holds the messages so far, one :class:`Turn` per generated assistant turn
(its prompt ids plus sampled ids: a *checkpoint*) and one record per engine call. Each request:

1. **messages** -- the request must repeat the stored messages (as :meth:`ChatMessage.matches`
   reads an echo) and may only append roles the chat family allows. A request that diverges
   earlier retries a turn: the turns after the divergence roll back, at most
   ``max_rollback_turns`` of them (default one: "retry the last turn").
2. **render** -- the TITO tokenizer requires the rendering with the appended messages to extend
   the rendering without them.
3. **tokens** -- the new prompt must extend the last checkpoint, except for at most the family's
   ``max_trim_tokens`` trailing ids.

:meth:`prepare` checks and computes the prompt without changing anything; :meth:`commit` applies it
once the engine answered, so a failed engine call leaves the conversation as it was. Callers
serialise prepare/commit per conversation (the session server holds a lock across both).
``prepare`` is :meth:`draft` (the checks and rendering) and :meth:`complete` (the token check)
with the new text tokenized in between; :func:`~miles_tito.turn.run_turn` calls the two itself, to
refuse a text too long for the context before tokenizing it and to tokenize a long one off the
event loop.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles_contracts.wire.session import FinishReason, TurnCapture, TurnRecord

from miles_tito.errors import HistoryConflict, InvalidRequest, RoleNotAllowed, TokenChainBroken
from miles_tito.messages import ChatMessage
from miles_tito.tokenizer import TitoTokenizer


@dataclass(slots=True)
class Turn:
    """A generated assistant turn: ``messages[message_index]`` and its checkpoint ids."""

    message_index: int
    token_ids: list[int]  # [prompt_len + completion_len]
    record: TurnRecord


@dataclass(slots=True)
class PreparedTurn:
    """A checked request, ready for the engine.

    :ivar messages: the request's messages, stored spellings for the part that matched.
    :ivar input_ids: ``[prompt_len]`` the prompt for the engine.
    :ivar kept_turns: how many generated turns remain (the rest roll back on commit).
    :ivar trimmed: trailing ids of the last kept turn that the splice replaced.
    :ivar known_positions: leading positions of ``input_ids`` whose per-position engine data
        (captures) the kept turns already hold: the last kept turn's call reported positions
        ``[.., n - 1)`` of its ``n`` ids, valid up to where the splice replaced trailing ids.
    """

    messages: list[ChatMessage]
    input_ids: list[int]
    kept_turns: int
    trimmed: int
    known_positions: int = 0


@dataclass(slots=True)
class DraftTurn:
    """A checked request whose new text is rendered but not yet tokenized.

    :ivar head_ids: the kept history's ids, spliced (empty on a first turn); the prompt is these
        followed by the ids of ``text``.
    :ivar text: the new messages as the template renders them, with the generation prompt.
    """

    messages: list[ChatMessage]
    head_ids: list[int]
    text: str
    kept_turns: int
    trimmed: int


class Conversation:
    def __init__(self, tito: TitoTokenizer, *, max_rollback_turns: int = 1) -> None:
        self.tito = tito
        self.max_rollback_turns = max_rollback_turns
        self.messages: list[ChatMessage] = []
        self.turns: list[Turn] = []
        self.records: list[TurnRecord] = []

    @property
    def token_ids(self) -> list[int]:
        """The conversation's ids so far (the last turn's checkpoint)."""
        return list(self.turns[-1].token_ids) if self.turns else []

    # ------------------------------------------------------------------ checks

    def prepare(
        self, request: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None, extra: Mapping[str, Any] | None = None
    ) -> PreparedTurn:
        """Check ``request`` against the conversation and compute the engine prompt."""
        draft = self.draft(request, tools, extra)
        return self.complete(draft, self.tito.encode(draft.text))

    def draft(
        self, request: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None, extra: Mapping[str, Any] | None = None
    ) -> DraftTurn:
        """The checks of :meth:`prepare` that need no new token ids, and the text to tokenize."""
        if not request:
            raise InvalidRequest("'messages' is empty", param="messages")
        if request[-1].role == "assistant":
            raise InvalidRequest(
                f"messages[{len(request) - 1}] is an assistant message; end with a user, tool or system message "
                f"(continuing an assistant message is not supported)",
                param="messages",
            )
        matched = self._matched_prefix(request)
        kept = sum(1 for t in self.turns if t.message_index < matched)
        self._check_rollback(request, matched, len(self.turns) - kept)
        messages = [*self.messages[:matched], *request[matched:]]
        if kept == 0:
            return DraftTurn(messages, [], self.tito.first_turn_text(messages, tools, extra), 0, 0)
        base = self.turns[kept - 1]
        history, appended = messages[: base.message_index + 1], messages[base.message_index + 1 :]
        self._check_roles(appended, base.message_index + 1)
        head, trimmed, text = self.tito.appended_text(history, base.token_ids, appended, tools, extra)
        return DraftTurn(messages, head, text, kept, trimmed)

    def complete(self, draft: DraftTurn, text_ids: list[int]) -> PreparedTurn:
        """The prompt of ``draft`` given the ids of its text; checks that it extends the last kept turn."""
        input_ids = draft.head_ids + text_ids
        if draft.kept_turns == 0:
            return PreparedTurn(draft.messages, input_ids, 0, 0)
        base = self.turns[draft.kept_turns - 1]
        self._check_token_chain(base.token_ids, input_ids, draft.trimmed)
        previous = len(base.token_ids)
        return PreparedTurn(draft.messages, input_ids, draft.kept_turns, draft.trimmed,
                            known_positions=min(previous - 1, previous - draft.trimmed))

    def _matched_prefix(self, request: Sequence[ChatMessage]) -> int:
        matched = 0
        for asked, stored in zip(request, self.messages, strict=False):
            if not asked.matches(stored):
                break
            matched += 1
        return matched

    def _check_rollback(self, request: Sequence[ChatMessage], matched: int, rollback: int) -> None:
        if rollback <= self.max_rollback_turns:
            return
        if matched < len(request):
            what = f"messages[{matched}] {request[matched].difference(self.messages[matched])}"
        else:
            what = f"the request has {len(request)} messages, the session already has {len(self.messages)}"
        raise HistoryConflict(
            f"{what}; that rewrites {rollback} generated turns, but a request may only append messages or retry "
            f"the last {self.max_rollback_turns} turn(s). Re-send the history exactly as the session returned it, "
            f"or start a new session for a different conversation",
            param="messages",
        )

    def _check_roles(self, appended: Sequence[ChatMessage], first_index: int) -> None:
        if not appended:
            raise InvalidRequest(
                f"messages end with the assistant turn the session generated (messages[{first_index - 1}]); "
                f"append a user or tool message, or drop that turn to retry it",
                param="messages",
            )
        allowed = self.tito.family.allowed_append_roles
        for offset, message in enumerate(appended):
            if message.role not in allowed:
                raise RoleNotAllowed(
                    f"messages[{first_index + offset}] has role {message.role!r}, but chat family "
                    f"{self.tito.family.name!r} only allows appending {sorted(allowed)} after an assistant turn",
                    param="messages",
                )

    def _check_token_chain(self, previous: Sequence[int], input_ids: Sequence[int], trimmed: int) -> None:
        limit = self.tito.family.max_trim_tokens
        keep = len(previous) - trimmed
        if trimmed > limit or input_ids[:keep] != list(previous[:keep]):
            position = next((i for i in range(keep) if i >= len(input_ids) or input_ids[i] != previous[i]), keep)
            raise TokenChainBroken(
                f"the new prompt does not extend the previous turn's tokens at token {position} "
                f"(trimmed {trimmed}, family limit {limit}); the chat family's splice rules do not fit this template"
            )

    # ------------------------------------------------------------------ state changes

    def commit(
        self,
        prepared: PreparedTurn,
        *,
        output_ids: list[int],
        output_logprobs: list[float],
        finish_reason: FinishReason,
        weight_version: int,
        message: ChatMessage,
        output_versions: list[int] | None = None,
        format_error: str | None = None,
        latency_s: float = 0.0,
        captures: dict[str, list[TurnCapture]] | None = None,
    ) -> TurnRecord:
        """Record the engine's answer to ``prepared``; rolled-back turns stay, marked."""
        for turn in self.turns[prepared.kept_turns :]:
            turn.record.rolled_back = True
        del self.turns[prepared.kept_turns :]
        self.messages = [*prepared.messages, message]
        record = TurnRecord(
            turn=len(self.records),
            message_count=len(prepared.messages),
            input_ids=prepared.input_ids,
            output_ids=output_ids,
            output_logprobs=output_logprobs,
            finish_reason=finish_reason,
            weight_version=weight_version,
            output_versions=output_versions,
            message=message.to_openai(),
            format_error=format_error,
            created_at=time.time(),
            latency_s=latency_s,
            captures=captures or {},
        )
        self.records.append(record)
        self.turns.append(Turn(len(self.messages) - 1, prepared.input_ids + output_ids, record))
        return record
