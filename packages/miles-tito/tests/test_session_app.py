"""The session server's HTTP plumbing (routing, 404/405/307, the plain 500, engine failures), served
by real uvicorn on loopback. The engine is an in-process stand-in, so these run in a second."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from miles.engine_client import EngineRequestError
from miles_contracts.wire.engine import GenerateRequest, GenerateResponse
from miles_tito.server.app import create_app
from miles_tito.server.background import BackgroundServer
from miles_tito.server.service import SessionService
from miles_tito.tokenizer import TitoTokenizer
from tito_support import authed

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class StandInEngine:
    """Answers every generate with two ids; ``fail`` makes it raise instead."""

    def __init__(self) -> None:
        self.fail: Exception | None = None

    async def generate(self, request: GenerateRequest, *, routing_key: str | None = None) -> GenerateResponse:
        if self.fail is not None:
            raise self.fail
        return GenerateResponse.model_validate({
            "text": "", "output_ids": [28, 29],
            "meta_info": {"id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": len(request.input_ids or []),
                          "completion_tokens": 2, "output_token_logprobs": [[-0.5, 28, None], [-0.25, 29, None]]},
        })


@pytest.fixture(scope="module")
def engine() -> StandInEngine:
    return StandInEngine()


@pytest.fixture(scope="module")
def server(chatml: TitoTokenizer, engine: StandInEngine) -> Iterator[str]:
    with BackgroundServer(lambda: create_app(SessionService(engine, chatml, model_name="tiny"))) as background:
        yield background.url


@pytest.fixture(autouse=True)
def healthy_engine(engine: StandInEngine) -> None:
    engine.fail = None


def test_chat_round_trip_and_session_lifecycle(server: str) -> None:
    created = authed.post(f"{server}/sessions", json={"metadata": {"task": 1}}).json()
    assert created["base_url"] == f"{server}/sessions/{created['session_id']}/v1"
    answer = authed.post(f"{created['base_url']}/chat/completions", json=CHAT)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    assert answer.json()["usage"]["completion_tokens"] == 2
    models = authed.get(f"{created['base_url']}/models").json()
    assert models["data"][0]["id"] == "tiny"
    view = authed.delete(f"{server}/sessions/{created['session_id']}").json()
    assert view["metadata"] == {"task": 1} and [r["output_ids"] for r in view["records"]] == [[28, 29]]
    assert authed.get(f"{server}/server_info").json()["sessions"] == 0


def test_streaming_sends_server_sent_events(server: str) -> None:
    base = authed.post(f"{server}/sessions").json()["base_url"]
    with authed.stream("POST", f"{base}/chat/completions", json={**CHAT, "stream": True}) as response:
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_unknown_paths_methods_and_trailing_slashes_answer_as_fastapi_did(server: str) -> None:
    missing = authed.get(f"{server}/nope")
    assert (missing.status_code, missing.text) == (404, '{"detail":"Not Found"}')
    assert authed.get(f"{server}/sessions//v1/models").status_code == 404
    wrong = authed.put(f"{server}/sessions/abc")
    assert (wrong.status_code, wrong.text) == (405, '{"detail":"Method Not Allowed"}')
    assert wrong.headers["allow"] == "GET, DELETE"
    assert authed.get(f"{server}/sessions").headers["allow"] == "POST"
    redirect = authed.post(f"{server}/sessions/", follow_redirects=False)
    assert redirect.status_code == 307 and redirect.headers["location"] == f"{server}/sessions"


def test_base_url_and_redirects_name_the_servers_own_address_not_the_host_header(server: str) -> None:
    """An agent follows ``base_url`` with its session key: built from the Host header a client wrote
    (here a name the guard lets through, at another port), it would send the key there."""
    elsewhere = {"Host": "localhost:1"}
    created = authed.post(f"{server}/sessions", headers=elsewhere).json()
    assert created["base_url"] == f"{server}/sessions/{created['session_id']}/v1"
    redirect = authed.post(f"{server}/sessions/?a=1", headers=elsewhere, follow_redirects=False)
    assert redirect.status_code == 307 and redirect.headers["location"] == f"{server}/sessions?a=1"


def test_a_session_remembers_its_latest_failures_only(server: str) -> None:
    """A client holding only the session key cannot grow the server's memory: 200 failed requests
    leave the 64 latest (their messages cut short) and a count of the rest."""
    from miles_tito.server.service import FAILURE_MESSAGE_CHARS, FAILURES_KEPT

    created = authed.post(f"{server}/sessions").json()
    key = {"Authorization": f"Bearer {created['api_key']}"}
    with httpx.Client(headers=key) as agent:
        for n in range(200):
            role = f"role-{n}-" + "x" * 5000  # an invalid role, quoted in the error
            body = {"messages": [{"role": role, "content": "hi"}]}
            assert agent.post(f"{created['base_url']}/chat/completions", json=body).status_code == 400
    view = authed.get(f"{server}/sessions/{created['session_id']}").json()
    assert len(view["failures"]) == FAILURES_KEPT and view["failures_dropped"] == 200 - FAILURES_KEPT
    assert "role-199-" in view["failures"][-1]["message"] and "role-136-" in view["failures"][0]["message"]
    assert all(len(f["message"]) <= FAILURE_MESSAGE_CHARS for f in view["failures"])


def test_errors_are_openai_shaped_with_retry_advice(server: str, engine: StandInEngine) -> None:
    base = authed.post(f"{server}/sessions").json()["base_url"]
    bad = authed.post(f"{base}/chat/completions", content=b"\xff\xfe", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
    engine.fail = EngineRequestError(400, "input too long")  # the engine judged the request: the client's to fix
    refused = authed.post(f"{base}/chat/completions", json=CHAT)
    assert refused.status_code == 400 and refused.headers["x-should-retry"] == "false"
    assert "input too long" in refused.json()["error"]["message"]
    engine.fail = EngineRequestError(500, "engine bug")
    failed = authed.post(f"{base}/chat/completions", json=CHAT)
    assert failed.status_code == 502 and failed.headers["x-should-retry"] == "false"


def test_an_unexpected_error_is_a_plain_500(server: str, engine: StandInEngine) -> None:
    base = authed.post(f"{server}/sessions").json()["base_url"]
    engine.fail = RuntimeError("a bug")
    response = authed.post(f"{base}/chat/completions", json=CHAT)
    assert (response.status_code, response.text) == (500, "Internal Server Error")
    assert response.headers["content-type"] == "text/plain; charset=utf-8"


def test_idle_sessions_expire_and_say_so_busy_ones_do_not(chatml: TitoTokenizer, engine: StandInEngine, caplog) -> None:
    """A session unused for ``idle_timeout`` is removed (logged); a later request gets a 404 saying it expired."""
    import asyncio
    import time

    service = SessionService(engine, chatml, model_name="tiny", idle_timeout=60.0)
    idle, busy, fresh = service.create(), service.create(), service.create()
    asyncio.run(service.chat(idle.id, CHAT))
    start = time.monotonic() + 5  # past the sweep that create() and chat() just ran
    idle.last_used = busy.last_used = start - 120  # two minutes without a request
    fresh.last_used = start - 30

    async def sweep_while_busy() -> list[str]:
        async with busy.lock:  # a request in flight: never expired, however long it takes
            return service.expire_idle(now=start)

    with caplog.at_level("WARNING", logger="miles_tito.server.service"):
        assert asyncio.run(sweep_while_busy()) == [idle.id]
    assert idle.id not in service.sessions and {busy.id, fresh.id} <= set(service.sessions)
    assert f"session {idle.id} expired after 120 s without a request (1 turns" in caplog.text
    assert service.expire_idle(now=start + 0.5) == []  # sweeps run at most once a second
    with pytest.raises(Exception, match="expired after 120 s without a request .* create a new one"):
        service.get(idle.id)
    with pytest.raises(Exception, match="never created or is already deleted"):
        service.get("0" * 32)
    assert service.expire_idle(now=start + 2) == [busy.id]  # idle and no longer busy
    with pytest.raises(ValueError, match="idle_timeout must be > 0"):
        SessionService(engine, chatml, model_name="tiny", idle_timeout=0)
    never = SessionService(engine, chatml, model_name="tiny", idle_timeout=None)
    old = never.create()
    old.last_used -= 10**6
    assert never.expire_idle() == [] and old.id in never.sessions


def test_a_runs_session_server_gets_its_settings_from_the_config(tmp_path) -> None:
    """The run's session server is started with the run's config file (``--config``); what it
    enforces is read from there, with flags on top when started by hand."""
    import argparse
    import sys

    from miles.config import load_config
    from miles.context import context_for
    from miles.server_process import context_from_args
    from miles_contracts import Endpoint, Process, ServiceLaunch
    from miles_tito.config import TitoSection
    from miles_tito.conversation import EpisodeLimits
    from miles_tito.server.cli import add_arguments, session_options
    from miles_tito.server.launch import session_command

    config = load_config(None, ["tito.max_branches_per_episode=3", "tito.session_idle_timeout=0", "tito.family=chatml",
                                "rollout.max_context_len=4096", "rollout.max_new_tokens=77"])
    path = tmp_path / "config.yaml"
    path.write_text(config.to_yaml())
    argv = session_command(ServiceLaunch(config, str(path), "/models/m", Endpoint("127.0.0.1", 4000),
                                         {"router": ["http://127.0.0.1:3000"]}, run_dir=str(tmp_path)))
    assert argv[:3] == [sys.executable, "-m", "miles_tito.server"] and "--max-branches-per-episode" not in argv
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv[3:])
    assert (args.router, args.model, args.port, args.config) == ("http://127.0.0.1:3000", "/models/m", 4000, str(path))
    ctx = context_from_args(args, "session")
    assert ctx.process == Process.service("session") and ctx.run_dir == tmp_path
    assert ctx.config.section("tito", TitoSection).family == "chatml"
    assert session_options(ctx) == {"max_context_len": 4096, "default_max_tokens": 77,
                                    "episode_limits": EpisodeLimits(max_branches=3), "idle_timeout": None,
                                    "partial_rollout": False}
    by_hand = parser.parse_args([*argv[3:], "--max-tokens", "5", "--session-idle-timeout", "9", "--partial-rollout"])
    options = session_options(context_from_args(by_hand, "session"), by_hand.partial_rollout)
    assert (options["default_max_tokens"], options["idle_timeout"], options["partial_rollout"]) == (5, 9.0, True)
    defaults = session_options(context_for())
    assert (defaults["episode_limits"], defaults["idle_timeout"], defaults["partial_rollout"]) == (EpisodeLimits(), 3600.0, False)
    fully_async = load_config(None, ["run.mode=fully_async", "algorithm.correction=tis"])
    assert session_options(context_for(fully_async))["partial_rollout"] is True  # the loop mode decides
    no_partial = load_config(None, ["run.mode=fully_async", "algorithm.correction=tis", "rollout.partial_rollout=false"])
    assert session_options(context_for(no_partial))["partial_rollout"] is False
