"""Partial rollout inside a TITO turn: a turn a weight update aborted goes on with the ids it has.

The engine is an in-process stand-in that aborts its first answer after two ids, as an engine
paused in ``abort`` mode does, so the split point is exact; the real engine and weight push are
exercised in ``tests/test_fully_async.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from miles_contracts.wire.engine import GenerateRequest, GenerateResponse, SamplingParams
from miles_tito.assembly import assemble
from miles_tito.conversation import Conversation
from miles_tito.errors import EngineAborted
from miles_tito.messages import ChatMessage
from miles_tito.turn import TurnRequest, run_turn


class AbortOnceEngine:
    """First call: ids 28, 29 sampled by version 3, then aborted; later calls: 30, 31 by version 4."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest, *, routing_key: str | None = None) -> GenerateResponse:
        self.requests.append(request)
        first = len(self.requests) == 1
        ids, version = ([28, 29], "3") if first else ([30, 31], "4")
        finish = {"type": "abort", "message": "aborted by /pause_generation"} if first else {"type": "length", "length": 2}
        return GenerateResponse.model_validate({
            "text": "", "output_ids": ids,
            "meta_info": {"id": "r", "finish_reason": finish, "prompt_tokens": len(request.input_ids or []),
                          "completion_tokens": 2, "weight_version": version,
                          "output_token_logprobs": [[-0.5, i, None] for i in ids]},
        })


def _turn(chatml: Any, continue_aborted: bool) -> tuple[Any, AbortOnceEngine, Conversation]:
    engine, conversation = AbortOnceEngine(), Conversation(chatml)
    request = TurnRequest([ChatMessage(role="user", content="hi")], None, SamplingParams(max_new_tokens=4),
                          continue_aborted=continue_aborted)
    result = asyncio.run(run_turn(conversation, engine, request, max_context_len=512))
    return result, engine, conversation


def test_an_aborted_turn_continues_under_the_new_weights_as_one_record(chatml: Any) -> None:
    result, engine, conversation = _turn(chatml, continue_aborted=True)
    first, second = engine.requests
    assert second.input_ids == [*first.input_ids, 28, 29] and second.sampling_params.max_new_tokens == 2
    record = result.record
    assert record.output_ids == [28, 29, 30, 31] and record.finish_reason == "length"
    assert record.output_versions == [3, 3, 4, 4] and record.weight_version == 3  # the oldest
    sample = assemble(conversation.records, max_trim_tokens=0)
    assert sample.token_versions == [3, 3, 4, 4] and sample.weight_versions == [3, 4]


def test_without_partial_rollout_an_abort_fails_the_turn(chatml: Any) -> None:
    with pytest.raises(EngineAborted, match="aborted by /pause_generation"):
        _turn(chatml, continue_aborted=False)
