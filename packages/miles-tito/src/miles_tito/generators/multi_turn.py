"""The ``multi_turn`` generator: a built-in tool loop, token-exact, without a session server.

Per sample: the prompt's messages go to the engine (TITO-tokenized by the model's chat family);
while the model answers with tool calls and turns remain, the calls run (the tools ``rollout.tools``
names, or the row's ``settings.env.tools``, from the run's kernel: ``ctx.run``) and their results
are appended; then the turns are assembled into one trajectory sample exactly as the session
server's records would be. The row's ``settings.budget`` may set the episode's limits
(:func:`~miles_tito.generators.settings.limits_of`).

How it ends (status / exit reason): the model answered -> COMPLETED / stop (or format_error when a
turn held a malformed tool call); the length limit -> TRUNCATED / length; no room left in the
context -> TRUNCATED / context_overflow; still calling tools after ``max_turns`` turns ->
TRUNCATED / max_turns; over the token budget -> TRUNCATED / token_budget; over the wall-clock
budget -> ABORTED / wall_clock_budget; more tool timeouts than tolerated -> ABORTED /
tool_timeout_budget; a tool broke -> ABORTED / tool_error; the engine failed or aborted -> ABORTED /
engine_error or abort. A problem costs the sample, never the run.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles_contracts import EngineCapture, ExitReason, GenerateContext, Sample, Status
from miles_contracts.chat import ChatFamily

from miles_tito.assembly import assemble, attach_captures
from miles_tito.conversation import Conversation, Episode, EpisodeLimits
from miles_tito.errors import (
    ContextLengthExceeded,
    EngineAborted,
    EngineFailed,
    EpisodeLimitExceeded,
    TitoError,
)
from miles_tito.generators.settings import GeneratorSettings, prompt_messages, settings_from
from miles_tito.generators.tools import (
    ToolFailure,
    ToolTimeoutBudgetSpent,
    ToolTimeouts,
    run_tool_calls,
    tool_specs,
)
from miles_tito.messages import ChatMessage, MessageError
from miles_tito.tokenizer import RenderCheck, TitoTokenizer
from miles_tito.turn import TurnRequest, run_turn

Ending = tuple[Status, ExitReason | None, str]


class MultiTurnGenerator:
    """A :class:`miles_contracts.Generator`; TITO tokenizers are built once per tokenizer and family."""

    def __init__(self) -> None:
        self._titos: dict[tuple[int, str, str], TitoTokenizer] = {}

    def tito(self, tokenizer: Any, family: ChatFamily, render_check: RenderCheck) -> TitoTokenizer:
        key = (id(tokenizer), family.name, render_check)
        if key not in self._titos:
            self._titos[key] = TitoTokenizer(tokenizer, family, render_check=render_check)
        return self._titos[key]

    async def __call__(self, sample: Sample, ctx: GenerateContext) -> Sample:
        settings = settings_from(ctx, sample)
        limits = settings.limits
        tito = self.tito(ctx.tokenizer, settings.family, settings.tito.render_check)
        conversation = Conversation(tito, episode=Episode(EpisodeLimits(max_tokens=limits.tokens, tokens_from=limits.tokens_from)))
        try:
            messages = ChatMessage.list_from_openai(prompt_messages(sample.prompt))
        except MessageError as exc:
            return sample.finish(Status.FAILED, None, f"the prompt is not a valid message list: {exc}")
        loop = _ToolLoop(conversation, messages, settings, ToolTimeouts(limits.tool_timeout_s, limits.tool_timeouts))
        try:
            async with asyncio.timeout(limits.wall_clock_s):
                ending = await loop.run(ctx)
        except TimeoutError:
            ending = (Status.ABORTED, ExitReason.WALL_CLOCK_BUDGET,
                      f"the episode did not finish within {limits.wall_clock_s:g}s (settings.budget.wall_clock_s)")
        if loop.timeouts.spent:
            sample.metadata["tool_timeouts"] = loop.timeouts.spent
        return _finish(sample, conversation, messages, settings.family.max_trim_tokens, ending, ctx.captures)


@dataclass(slots=True)
class _ToolLoop:
    """One episode's turns; ``messages`` grows in place, so what ran before a deadline is kept."""

    conversation: Conversation
    messages: list[ChatMessage]
    settings: GeneratorSettings
    timeouts: ToolTimeouts

    async def run(self, ctx: GenerateContext) -> Ending | None:
        settings, conversation, messages = self.settings, self.conversation, self.messages
        specs = tool_specs(settings.tools)
        routing_key = uuid.uuid4().hex  # all turns of this sample go to one engine (prefix cache)
        captures = [c.spec for c in ctx.captures]
        for _ in range(settings.limits.max_turns):
            try:
                result = await run_turn(
                    conversation, ctx.engine,
                    TurnRequest(list(messages), specs, ctx.sampling_params, captures=captures,
                                continue_aborted=ctx.partial_rollout),
                    max_context_len=ctx.max_context_len, routing_key=routing_key,
                )
            except TitoError as exc:
                return _ending_of(exc)
            messages.append(result.message)
            if result.record.finish_reason != "tool_calls":
                return None
            try:
                messages += await run_tool_calls(result.message.tool_calls, settings.tools, self.timeouts)
            except ToolTimeoutBudgetSpent as exc:
                return (Status.ABORTED, ExitReason.TOOL_TIMEOUT_BUDGET, str(exc))
            except ToolFailure as exc:
                return (Status.ABORTED, ExitReason.TOOL_ERROR, str(exc))
        if conversation.records and conversation.records[-1].finish_reason == "tool_calls":
            return (Status.TRUNCATED, ExitReason.MAX_TURNS, f"still calling tools after {settings.limits.max_turns} turns")
        return None


def _ending_of(error: TitoError) -> Ending:
    if isinstance(error, ContextLengthExceeded):
        return (Status.TRUNCATED, ExitReason.CONTEXT_OVERFLOW, error.message)
    if isinstance(error, EpisodeLimitExceeded):  # one session, no forks: only its token budget can be hit
        return (Status.TRUNCATED, ExitReason.TOKEN_BUDGET, error.message)
    if isinstance(error, EngineAborted):
        return (Status.ABORTED, ExitReason.ABORT, error.message)
    if isinstance(error, EngineFailed):
        return (Status.ABORTED, ExitReason.ENGINE_ERROR, error.message)
    return (Status.FAILED, None, f"{error.code}: {error.message}")


def _finish(
    sample: Sample, conversation: Conversation, messages: list[ChatMessage], max_trim_tokens: int, ending: Ending | None,
    captures: Sequence[EngineCapture],
) -> Sample:
    if conversation.records:
        assemble(conversation.records, max_trim_tokens=max_trim_tokens, into=sample)
        # Rewards read the final answer, not tool output the response tokens also contain.
        sample.response = conversation.messages[-1].content
        sample.metadata["messages"] = [m.to_openai() for m in messages]
    if ending is not None:
        status, reason, detail = ending
        if not conversation.records and status is Status.TRUNCATED:
            status = Status.ABORTED  # nothing was generated: there is no truncated response to train on
        sample.finish(status, reason, detail)
    return attach_captures(conversation.records, sample, captures)  # after the status is final
