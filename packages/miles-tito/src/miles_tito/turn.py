"""One assistant turn end to end: check and tokenize, call the engine, parse, record.

Shared by the session server (an agent drives the conversation over HTTP) and the ``multi_turn``
generator (the built-in tool loop drives it in-process), so both produce identical records.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from miles.engine_client import EngineRequestError, EngineUnavailableError
from miles.rollout.continuation import Generation, MalformedOutput, generate
from miles_contracts import CaptureSpec, EngineClient
from miles_contracts.chat import ParsedTurn, ToolCall
from miles_contracts.wire.engine import GenerateRequest, SamplingParams
from miles_contracts.wire.session import FinishReason, TurnCapture, TurnRecord
from pydantic import ValidationError

from miles_tito.conversation import Conversation, DraftTurn
from miles_tito.errors import ContextLengthExceeded, EngineAborted, EngineFailed, InvalidRequest
from miles_tito.malformed import malformed_tool_call
from miles_tito.messages import ChatMessage
from miles_tito.tokenizer import TitoTokenizer


@dataclass(slots=True)
class TurnRequest:
    """What to generate.

    :ivar sampling: engine sampling; ``max_new_tokens`` is clipped to the context budget.
    :ivar parse_tool_calls: False for ``tool_choice: none`` (the text is returned as it is).
    :ivar template_extra: extra template variables (``chat_template_kwargs``).
    :ivar captures: engine captures the call carries; each call's payload lands in the record
        (``record.captures``, one piece per engine call), asked from the first position earlier turns did not report.
    :ivar continue_aborted: partial rollout: when a weight update aborts the generation, go on with
        the ids it has under the new weights (one record, ``output_versions`` per id) instead of
        failing the turn with :class:`~miles_tito.errors.EngineAborted`.
    """

    messages: Sequence[ChatMessage]
    tools: Sequence[Mapping[str, Any]] | None
    sampling: SamplingParams
    parse_tool_calls: bool = True
    template_extra: Mapping[str, Any] | None = None
    captures: Sequence[CaptureSpec] = ()
    continue_aborted: bool = False


@dataclass(slots=True)
class TurnResult:
    """A generated, recorded turn. ``matched_stop``: the stop string that ended it, if one did
    (the Messages API reports it as ``stop_sequence``)."""

    record: TurnRecord
    message: ChatMessage
    prompt_tokens: int
    matched_stop: str | None = None


async def run_turn(
    conversation: Conversation,
    engine: EngineClient,
    request: TurnRequest,
    *,
    max_context_len: int,
    routing_key: str | None = None,
) -> TurnResult:
    """Generate the next assistant turn of ``conversation``. Raises :class:`~miles_tito.errors.TitoError`."""
    tito = conversation.tito
    draft = conversation.draft(request.messages, request.tools, request.template_extra)
    _check_can_fit(draft, tito, max_context_len)
    prepared = conversation.complete(draft, await tito.encode_off_loop(draft.text))
    budget = max_context_len - len(prepared.input_ids)
    if budget < 1:
        raise ContextLengthExceeded(
            f"the prompt is {len(prepared.input_ids)} tokens and the context limit is {max_context_len}: no room to "
            f"generate; shorten the conversation or raise the limit (--max-context-len / rollout.max_context_len)",
            param="messages",
        )
    conversation.episode.check_tokens(prepared.added_tokens)
    stop_ids = sorted(set(request.sampling.stop_token_ids or ()) | set(tito.stop_token_ids))
    max_new = min(request.sampling.max_new_tokens, budget)
    sampling = request.sampling.model_copy(update={
        "max_new_tokens": max_new, "stop_token_ids": stop_ids,
        "min_new_tokens": min(request.sampling.min_new_tokens, max_new),  # the context cuts both
    })
    # Built without validation: the ids are the tokenizer's own ints and ``sampling`` is validated
    # already; re-checking every id cost ~85 us per 8k-token prompt on each turn.
    generate = GenerateRequest.model_construct(input_ids=prepared.input_ids, sampling_params=sampling, return_logprob=True)
    started = time.perf_counter()
    generation = await _generate(engine, generate, routing_key, request.continue_aborted, request.captures,
                                 prepared.known_positions)
    latency = time.perf_counter() - started
    finish = generation.finish
    if finish is None or finish.type == "abort":
        detail = finish.message if finish is not None and finish.message else "no finish reason"
        raise EngineAborted(f"the engine aborted the generation ({detail}); retry the request")
    output_ids, logprobs = generation.output_ids, generation.logprobs

    visible_ids = _without_stop_ids(output_ids, tito.stop_token_ids)
    text = _visible_text(tito.decode(visible_ids), finish.matched)
    parsed = tito.family.parse(text) if request.parse_tool_calls else ParsedTurn(content=text)
    truncated = finish.type == "length"
    # A turn cut off by the length limit is not a format mistake, even mid tool call.
    malformed = None if truncated else malformed_tool_call(parsed, text, visible_ids, tito.decode)
    reason: FinishReason = "length" if truncated else ("tool_calls" if parsed.tool_calls else "stop")
    calls = tuple(ToolCall(c.name, c.arguments, f"call_{uuid.uuid4().hex[:24]}") for c in parsed.tool_calls)
    message = ChatMessage(role="assistant", content=parsed.content, reasoning=parsed.reasoning, tool_calls=calls)
    record = conversation.commit(
        prepared,
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=reason,
        weight_version=generation.oldest_version,
        output_versions=generation.token_versions if len(set(generation.call_versions)) > 1 else None,
        message=message,
        format_error=None if malformed is None else malformed.error,
        malformed_tool_calls=[] if malformed is None else [malformed],
        latency_s=latency,
        captures=_turn_captures(generation),
    )
    matched = finish.matched if finish.type == "stop" and isinstance(finish.matched, str) else None
    return TurnResult(record, message, len(prepared.input_ids), matched or None)


def _check_can_fit(draft: DraftTurn, tito: TitoTokenizer, max_context_len: int) -> None:
    """Refuse, without tokenizing it, a new text that has more characters than the context has
    room for at the most characters a token of this tokenizer stands for: tokenizing a message of
    megabytes takes seconds, only to find it too long."""
    fewest = tito.min_tokens(draft.text)
    if len(draft.head_ids) + fewest < max_context_len:
        return
    history = f"{len(draft.head_ids)} tokens of history and " if draft.head_ids else ""
    raise ContextLengthExceeded(
        f"the prompt is at least {len(draft.head_ids) + fewest} tokens ({history}{len(draft.text)} characters of new "
        f"messages, and no token stands for more than {tito.chars_per_token} characters) and the context limit is "
        f"{max_context_len}: no room to generate; shorten the messages or raise the limit "
        f"(--max-context-len / rollout.max_context_len)",
        param="messages",
    )


def _turn_captures(generation: Generation) -> dict[str, list[TurnCapture]]:
    return {name: [TurnCapture(start=p.start, rows=p.rows, payload=p.payload) for p in pieces]
            for name, pieces in generation.pieces.items()}


async def _generate(engine: EngineClient, request: GenerateRequest, routing_key: str | None,
                    continue_aborted: bool, captures: Sequence[CaptureSpec], capture_start: int) -> Generation:
    try:
        return await generate(engine, request, routing_key=routing_key, partial_rollout=continue_aborted,
                              captures=captures, capture_start=capture_start)
    except MalformedOutput as exc:
        raise EngineFailed(f"the engine's answer does not line up: {exc}") from exc
    except EngineRequestError as exc:
        if 400 <= exc.status_code < 500 and exc.status_code not in (401, 403, 404):
            # the engine judged the request itself (e.g. a prompt beyond its context): the caller's to fix
            raise InvalidRequest(f"the engine refused the request: {exc}") from exc
        raise EngineFailed(f"the engine refused the request: {exc}") from exc
    except EngineUnavailableError as exc:
        raise EngineFailed(f"the engine could not be reached: {exc}") from exc
    except httpx.HTTPError as exc:  # engine clients other than miles' own
        raise EngineFailed(f"the engine could not be reached: {type(exc).__name__}: {exc}") from exc
    except ValidationError as exc:
        raise EngineFailed(f"the engine's answer is not a valid generate response: {exc}") from exc


def _without_stop_ids(ids: list[int], stop_ids: Sequence[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in stop_ids else ids


def _visible_text(text: str, matched: int | str | list[int] | None) -> str:
    """OpenAI semantics: a matched stop string is not part of the returned text."""
    if isinstance(matched, str) and matched and text.endswith(matched):
        return text[: -len(matched)]
    return text

