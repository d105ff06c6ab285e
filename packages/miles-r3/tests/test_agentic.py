"""A multi-turn agentic rollout on the tiny MoE: the calculator agent (examples/calculator_agent)
talks to a session server in front of a real engine; each turn asks the engine only for the
routing of its new positions, and the stitched rows equal one teacher-forced capture of the final
token sequence.

The generator finds the agent and the chat family as in a run: named by the config
(``rollout.agent``, ``tito.family``) and registered with the run's kernel; here a kernel of the
test's own, into which an in-process plugin registers them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from calculator_agent.agent import run_agent
from miles import hookimpl
from miles.config import MilesConfig
from miles.context import context_for
from miles.engine_client import HttpEngineClient
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.registry import Register
from miles.sections import RolloutSection
from miles_contracts import AgentSpec, GenerateContext, MoeLayerMap, Process, Sample, Status
from miles_contracts.chat import ChatFamily, ParsedTurn, ToolCall
from miles_contracts.wire.auth import auth_headers
from miles_contracts.wire.engine import GenerateRequest, GenerateResponse, SamplingParams
from miles_r3.capture import RoutedExpertsCapture
from miles_r3.experts import ROUTED_EXPERTS, decode_payload
from miles_tito.config import TitoSection
from miles_tito.generators.agentic import AgenticGenerator
from miles_tito.server.app import create_app
from miles_tito.server.background import BackgroundServer
from miles_tito.server.service import SessionService
from miles_tito.tokenizer import TitoTokenizer

pytestmark = pytest.mark.slow  # a real engine and session server, three agent turns


class RecordingEngine:
    """The real engine client, remembering what each call asked for and got."""

    def __init__(self, url: str) -> None:
        self.client = HttpEngineClient(url)
        self.calls: list[tuple[GenerateRequest, GenerateResponse]] = []

    async def generate(self, request: GenerateRequest, *, routing_key: str | None = None) -> GenerateResponse:
        response = await self.client.generate(request, routing_key=routing_key)
        self.calls.append((request, response))
        return response


def always_calls(text: str) -> ParsedTurn:
    """Reads every turn as a calculator call: the tiny random model writes none of its own."""
    return ParsedTurn(content="", tool_calls=(ToolCall("calculator", json.dumps({"expression": "6 * 7"})),))


AGENT = "test_calculator"


class AgentAndFamily:
    """An in-process plugin: the calculator agent and the ``calls`` chat family, under the names the
    test's config gives."""

    def __init__(self, family: ChatFamily) -> None:
        self.family = family

    @hookimpl
    def miles_register_agents(self, register: Register[AgentSpec]) -> None:
        register(AGENT, AgentSpec(run_agent))

    @hookimpl
    def miles_register_chat_families(self, register: Register[ChatFamily]) -> None:
        register(self.family.name, self.family)


def kernel_with(family: ChatFamily) -> Kernel:
    """A kernel of the test's own (the installed plugins, fresh) with :class:`AgentAndFamily` in it."""
    selection = PluginSelection.from_settings(None, ())
    kernel = Kernel(load_plugins(selection), selection)
    kernel.register_plugin(AgentAndFamily(family), name="test-agentic")
    return kernel


def test_agentic_routing_stitches_to_a_teacher_forced_capture(moe_engine_url: str, tiny_moe: Path, moe_map: MoeLayerMap) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_moe)
    chatml = context_for().kernel.chat_families().get("chatml")
    family = dataclasses.replace(chatml, name="calls", parse=always_calls)
    kernel = kernel_with(family)
    recorder = RecordingEngine(moe_engine_url)
    service = lambda: create_app(SessionService(recorder, TitoTokenizer(tokenizer, family), model_name="tiny",  # noqa: E731
                                                max_context_len=2048, default_max_tokens=6))
    with BackgroundServer(service) as sessions:
        config = MilesConfig(rollout=RolloutSection(max_turns=3, agent=AGENT),
                             extra={"tito": TitoSection(session_server_url=sessions.url, family=family.name)})
        ctx = GenerateContext(
            engine=HttpEngineClient(moe_engine_url), tokenizer=tokenizer, max_context_len=2048,
            sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0),
            run=context_for(config, Process.driver(), kernel=kernel),
            captures=[RoutedExpertsCapture(moe_map)],
        )
        sample = asyncio.run(_generate(ctx, Sample(prompt="What is 6 * 7?")))

    assert sample.status in (Status.COMPLETED, Status.TRUNCATED), sample.exit_detail  # trainable: the turns hit the length limit
    assert sample.metadata["tito"]["turns"] == 3 == len(recorder.calls)
    starts = [request.routed_experts_start_len for request, _ in recorder.calls]
    assert starts[0] == 0 and all(later > 0 for later in starts[1:])
    for (request, response), start in zip(recorder.calls, starts, strict=True):
        fed = len(request.input_ids) + len(response.output_ids) - 1
        assert len(decode_payload(response.meta_info.routed_experts, fed - start, moe_map)) == fed - start  # new rows only

    stitched = sample.stash[ROUTED_EXPERTS].ids
    assert stitched.shape == (len(sample.tokens) - 1, 2, 2)
    np.testing.assert_array_equal(stitched, _teacher_forced(moe_engine_url, sample.tokens, moe_map)[:-1])


async def _generate(ctx: GenerateContext, sample: Sample) -> Sample:
    try:
        return await AgenticGenerator()(sample, ctx)
    finally:
        await ctx.engine.aclose()


def _teacher_forced(url: str, tokens: list[int], moe_map: MoeLayerMap) -> Any:
    """Routing of every position of ``tokens`` from one engine call that feeds them all."""
    body = {"input_ids": tokens, "return_routed_experts": True, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    answer = httpx.post(f"{url}/generate", json=body, timeout=120, headers=auth_headers()).json()
    return decode_payload(answer["meta_info"]["routed_experts"], len(tokens), moe_map)
