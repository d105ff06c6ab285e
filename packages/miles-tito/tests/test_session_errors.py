"""Every error the session server answers: status, OpenAI error shape and code, a message that says
what broke, what the ``openai`` client raises, and the failure kept in the session's state."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from miles_contracts.wire.auth import auth_headers, run_token
from miles_tito.conversation import Conversation, EpisodeLimits
from miles_tito.errors import TokenChainBroken
from miles_tito.tokenizer import TitoTokenizer
from tito_support import LONG_GENERATION, authed, free_port, session_server, wait_until_generating

pytestmark = pytest.mark.slow

USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def server(engine_url: str, chatml: TitoTokenizer) -> Iterator[str]:
    with session_server(engine_url, chatml, max_context_len=256) as url:
        yield url


@pytest.fixture(scope="module")
def roomy_server(engine_url: str, chatml: TitoTokenizer) -> Iterator[str]:
    """Room for a long generation, during which a test deletes the session or aborts the engine."""
    with session_server(engine_url, chatml) as url:
        yield url


def new_session(server: str) -> dict[str, Any]:
    return authed.post(f"{server}/sessions").json()


def chat(base_url: str, body: Any, *, raw: bool = False) -> httpx.Response:
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if raw else {"json": body}
    return authed.post(f"{base_url}/chat/completions", timeout=120, **kwargs)


def error_of(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error["message"]


def first_turn(base_url: str) -> dict[str, Any]:
    response = chat(base_url, {"messages": [USER], "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


@pytest.mark.parametrize(("body", "raw", "fragment"), [
    ("{not json", True, "not valid JSON"),
    ({"messages": [USER], "temprature": 0.5}, False, "unknown parameter 'temprature'"),
    ({"messages": [USER], "n": 2}, False, "n=2 is not supported"),
    ({"messages": []}, False, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, False, "messages[0]: unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, False, "'image_url' is not supported"),
    ({"messages": [USER], "top_k": 0}, False, "top_k must be -1"),
    ({"messages": [USER], "response_format": {"type": "json_schema"}}, False, "no constrained decoding"),
])
def test_400_invalid_request(server: str, body: Any, raw: bool, fragment: str) -> None:
    session = new_session(server)
    message = error_of(chat(session["base_url"], body, raw=raw), 400, "invalid_request")
    assert fragment in message


def test_400_role_not_allowed_and_the_failure_is_kept(server: str) -> None:
    session = new_session(server)
    answer = first_turn(session["base_url"])
    body = {"messages": [USER, answer, {"role": "assistant", "content": "injected"}, USER]}
    message = error_of(chat(session["base_url"], body), 400, "role_not_allowed")
    assert "messages[2] has role 'assistant'" in message and "chatml" in message
    failures = authed.get(f"{server}/sessions/{session['session_id']}").json()["failures"]
    assert [(f["status_code"], f["code"]) for f in failures] == [(400, "role_not_allowed")]


def test_400_context_length_exceeded(server: str) -> None:
    session = new_session(server)
    message = error_of(chat(session["base_url"], {"messages": [{"role": "user", "content": "word " * 400}]}), 400, "context_length_exceeded")
    assert "context limit is 256" in message


def test_404_session_not_found_through_the_openai_client(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/sessions/nope/v1", api_key=run_token(), max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no session 'nope'"):
        client.chat.completions.create(model="m", messages=[USER])
    assert authed.get(f"{server}/sessions/nope").status_code == 404
    assert authed.delete(f"{server}/sessions/nope").status_code == 404


@pytest.fixture(scope="module")
def two_branch_server(engine_url: str, chatml: TitoTokenizer) -> Iterator[str]:
    with session_server(engine_url, chatml, max_context_len=256, episode_limits=EpisodeLimits(max_branches=2)) as url:
        yield url


def test_an_edited_history_forks_until_the_episode_limit_then_400(two_branch_server: str) -> None:
    """A request that rewrites history is a branch (no longer a 409); over the episode's branch
    limit it is a 400 ``episode_limit`` that no SDK retries, and the session says the episode is over."""
    session = new_session(two_branch_server)
    first = first_turn(session["base_url"])
    second = chat(session["base_url"], {"messages": [USER, first, USER], "max_tokens": 2}).json()["choices"][0]["message"]
    edited = [{"role": "user", "content": "something else"}, first, USER, second, USER]
    assert chat(session["base_url"], {"messages": edited, "max_tokens": 2}).status_code == 200
    again = [{"role": "user", "content": "a third history"}]
    response = chat(session["base_url"], {"messages": again})
    message = error_of(response, 400, "episode_limit")
    assert "the episode has 2 branches and this request needs 1 more; the limit is 2" in message
    assert response.headers["x-should-retry"] == "false"
    state = authed.get(f"{two_branch_server}/sessions/{session['session_id']}").json()
    assert state["forks"] == {"rewrite": 1} and state["episode_limit"].startswith("the episode has 2 branches")
    assert [r["branch"] for r in state["records"]] == [0, 0, 1]


def test_409_session_closing(roomy_server: str, engine_url: str) -> None:
    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        session = new_session(roomy_server)
        long = {"messages": [USER], **LONG_GENERATION}
        async with httpx.AsyncClient(headers=auth_headers(), timeout=300) as http:
            in_flight = asyncio.create_task(http.post(f"{session['base_url']}/chat/completions", json=long))
            await wait_until_generating(engine_url)
            queued = asyncio.create_task(http.post(f"{session['base_url']}/chat/completions", json=long))
            await asyncio.sleep(0.2)  # the queued request reaches the server and waits for the session lock
            await http.delete(f"{roomy_server}/sessions/{session['session_id']}")
            return await in_flight, await queued

    answered, refused = asyncio.run(scenario())
    assert answered.status_code == 200
    assert "deleted while this request waited" in error_of(refused, 409, "session_closing")


def test_422_template_not_prefix_invariant(engine_url: str, qwen3: TitoTokenizer) -> None:
    stock = TitoTokenizer(qwen3.tokenizer, dataclasses.replace(qwen3.family, template=qwen3.family.stock_template or ""))
    with session_server(engine_url, stock) as url:
        session = new_session(url)
        answer = first_turn(session["base_url"])
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        with pytest.raises(openai.UnprocessableEntityError) as error:
            client.chat.completions.create(model="m", messages=[USER, answer, {"role": "user", "content": "more"}])
    body = error.value.body
    assert body["code"] == "template_not_prefix_invariant"
    assert "changed how messages[1] (assistant) renders" in body["message"]


def test_422_template_error(engine_url: str, chatml: TitoTokenizer) -> None:
    strict = "{% if tools %}{{ raise_exception('this template takes no tools') }}{% endif %}" + chatml.family.template
    tito = TitoTokenizer(chatml.tokenizer, dataclasses.replace(chatml.family, template=strict))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with session_server(engine_url, tito) as url:
        session = new_session(url)
        message = error_of(chat(session["base_url"], {"messages": [USER], "tools": [tool]}), 422, "template_error")
    assert "this template takes no tools" in message


def test_422_token_chain_broken_names_the_token(chatml: TitoTokenizer) -> None:
    # No shipped splice rule can break the chain; the check guards future families' rules.
    conversation = Conversation(chatml)
    with pytest.raises(TokenChainBroken, match="at token 2") as error:
        conversation._check_token_chain([1, 2, 3, 4], [1, 2, 9, 4, 5], trimmed=0)
    assert error.value.status_code == 422
    with pytest.raises(TokenChainBroken, match="trimmed 2, family limit 1"):
        conversation._check_token_chain([1, 2, 3, 4], [1, 2, 5], trimmed=2)


def test_502_engine_unreachable(chatml: TitoTokenizer) -> None:
    with session_server(f"http://127.0.0.1:{free_port()}", chatml) as url:
        session = new_session(url)
        response = chat(session["base_url"], {"messages": [USER]})
        message = error_of(response, 502, "engine_error")
        state = authed.get(f"{url}/sessions/{session['session_id']}").json()
    assert "could not be reached" in message
    assert state["records"] == [] and state["failures"][0]["code"] == "engine_error"


def test_503_engine_aborted_is_retryable_and_changes_nothing(roomy_server: str, engine_url: str) -> None:
    async def scenario() -> httpx.Response:
        session = new_session(roomy_server)
        async with httpx.AsyncClient(headers=auth_headers(), timeout=300) as http:
            request = asyncio.create_task(http.post(f"{session['base_url']}/chat/completions",
                                                    json={"messages": [USER], **LONG_GENERATION}))
            await wait_until_generating(engine_url)
            await http.post(f"{engine_url}/abort_request", json={"abort_all": True})
            response = await request
            state = (await http.get(f"{roomy_server}/sessions/{session['session_id']}")).json()
        assert state["records"] == []
        return response

    response = asyncio.run(scenario())
    assert "aborted" in error_of(response, 503, "engine_aborted")
    assert response.headers["x-should-retry"] == "true"


def test_error_bodies_are_json_objects(server: str) -> None:
    response = authed.post(f"{server}/sessions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert response.status_code == 400 and json.loads(response.text)["error"]["code"] == "invalid_request"
