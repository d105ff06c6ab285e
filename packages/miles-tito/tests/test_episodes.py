"""Episodes of several sessions and branches over HTTP, against a real engine (tiny random Llama):
sub-agents opened by the agent with its own key, what deleting the first session returns, the
errors (unknown parent 404, limits 400), several tool calls in one turn, and the ``agentic``
generator's rows from an agent that compacts, retries and delegates (official SDKs as clients)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from miles import hookimpl
from miles.config import build_config
from miles.engine_client import HttpEngineClient
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles_contracts import AgentSpec, ExitReason, GenerateContext, Process, RunContext, Sample, Status
from miles_contracts.chat import ParsedTurn, ToolCall
from miles_contracts.wire.engine import SamplingParams
from miles_contracts.wire.session import SessionView
from miles_tito.conversation import EpisodeLimits
from miles_tito.generators.agentic import AgenticGenerator
from miles_tito.tokenizer import TitoTokenizer
from tito_support import authed, family_with_parser, session_server

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


def two_calls(text: str) -> ParsedTurn:
    """Every turn reads as two calculator calls in one turn (the tiny model writes none)."""
    return ParsedTurn(content="", tool_calls=(ToolCall("calculator", json.dumps({"expression": "6 * 7"})),
                                              ToolCall("calculator", json.dumps({"expression": "1 + 1"}))))


@pytest.fixture(scope="module")
def server(engine_url: str, chatml: TitoTokenizer) -> Iterator[str]:
    with session_server(engine_url, chatml, default_max_tokens=4,
                        episode_limits=EpisodeLimits(max_sessions=3)) as url:
        yield url


def open_session(server: str, **body: Any) -> httpx.Response:
    return authed.post(f"{server}/sessions", json=body)


def as_agent(key: str) -> httpx.Client:
    return httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_an_agent_opens_sub_agents_with_its_key_and_the_first_session_returns_them(server: str) -> None:
    root = open_session(server).json()
    agent = as_agent(root["api_key"])
    answer = agent.post(f"{root['base_url']}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text
    child = agent.post(f"{root['base_url']}/children", json={"role": "verifier"}).json()
    assert child["episode_id"] == root["episode_id"] and child["session_id"] != root["session_id"]
    # the child's key opens the child, not its parent
    helper = as_agent(child["api_key"])
    assert helper.post(f"{root['base_url']}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 401
    assert helper.post(f"{child['base_url']}/chat/completions",
                       json={"messages": [{"role": "user", "content": "check"}]}).status_code == 200
    # a third session is the episode's last (max_sessions=3); the fourth is a 400 naming the limit
    assert agent.post(f"{root['base_url']}/children", json={}).status_code == 200
    over = agent.post(f"{root['base_url']}/children", json={"role": "another"})
    assert over.status_code == 400 and over.json()["error"]["code"] == "episode_limit"
    assert "tito.max_sessions_per_episode" in over.json()["error"]["message"]

    final = SessionView.model_validate(authed.delete(f"{server}/sessions/{root['session_id']}").json())
    assert [c.role for c in final.children] == ["verifier", "agent"]
    verifier = final.children[0]
    assert verifier.parent is not None and verifier.parent.session_id == root["session_id"] and verifier.parent.turn == 0
    assert [(b.branch_id, b.cause, b.role, b.parent_branch, b.fork_turn) for b in verifier.branches] == [
        (1, "subagent", "verifier", 0, 0)]
    assert final.closed and all(c.closed for c in final.children)
    # closed with their parent: the child's route answers that the session is gone
    gone = helper.post(f"{child['base_url']}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert gone.status_code == 404


@pytest.mark.parametrize(("parent", "status", "code", "says"), [
    ({"session_id": "nope"}, 404, "session_not_found", "no session 'nope'"),
    ({"session_id": "{root}", "turn": 5}, 404, "turn_not_found", "has 0 turns, no turn 5"),
])
def test_an_unknown_parent_is_a_404(server: str, parent: dict[str, Any], status: int, code: str, says: str) -> None:
    root = open_session(server).json()
    answer = open_session(server, parent={k: str(v).format(root=root["session_id"]) if k == "session_id" else v
                                          for k, v in parent.items()})
    assert answer.status_code == status and answer.json()["error"]["code"] == code, answer.text
    assert says in answer.json()["error"]["message"]
    authed.delete(f"{server}/sessions/{root['session_id']}")


def test_a_malformed_role_is_a_400_naming_the_field(server: str) -> None:
    answer = open_session(server, role="solver; rm -rf /")
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith("role:")


def test_several_tool_calls_in_one_turn_and_their_results_chain_token_exactly(engine_url: str, chatml: TitoTokenizer) -> None:
    tito = TitoTokenizer(chatml.tokenizer, family_with_parser(chatml.family, two_calls, "two_calls"))
    with session_server(engine_url, tito, default_max_tokens=4) as url:
        session = open_session(url).json()
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "6 * 7 and 1 + 1?"}]
        first = client.chat.completions.create(model="m", messages=messages).choices[0].message
        assert [c.function.arguments for c in first.tool_calls or []] == ['{"expression": "6 * 7"}', '{"expression": "1 + 1"}']
        messages += [first.model_dump(exclude_none=True),
                     *({"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(first.tool_calls or [], ["42", "2"], strict=True))]
        client.chat.completions.create(model="m", messages=messages)
        state = SessionView.model_validate(authed.delete(f"{url}/sessions/{session['session_id']}").json())
    one, two = state.records
    assert two.parent_turn == 0 and two.input_ids[: len(one.input_ids) + len(one.output_ids)] == one.input_ids + one.output_ids
    between = chatml.decode(two.input_ids[len(one.input_ids) + len(one.output_ids):])
    assert between.count("<|im_start|>tool\n") == 2 and "42" in between and between.index("42") < between.index("\n2<")
    assert state.forks == {}


# --------------------------------------------------------------------------- the agentic generator


async def graph_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict:
    """Two turns, a retry of the second, a sub-agent over the Messages API, then a compaction."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key=metadata["api_key"], max_retries=0) as client:
        history = list(prompt)
        for _ in range(2):
            reply = (await client.chat.completions.create(model="m", messages=history, **request_kwargs)).choices[0].message
            history += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="m", messages=history[:-2], **request_kwargs)  # ask turn 2 again
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {metadata['api_key']}"}) as http:
            child = (await http.post(f"{base_url}/children", json={"role": "helper"})).json()
        helper = anthropic.AsyncAnthropic(base_url=child["base_url"].removesuffix("/v1"), api_key=child["api_key"], max_retries=0)
        found = await helper.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "look it up"}])
        summary = [prompt[0], {"role": "user", "content": f"Found: {found.content[0].text if found.content else ''}"}]
        final = (await client.chat.completions.create(model="m", messages=summary, **request_kwargs)).choices[0].message
    return {"answer": final.content}


