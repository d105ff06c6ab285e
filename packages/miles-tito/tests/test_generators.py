"""The ``multi_turn`` and ``agentic`` generators against a real engine (tiny random Llama).

Generators read everything from the run they belong to (``ctx.run``: its config and its kernel).
The tests' own tools, agents and chat families are registered in a kernel of their own (a fresh
one, with an in-process plugin) and named in the config, as a run names a plugin's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from miles import hookimpl
from miles.config import build_config
from miles.engine_client import HttpEngineClient
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.rewards import score_samples_blocking
from miles_contracts import (
    AgentSpec,
    ExitReason,
    GenerateContext,
    Process,
    RunContext,
    Sample,
    Status,
    ToolSpec,
)
from miles_contracts.chat import ParsedTurn, ToolCall
from miles_contracts.wire.engine import SamplingParams
from miles_tito.generators.agentic import AgenticGenerator
from miles_tito.generators.multi_turn import MultiTurnGenerator
from miles_tito.tokenizer import TitoTokenizer
from tito_support import always_calls, authed, family_with_parser, free_port, session_server

pytestmark = pytest.mark.slow

# Greedy, the tiny model answers "\n" first: stopping there ends each turn with a stop.
GREEDY_STOP = SamplingParams(max_new_tokens=6, temperature=0.0, stop=["\n"])


class FlakyTool:
    name = "flaky"
    description = "always fails"
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}}

    async def __call__(self, expression: str) -> str:
        raise ConnectionError("sandbox is gone")


def calls_flaky(text: str) -> ParsedTurn:
    """Every turn is a call of the flaky tool."""
    return ParsedTurn(content="", tool_calls=(ToolCall("flaky", json.dumps({"expression": "1"})),))


class SleepyTool:
    """Never answers (a sandbox that hangs): every call of it times out."""

    name = "sleepy"
    description = "never answers"
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}}

    async def __call__(self, expression: str) -> str:
        await asyncio.Event().wait()
        return ""


def calls_sleepy(text: str) -> ParsedTurn:
    """Every turn is a call of the sleepy tool."""
    return ParsedTurn(content="", tool_calls=(ToolCall("sleepy", json.dumps({"expression": "1"})),))


async def failing_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=0) as client:
        await client.chat.completions.create(model="m", messages=prompt, **request_kwargs)
    raise ValueError("the environment crashed")


async def slow_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict:
    await asyncio.sleep(60)
    return {}


async def silent_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict:
    return {"gave_up": True}  # decides the task is not worth a model call


async def reporting_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict:
    """One turn, then what the agent was told about its episode."""
    await one_turn_agent(base_url, prompt, request_kwargs, metadata)
    return {"limits": metadata["limits"], "settings": metadata["settings"], "max_turns": metadata["max_turns"]}


async def one_turn_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {metadata['api_key']}"}) as http:
        body = {"messages": prompt, **request_kwargs}
        answer = (await http.post(f"{base_url}/chat/completions", json=body)).json()
    return {"session": metadata["session_id"], "content": answer["choices"][0]["message"]["content"]}


class Registrations:
    """What these tests register: chat families reading every turn as a tool call (the tiny model
    writes none of its own), a tool that breaks, and agents that fail, hang or take one turn."""

    def __init__(self, chatml: TitoTokenizer) -> None:
        self.families = {"calls": family_with_parser(chatml.family, always_calls, "calls"),
                         "calls_flaky": family_with_parser(chatml.family, calls_flaky, "calls_flaky"),
                         "calls_sleepy": family_with_parser(chatml.family, calls_sleepy, "calls_sleepy")}

    @hookimpl
    def miles_register_chat_families(self, register: Any) -> None:
        for name, family in self.families.items():
            register(name, family)

    @hookimpl
    def miles_register_tools(self, register: Any) -> None:
        register("flaky", ToolSpec(FlakyTool()))
        register("sleepy", ToolSpec(SleepyTool()))

    @hookimpl
    def miles_register_agents(self, register: Any) -> None:
        register("failing", AgentSpec(failing_agent))
        register("slow", AgentSpec(slow_agent))
        register("silent", AgentSpec(silent_agent))
        register("one_turn", AgentSpec(one_turn_agent))
        register("reporting", AgentSpec(reporting_agent))


@pytest.fixture(scope="module")
def kernel(chatml: TitoTokenizer) -> Kernel:
    """The installed plugins and this module's, in a kernel of their own (not the process's)."""
    selection = PluginSelection.from_settings(None, ())
    kernel = Kernel(load_plugins(selection), selection)
    kernel.register_plugin(Registrations(chatml), name="test-generators")
    return kernel


def context(engine_url: str, tokenizer: Any, kernel: Kernel, *, max_context_len: int = 2048,
            session_server_url: str | None = None, **sections: Any) -> GenerateContext:
    """A generate context of a run whose config has ``sections`` (validated by ``kernel``)."""
    run = RunContext(build_config(sections, kernel=kernel), kernel, Process.driver())
    return GenerateContext(engine=HttpEngineClient(engine_url), tokenizer=tokenizer, sampling_params=GREEDY_STOP,
                           max_context_len=max_context_len, run=run, session_server_url=session_server_url)


def run(generator: Any, sample: Sample, ctx: GenerateContext) -> Sample:
    async def go() -> Sample:
        try:
            return await generator(sample, ctx)
        finally:
            await ctx.engine.aclose()

    return asyncio.run(go())


# ----------------------------------------------------------------------------- multi_turn


def test_multi_turn_runs_the_tool_loop_token_exactly(engine_url: str, tokenizer: Any, kernel: Kernel) -> None:
    ctx = context(engine_url, tokenizer, kernel, tito={"family": "calls"}, rollout={"tools": ["calculator"]})
    sample = run(MultiTurnGenerator(), Sample(prompt="What is 6 * 7?", index=3), ctx)

    assert (sample.status, sample.exit_reason) == (Status.TRUNCATED, ExitReason.MAX_TURNS)  # 8 turns of tool calls
    sample.validate()
    assert len(sample.weight_versions) == 8 == sample.metadata["tito"]["turns"]
    tool_results = [m["content"] for m in sample.metadata["messages"] if m["role"] == "tool"]
    assert tool_results == ["42"] * 8  # the real calculator ran every call
    response = sample.tokens[sample.prompt_length :]
    masked_out = tokenizer.decode([t for t, m in zip(response, sample.loss_mask, strict=True) if m == 0])
    assert masked_out.count("<|im_start|>tool\n42<|im_end|>") == 7  # tool results are in the tokens, never trained
    assert sum(sample.loss_mask) == sum(e - s for s, e in sample.metadata["tito"]["turn_spans"])


def test_multi_turn_without_tool_calls_is_one_turn(engine_url: str, tokenizer: Any, kernel: Kernel) -> None:
    ctx = context(engine_url, tokenizer, kernel, tito={"family": "chatml"})
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    sample = run(MultiTurnGenerator(), Sample(prompt=prompt), ctx)
    expected_prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert sample.tokens[: sample.prompt_length] == tokenizer.encode(expected_prompt, add_special_tokens=False)
    assert (sample.status, sample.exit_reason) == (Status.COMPLETED, ExitReason.STOP)
    assert sample.loss_mask == [1] * sample.response_length and len(sample.weight_versions) == 1


def test_a_broken_tool_aborts_the_sample_not_the_run(engine_url: str, tokenizer: Any, kernel: Kernel) -> None:
    ctx = context(engine_url, tokenizer, kernel, tito={"family": "calls_flaky"}, rollout={"tools": ["flaky"]})
    sample = run(MultiTurnGenerator(), Sample(prompt="x"), ctx)
    assert (sample.status, sample.exit_reason) == (Status.ABORTED, ExitReason.TOOL_ERROR)
    assert "sandbox is gone" in (sample.exit_detail or "")
    assert sample.response_length > 0  # the turn before the failure is kept for inspection


def test_running_out_of_context_truncates(engine_url: str, tokenizer: Any, kernel: Kernel) -> None:
    from miles_tito.generators.tools import tool_specs
    from miles_tito.messages import ChatMessage

    calculator = kernel.tools().get("calculator").tool
    calls = kernel.chat_families().get("calls")
    prompt = TitoTokenizer(tokenizer, calls).first_turn_ids([ChatMessage("user", "x")], tool_specs({"calculator": calculator}))
    limit = len(prompt) + 40  # room for a couple of tool round trips, not for eight
    ctx = context(engine_url, tokenizer, kernel, max_context_len=limit, tito={"family": "calls"},
                  rollout={"tools": ["calculator"]})
    sample = run(MultiTurnGenerator(), Sample(prompt="x"), ctx)
    assert (sample.status, sample.exit_reason) == (Status.TRUNCATED, ExitReason.CONTEXT_OVERFLOW)
    assert 1 < len(sample.weight_versions) < 8 and len(sample.tokens) <= limit


def test_an_unreachable_engine_costs_the_sample(tokenizer: Any, kernel: Kernel) -> None:
    ctx = context(f"http://127.0.0.1:{free_port()}", tokenizer, kernel, tito={"family": "chatml"})
    sample = run(MultiTurnGenerator(), Sample(prompt="x"), ctx)
    assert (sample.status, sample.exit_reason) == (Status.ABORTED, ExitReason.ENGINE_ERROR)


def test_names_resolve_in_the_runs_kernel_only(engine_url: str, tokenizer: Any, kernel: Kernel) -> None:
    """A name only this module's kernel registers is refused by the process's own kernel: the
    generator never looks anywhere but ``ctx.run.kernel``."""
    from miles.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.tools: unknown tool 'flaky'"):
        context(engine_url, tokenizer, Kernel.load(), rollout={"tools": ["flaky"]})


# ----------------------------------------------------------------------------- agentic


@pytest.fixture(scope="module")
def calls_server(engine_url: str, chatml: TitoTokenizer, kernel: Kernel) -> Iterator[str]:
    with session_server(engine_url, TitoTokenizer(chatml.tokenizer, kernel.chat_families().get("calls"))) as url:
        yield url


def test_agentic_trains_on_the_calculator_agents_exact_tokens(engine_url: str, tokenizer: Any, calls_server: str,
                                                              kernel: Kernel) -> None:
    """The example agent (official openai client) through the registered name, against a real session server."""
    ctx = context(engine_url, tokenizer, kernel, session_server_url=calls_server,
                  rollout={"agent": "calculator_agent", "max_turns": 3})
    sample = run(AgenticGenerator(), Sample(prompt=[{"role": "user", "content": "What is 6 * 7?"}], metadata={"id": 5}), ctx)

    assert sample.metadata["agent_result"] == {"answer": None, "turns": 3, "tool_calls": 3, "finish_reason": "max_turns"}
    assert (sample.status, sample.exit_reason) == (Status.COMPLETED, ExitReason.TOOL_CALLS)
    sample.validate()
    assert len(sample.weight_versions) == 3
    messages = sample.metadata["messages"]
    assert messages[0]["role"] == "system" and [m["content"] for m in messages if m["role"] == "tool"] == ["42", "42"]
    assert authed.get(f"{calls_server}/server_info").json()["sessions"] == 0  # collected and deleted


@pytest.mark.parametrize(("agent", "reason", "detail", "turns", "budget", "timeout"), [
    ("failing", ExitReason.AGENT_EXCEPTION, "ValueError: the environment crashed", 1, {}, 60.0),
    ("slow", ExitReason.WALL_CLOCK_BUDGET, "did not finish within 1s", 0, {}, 1.0),  # rollout.agent_timeout
    ("slow", ExitReason.WALL_CLOCK_BUDGET, "did not finish within 0.5s", 0, {"wall_clock_s": 0.5}, 1.0),  # the row's
    # the agent's doing, not the infrastructure's: fully_async's buffer charges it to the prompt's
    # attempts (an ``abort`` bought it the larger bound and the backoff of an engine outage)
    ("silent", ExitReason.NO_MODEL_CALL, "without a single model call", 0, {}, 60.0),
])
def test_a_failing_or_slow_agent_costs_its_sample(engine_url: str, tokenizer: Any, calls_server: str, kernel: Kernel,
                                                  agent: str, reason: ExitReason, detail: str, turns: int,
                                                  budget: dict[str, Any], timeout: float) -> None:
    """Training rule of ``wall_clock_budget``: ABORTED, never scored, not trained. (The agents
    that end on their own get a long ``agent_timeout``: run first, the failing agent's one model
    call includes the engine's warm-up, which took over 1 s.)"""
    ctx = context(engine_url, tokenizer, kernel, session_server_url=calls_server,
                  rollout={"agent": agent, "agent_timeout": timeout})
    sample = run(AgenticGenerator(), Sample(prompt="x", label="42", metadata={"settings": {"budget": budget}}), ctx)
    assert (sample.status, sample.exit_reason) == (Status.ABORTED, reason)
    score_samples_blocking([sample], ctx.run)
    assert not sample.trainable
    assert detail in (sample.exit_detail or "")
    assert len(sample.weight_versions) == turns  # what the agent did before failing is kept
    assert authed.get(f"{calls_server}/server_info").json()["sessions"] == 0


def test_agentic_starts_a_session_server_in_process_when_the_run_has_none(engine_url: str, tokenizer: Any,
                                                                          kernel: Kernel) -> None:
    generator = AgenticGenerator()
    try:
        ctx = context(engine_url, tokenizer, kernel, rollout={"agent": "one_turn"}, tito={"family": "chatml"})
        sample = run(generator, Sample(prompt="Hi"), ctx)
    finally:
        generator.close()
    assert sample.status is Status.COMPLETED and len(sample.weight_versions) == 1
    assert sample.response == sample.metadata["agent_result"]["content"]


def test_an_unreachable_session_server_costs_the_sample(engine_url: str, tokenizer: Any, kernel: Kernel) -> None:
    ctx = context(engine_url, tokenizer, kernel, session_server_url=f"http://127.0.0.1:{free_port()}",
                  rollout={"agent": "slow"})
    sample = run(AgenticGenerator(), Sample(prompt="x"), ctx)
    assert (sample.status, sample.exit_reason) == (Status.ABORTED, ExitReason.ENGINE_ERROR)
    assert "cannot open a session" in (sample.exit_detail or "")


# ----------------------------------------------------------------------------- per-sample settings and budgets
# A row's settings as its data source stores them in ``sample.metadata["settings"]`` (validated when
# the row was read: kernel/tests/test_sample_settings.py).


def with_settings(settings: dict[str, Any], **fields: Any) -> Sample:
    return Sample(prompt="x", label="42", metadata={"settings": settings}, **fields)


def trained(sample: Sample, ctx: GenerateContext) -> bool:
    """Whether the loop would train ``sample``: scored by the run's reward, then ``trainable``."""
    score_samples_blocking([sample], ctx.run)
    return sample.trainable


def test_a_rows_tools_and_max_turns_reach_the_tool_loop(engine_url: str, tokenizer: Any, kernel: Kernel) -> None:
    """The run offers no tools and allows 8 turns; the row offers the calculator for 2 turns."""
    ctx = context(engine_url, tokenizer, kernel, tito={"family": "calls"})
    sample = run(MultiTurnGenerator(), with_settings({"env": {"tools": ["calculator"]}, "budget": {"max_turns": 2}}), ctx)
    assert (sample.status, sample.exit_reason) == (Status.TRUNCATED, ExitReason.MAX_TURNS)
    assert len(sample.weight_versions) == 2 and "after 2 turns" in (sample.exit_detail or "")
    assert [m["content"] for m in sample.metadata["messages"] if m["role"] == "tool"] == ["42", "42"]


def test_tool_timeouts_are_answered_until_the_budget_is_spent(engine_url: str, tokenizer: Any, kernel: Kernel) -> None:
    """One timeout tolerated: the first answers the model with an error text and the episode goes
    on; the second ends it. Training rule of ``tool_timeout_budget``: ABORTED, not trained."""
    ctx = context(engine_url, tokenizer, kernel, tito={"family": "calls_sleepy"})
    budget = {"tool_timeout_s": 0.2, "tool_timeouts": 1}
    sample = run(MultiTurnGenerator(), with_settings({"env": {"tools": ["sleepy"]}, "budget": budget}), ctx)
    assert (sample.status, sample.exit_reason) == (Status.ABORTED, ExitReason.TOOL_TIMEOUT_BUDGET)
    assert "2 tool timeouts, 1 tolerated" in (sample.exit_detail or "")
    assert len(sample.weight_versions) == 2 and sample.metadata["tool_timeouts"] == 2
    answered = [m["content"] for m in sample.metadata["messages"] if m["role"] == "tool"]
    assert answered == ["error: tool 'sleepy' did not answer within 0.2s (timeout 1 of 1 tolerated); try again or another way"]
    assert not trained(sample, ctx)


def test_a_run_tolerates_no_tool_timeout_by_default(engine_url: str, tokenizer: Any, kernel: Kernel) -> None:
    ctx = context(engine_url, tokenizer, kernel, tito={"family": "calls_sleepy", "tool_timeout": 0.2},
                  rollout={"tools": ["sleepy"]})
    sample = run(MultiTurnGenerator(), Sample(prompt="x"), ctx)
    assert (sample.status, sample.exit_reason, len(sample.weight_versions)) == (
        Status.ABORTED, ExitReason.TOOL_TIMEOUT_BUDGET, 1)


def test_a_wall_clock_budget_ends_the_tool_loop_and_it_is_not_trained(engine_url: str, tokenizer: Any,
                                                                       kernel: Kernel) -> None:
    ctx = context(engine_url, tokenizer, kernel, tito={"family": "calls_sleepy"})
    budget = {"wall_clock_s": 0.5, "tool_timeout_s": 600}
    sample = run(MultiTurnGenerator(), with_settings({"env": {"tools": ["sleepy"]}, "budget": budget}), ctx)
    assert (sample.status, sample.exit_reason) == (Status.ABORTED, ExitReason.WALL_CLOCK_BUDGET)
    assert "within 0.5s" in (sample.exit_detail or "") and len(sample.weight_versions) == 1  # the turn before is kept
    assert not trained(sample, ctx)


def test_a_token_budget_truncates_the_tool_loop_and_it_is_trained(engine_url: str, tokenizer: Any, kernel: Kernel) -> None:
    """Room for the first prompt and its answer (at most 6 tokens), not for the tool result after it.
    Training rule of ``token_budget``: TRUNCATED, scored, trained."""
    from miles_tito.generators.tools import tool_specs
    from miles_tito.messages import ChatMessage

    calculator = kernel.tools().get("calculator").tool
    calls = kernel.chat_families().get("calls")
    prompt = TitoTokenizer(tokenizer, calls).first_turn_ids([ChatMessage("user", "x")], tool_specs({"calculator": calculator}))
    ctx = context(engine_url, tokenizer, kernel, tito={"family": "calls"})
    settings = {"env": {"tools": ["calculator"]}, "budget": {"tokens": len(prompt) + GREEDY_STOP.max_new_tokens}}
    sample = run(MultiTurnGenerator(), with_settings(settings), ctx)
    assert (sample.status, sample.exit_reason) == (Status.TRUNCATED, ExitReason.TOKEN_BUDGET)
    assert "the row's settings.budget.tokens" in (sample.exit_detail or "") and len(sample.weight_versions) == 1
    assert trained(sample, ctx)


def test_a_rows_settings_and_limits_reach_the_agent(engine_url: str, tokenizer: Any, calls_server: str,
                                                    kernel: Kernel) -> None:
    ctx = context(engine_url, tokenizer, kernel, session_server_url=calls_server, rollout={"agent": "reporting"},
                  tito={"tool_timeout": 30})
    settings = {"env": {"task_id": "t-9", "workspace": "repo-b", "tools": ["calculator"]},
                "budget": {"max_turns": 2, "tool_timeouts": 3, "wall_clock_s": 100}}
    sample = run(AgenticGenerator(), with_settings(settings), ctx)
    assert sample.status is Status.COMPLETED
    told = sample.metadata["agent_result"]
    assert told["settings"] == settings and told["max_turns"] == 2
    assert told["limits"] == {"wall_clock_s": 100, "tokens": 1 << 20, "tokens_from": "tito.max_tokens_per_episode",
                              "max_turns": 2, "tool_timeout_s": 30, "tool_timeouts": 3}


def test_a_token_budget_truncates_the_agents_episode_and_it_is_trained(engine_url: str, tokenizer: Any,
                                                                       calls_server: str, kernel: Kernel) -> None:
    """The calculator agent takes 3 turns; a budget of its 3-turn episode's tokens less 7 (its last
    answer is at most 6) leaves room for 2: the session refuses the third turn's prompt."""
    ctx = context(engine_url, tokenizer, kernel, session_server_url=calls_server, rollout={"agent": "calculator_agent"})
    free = run(AgenticGenerator(), with_settings({"budget": {"max_turns": 3}}), ctx)
    assert len(free.weight_versions) == 3
    budget = {"max_turns": 3, "tokens": len(free.tokens) - GREEDY_STOP.max_new_tokens - 1}
    sample = run(AgenticGenerator(), with_settings({"budget": budget}), ctx)
    assert (sample.status, sample.exit_reason) == (Status.TRUNCATED, ExitReason.TOKEN_BUDGET)
    assert "the session's max_episode_tokens" in (sample.exit_detail or "") and len(sample.weight_versions) == 2
    assert trained(sample, ctx)
