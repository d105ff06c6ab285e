"""One generation that survives weight updates (partial rollout).

At a weight update the transport pauses every engine with SGLang's ``/pause_generation
{"mode": "abort"}``: requests in flight come back with finish reason ``abort``, the tokens sampled
so far, and the weight version that sampled them (the update has not happened yet). With partial
rollout on, :func:`generate` goes on from there: it sends prompt + partial output again as
``input_ids`` with the remaining token budget; the engine holds the request until generation
continues and prefills it with the new weights. Each call's tokens keep the version that sampled
them, so a trajectory that spans an update records both versions, and the trainer's TIS/MIS
correction weighs every token against the log-prob it was actually sampled with.

Without partial rollout an abort ends the generation, as before. A stop string that straddles the
boundary between two calls is not seen (each call checks its own output), a rare and harmless miss.

Engine captures (``captures``, see :mod:`miles.rollout.capture`) are asked of every call; each call
asks only for the positions the calls before it did not cover, so the pieces tile the sequence as
the calls fed it: a continued call's rows for the positions it re-fed (sampled under the old
weights) are not asked for again, and what the trainer replays is what each token was sampled with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from miles_contracts import CapturedPiece, CaptureSpec, EngineClient
from miles_contracts.wire.engine import FinishReason, GenerateRequest, GenerateResponse

from miles.errors import MilesError
from miles.rollout.capture import capture_request, response_pieces

MAX_EMPTY_ABORTS = 8
"""Aborts in a row that brought no token before a generation gives up (an engine or router that
aborts everything, e.g. with no healthy worker). A request that was still queued when the engine
paused comes back empty once per update, so this is a count of consecutive updates, not a budget."""


class MalformedOutput(MilesError):
    """The engine answered with output ids and log-probs that do not line up."""


@dataclass(slots=True)
class Generation:
    """What the engine calls of one generation produced, concatenated.

    :ivar output_ids: every sampled id, in order.
    :ivar logprobs: ``[len(output_ids)]`` log-prob of each under the weights that sampled it.
    :ivar token_versions: ``[len(output_ids)]`` weight version of the call that sampled each id.
    :ivar call_versions: one version per call that produced tokens, in call order.
    :ivar text: the calls' texts joined.
    :ivar finish: the last call's finish reason (``abort`` only if the generation gave up).
    :ivar calls: engine calls made (2 or more: the generation spans a weight update).
    :ivar last_version: the version the last call reported (tokens or not).
    :ivar pieces: per capture name, the piece of each call that brought tokens, in call order.
    """

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    call_versions: list[int] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    calls: int = 0
    last_version: int = 0
    pieces: dict[str, list[CapturedPiece]] = field(default_factory=dict)

    def add(self, response: GenerateResponse) -> int:
        """Append one call's answer; returns how many ids it brought."""
        ids = list(response.output_ids)
        logprobs = response.logprobs()
        if len(logprobs) != len(ids):
            raise MalformedOutput(f"engine returned {len(ids)} tokens but {len(logprobs)} log-probs")
        version = engine_weight_version(response.meta_info.weight_version)
        self.calls += 1
        self.last_version = version
        self.finish = response.meta_info.finish_reason
        if ids:
            self.output_ids += ids
            self.logprobs += logprobs
            self.token_versions += [version] * len(ids)
            self.call_versions.append(version)
            self.text += response.text
        return len(ids)

    @property
    def oldest_version(self) -> int:
        """The version of the first call that sampled tokens (of the last call if none did)."""
        return min(self.call_versions) if self.call_versions else self.last_version

    @property
    def aborted(self) -> bool:
        return self.finish is not None and self.finish.type == "abort"


def engine_weight_version(value: str | int | None) -> int:
    """``meta_info.weight_version`` as an int. Engines whose weights were never updated report
    ``None`` or a name like ``"default"``: that is the base model, version 0."""
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return 0


async def generate(engine: EngineClient, request: GenerateRequest, *, routing_key: str | None = None,
                   partial_rollout: bool = False, captures: Sequence[CaptureSpec] = (),
                   capture_start: int = 0) -> Generation:
    """Run ``request`` (``input_ids`` set) to its end, continuing after aborts when
    ``partial_rollout``, with ``captures`` asked from position ``capture_start`` on. Engine client
    errors propagate as the client raises them; a malformed answer raises :class:`MalformedOutput`."""
    if request.input_ids is None:
        raise ValueError("generate needs a request with input_ids")
    prompt = list(request.input_ids)
    params = request.sampling_params
    budget = params.max_new_tokens
    result = Generation()
    empty = 0
    start = capture_start
    while True:
        response = await engine.generate(capture_request(request, captures, start=start), routing_key=routing_key)
        brought = result.add(response)
        if captures and brought:  # a call that sampled nothing fed nothing new either
            for name, piece in response_pieces(response.meta_info, captures, start=start).items():
                result.pieces.setdefault(name, []).append(piece)
                start = piece.stop
        remaining = budget - len(result.output_ids)
        if not (partial_rollout and result.aborted and remaining > 0):
            return result
        empty = 0 if brought else empty + 1
        if empty >= MAX_EMPTY_ABORTS:
            return result
        if empty > 1:  # nothing moved in a row: give the engine (or router) a moment
            await asyncio.sleep(0.02 * empty)
        request = request.model_copy(update={
            "input_ids": prompt + result.output_ids,
            "sampling_params": params.model_copy(update={
                "max_new_tokens": remaining,
                "min_new_tokens": max(0, params.min_new_tokens - len(result.output_ids)),
            }),
        })