class Agents:
    @hookimpl
    def miles_register_agents(self, register: Any) -> None:
        register("graph", AgentSpec(graph_agent))


def test_the_agentic_generator_returns_one_row_per_branch_each_model_token_trained_once(
        engine_url: str, tokenizer: Any, server: str) -> None:
    selection = PluginSelection.from_settings(None, ())
    kernel = Kernel(load_plugins(selection), selection)
    kernel.register_plugin(Agents(), name="test-episodes")
    run_ctx = RunContext(build_config({"rollout": {"agent": "graph"}}, kernel=kernel), kernel, Process.driver())
    ctx = GenerateContext(engine=HttpEngineClient(engine_url), tokenizer=tokenizer, sampling_params=GREEDY,
                          max_context_len=2048, run=run_ctx, session_server_url=server)

    async def go() -> Sample:
        try:
            return await AgenticGenerator()(Sample(prompt=[{"role": "user", "content": "Find x."}], index=7, group_index=3), ctx)
        finally:
            await ctx.engine.aclose()

    sample = asyncio.run(go())
    assert (sample.status, sample.exit_reason) == (Status.TRUNCATED, ExitReason.LENGTH), sample.exit_detail  # 4 tokens a turn
    episode = sample.metadata["episode"]
    assert episode["forks"] == {"retry": 1, "subagent": 1, "compaction": 1} and episode["sessions"] == 2
    rows = [sample, *sample.branches]
    assert [(r.branch.cause, r.branch.role) for r in rows if r.branch] == [
        ("compaction", "agent"), ("root", "agent"), ("subagent", "helper")]  # the retried attempt is not trained
    for row in rows:
        row.validate()
    # five turns were generated; the retried one is trained nowhere, each other in exactly one row,
    # whole, and nothing between turns (user, template, the sub-agent's prompt) anywhere
    trained_turns = 0
    for row in rows:
        covered = [0] * row.response_length
        for start, end in row.metadata["tito"]["turn_spans"]:
            assert set(row.loss_mask[start:end]) <= {0} or set(row.loss_mask[start:end]) == {1}
            trained_turns += row.loss_mask[start] if end > start else 0
            covered[start:end] = row.loss_mask[start:end]
        assert covered == row.loss_mask
    assert trained_turns == 4
    assert sample.metadata["agent_result"]["answer"] == sample.response
    assert rows[1].weight_versions and rows[1].prompt == sample.prompt


def test_a_sessions_token_budget_lowers_the_servers_and_names_itself(server: str) -> None:
    """``max_episode_tokens`` (a data row's ``settings.budget.tokens``): the first prompt is longer
    than 5 tokens, so the turn is refused before the engine is asked; a sub-agent may not set one."""
    root = open_session(server, max_episode_tokens=5).json()
    over = as_agent(root["api_key"]).post(f"{root['base_url']}/chat/completions",
                                          json={"messages": [{"role": "user", "content": "hello there"}]})
    assert over.status_code == 400 and over.json()["error"]["code"] == "episode_limit"
    assert "the limit is 5 (the session's max_episode_tokens)" in over.json()["error"]["message"]
    child = open_session(server, parent={"session_id": root["session_id"]}, max_episode_tokens=5)
    assert child.status_code == 400 and "max_episode_tokens: a sub-agent's session spends its parent's" in child.text
    final = SessionView.model_validate(authed.delete(f"{server}/sessions/{root['session_id']}").json())
    assert final.episode_limit_kind == "tokens" and final.records == []
