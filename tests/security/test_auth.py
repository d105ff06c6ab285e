"""Every route but health needs the run's token, on the engine, the router and the session server;
control and data routes are listed apart; cross-origin and non-JSON requests are refused."""

from __future__ import annotations

import httpx
import pytest
from miles_contracts.wire.auth import (
    InvalidTokenError,
    auth_headers,
    bearer,
    check_token,
    is_authorized,
    run_token,
    server_token,
)
from miles_contracts.wire.engine import CONTROL, DATA, ENGINE_ROUTES, HEALTH

WRONG = {"Authorization": "Bearer " + "x" * 43}


def _methods(app_routes: object) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for route in app_routes:  # type: ignore[attr-defined]
        path = getattr(route, "path", None)
        if path and path not in ("/openapi.json",):
            found.setdefault(path, set()).update(getattr(route, "methods", set()) - {"HEAD"})
    return found


def test_the_route_table_lists_every_engine_route_by_kind(engine) -> None:
    from miles_engine.openapi import ROUTE_SPECS

    fastapi = engine.client  # noqa: F841  (the engine serves; the app is inspected below)
    from miles_engine.server import _fastapi_app

    served = _methods(_fastapi_app(engine.target).routes)
    served["/generate"] = {"POST"}  # answered by the plain-ASGI fast path in front of FastAPI
    assert set(served) == set(ENGINE_ROUTES) == set(ROUTE_SPECS)
    assert {path for path, kind in ENGINE_ROUTES.items() if kind == HEALTH} == {"/health"}
    assert {"/update_weights_from_tensor", "/pause_generation", "/init_weights_update_group",
            "/abort_request"} <= {p for p, k in ENGINE_ROUTES.items() if k == CONTROL}
    assert {"/generate", "/get_model_info"} <= {p for p, k in ENGINE_ROUTES.items() if k == DATA}
    for path, (methods, _, _) in ROUTE_SPECS.items():
        assert set(methods) == served[path], path


@pytest.mark.parametrize("path", sorted(ENGINE_ROUTES))
def test_every_engine_route_but_health_refuses_a_request_without_the_token(engine, path: str) -> None:
    from miles_engine.openapi import ROUTE_SPECS

    for method in ROUTE_SPECS[path][0]:
        for headers in ({}, WRONG, {"Authorization": "Basic " + "x" * 40}):
            answer = httpx.request(method, engine.url + path, headers=headers, json={} if method == "POST" else None)
            if ENGINE_ROUTES[path] == HEALTH:
                assert answer.status_code == 200, answer.text
            else:
                assert answer.status_code == 401, (method, path, answer.text)
                assert "MILES_AUTH_TOKEN" in answer.json()["detail"]
                assert answer.headers["www-authenticate"] == "Bearer"
    assert engine.client.get("/get_model_info").status_code == 200


def test_the_router_needs_the_token_and_a_fake_worker_cannot_join(router, engine) -> None:
    fake = "http://127.0.0.1:9"
    for method, path in [("POST", "/add_worker"), ("POST", "/remove_worker"), ("GET", "/list_workers"),
                         ("GET", "/metrics"), ("POST", "/generate"), ("POST", "/pause_generation"),
                         ("POST", "/update_weights_from_disk"), ("GET", "/get_model_info")]:
        answer = httpx.request(method, router.url + path, params={"url": fake}, headers=WRONG,
                               json={"input_ids": [1]} if method == "POST" else None)
        assert answer.status_code == 401, (path, answer.text)
    assert httpx.get(router.url + "/health").status_code == 200
    workers = router.client.get("/list_workers").json()["urls"]
    assert workers == [engine.url]  # the fake never joined
    # with the token the router forwards with its own token: the engine accepts it
    answer = router.client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert answer.status_code == 200, answer.text


def test_the_session_server_needs_the_token_and_a_session_key_reaches_its_own_session_only(session_server) -> None:
    url = session_server.url
    health = httpx.get(url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}  # liveness: no model path, no counts
    for method, path in [("POST", "/sessions"), ("GET", "/sessions/abc"), ("DELETE", "/sessions/abc"),
                         ("GET", "/sessions/abc/v1/models"), ("POST", "/sessions/abc/v1/chat/completions"),
                         ("POST", "/sessions/abc/v1/messages"), ("POST", "/sessions/abc/v1/responses"),
                         ("GET", "/openapi.json"), ("GET", "/server_info")]:
        answer = httpx.request(method, url + path, headers=WRONG)
        assert answer.status_code == 401, (path, answer.text)
        assert answer.json()["error"]["code"] == "invalid_api_key"
    first = session_server.client.post("/sessions").json()
    second = session_server.client.post("/sessions").json()
    own = {"Authorization": f"Bearer {first['api_key']}"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{first['base_url']}/chat/completions", json=chat, headers=own, timeout=60).status_code == 200
    assert httpx.get(f"{first['base_url']}/models", headers=own).status_code == 200
    # the key opens nothing else: another session, the records, the engine
    assert httpx.post(f"{second['base_url']}/chat/completions", json=chat, headers=own).status_code == 401
    assert httpx.get(f"{url}/sessions/{first['session_id']}", headers=own).status_code == 401
    assert httpx.post(f"{url}/sessions", headers=own).status_code == 401
    assert httpx.get(f"{url}/server_info", headers=own).status_code == 401


def test_a_deleted_sessions_key_gets_404_not_401(session_server) -> None:
    import openai

    session = session_server.client.post("/sessions").json()
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert session_server.client.delete(f"/sessions/{session['session_id']}").status_code == 200
    with pytest.raises(openai.NotFoundError, match="already deleted"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    # the gone session's key still opens nothing else, and a wrong key for the gone session is 401
    other = session_server.client.post("/sessions").json()
    own = {"Authorization": f"Bearer {session['api_key']}"}
    assert httpx.get(f"{other['base_url']}/models", headers=own).status_code == 401
    assert httpx.get(f"{session['base_url']}/models", headers=WRONG).status_code == 401


def test_an_agent_with_the_openai_client_passes_the_session_key_as_api_key(session_server) -> None:
    import openai

    session = session_server.client.post("/sessions").json()
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert answer.choices[0].message.role == "assistant"
    stranger = openai.OpenAI(base_url=session["base_url"], api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


@pytest.mark.parametrize("server", ["engine", "router", "session_server"])
def test_cross_origin_and_non_json_requests_are_refused(server: str, request: pytest.FixtureRequest) -> None:
    served = request.getfixturevalue(server)
    path = "/sessions" if server == "session_server" else "/generate"
    body = {} if server == "session_server" else {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
    host = served.url.removeprefix("http://")
    foreign = served.client.post(path, json=body, headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403, foreign.text
    assert served.client.post(path, json=body, headers={"Origin": f"http://{host}"}).status_code == 200
    # a form post is what a web page can send without asking: refused
    form = served.client.post(path, content=b"a=1", headers={"content-type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415 and "application/json" in form.text
    text = served.client.post(path, content=b"{}", headers={"content-type": "text/plain"})
    assert text.status_code == 415


PROTECTED_GET = {"engine": "/get_model_info", "router": "/list_workers", "session_server": "/server_info"}


@pytest.mark.parametrize("server", ["engine", "router", "session_server"])
def test_a_request_that_names_another_host_is_refused(server: str, request: pytest.FixtureRequest) -> None:
    """DNS rebinding: a page at http://evil.example:<port> whose name the attacker re-points at
    127.0.0.1 is, to the browser, same-origin with the server (its Origin and Host both name
    evil.example), so the Origin check passes it; the Host check does not, token or none."""
    served = request.getfixturevalue(server)
    port = served.url.rsplit(":", 1)[1]
    rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    for path in ("/health", PROTECTED_GET[server]):
        refused = served.client.get(path, headers=rebound)
        assert refused.status_code == 400 and "evil.example" in refused.text and "--allowed-host" in refused.text
    # addresses (never an attacker's name) and localhost are served
    for host in (f"localhost:{port}", f"10.9.8.7:{port}", f"[::1]:{port}", f"127.0.0.1:{port}"):
        assert served.client.get(PROTECTED_GET[server], headers={"Host": host}).status_code == 200, host


def test_a_server_answers_to_the_names_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from miles.server_process import add_server_security_arguments, allowed_hosts
    from miles_contracts.wire.guard import RequestGuard
    from miles_tito.server.background import BackgroundServer

    async def ok(scope, receive, send):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    add_server_security_arguments(parser)
    names = allowed_hosts(parser.parse_args(["--host", "gpu-node-3", "--allowed-host", "Trainer.Internal"]))
    monkeypatch.setenv("MILES_ALLOWED_HOSTS", "proxy.example, other.example")
    with BackgroundServer(lambda: RequestGuard(ok, token="t" * 32, public_paths=["/"], allowed_hosts=names)) as server:
        answers = {host: httpx.get(server.url, headers={"Host": host}).status_code
                   for host in ("gpu-node-3:1", "trainer.internal", "proxy.example:8", "other.example", "evil.example")}
    assert answers == {"gpu-node-3:1": 200, "trainer.internal": 200, "proxy.example:8": 200, "other.example": 200,
                       "evil.example": 400}


def test_the_host_verdict_cache_changes_no_verdict_and_stays_bounded() -> None:
    """The guard remembers its Host verdict per value (a client-chosen value): a refused name is
    refused after an allowed one was remembered and after being remembered itself, a client that
    sends a new Host each time only evicts (the cache never holds more than HOST_VERDICTS_KEPT),
    a refused name still refused once evicted, and an over-long Host checked but not kept."""
    from miles_contracts.wire.guard import HOST_VERDICT_MAX_CHARS, HOST_VERDICTS_KEPT, RequestGuard
    from miles_tito.server.background import BackgroundServer

    async def ok(scope, receive, send):  # type: ignore[no-untyped-def]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guards: list[RequestGuard] = []

    def make() -> RequestGuard:
        guards.append(RequestGuard(ok, token="t" * 32, public_paths=["/"], allowed_hosts=["trainer.internal"]))
        return guards[-1]

    with BackgroundServer(make) as server, httpx.Client(base_url=server.url) as client:
        def status(host: str) -> int:
            return client.get("/", headers={"Host": host}).status_code

        port = server.url.rsplit(":", 1)[1]
        for _ in range(2):  # the second round answers from the cache
            assert [status(h) for h in (f"127.0.0.1:{port}", "trainer.internal", "evil.example", f"evil.example:{port}",
                                        "127.0.0.1.evil.example", "trainer.internal.evil.example")] == [200, 200, 400, 400, 400, 400]
        verdicts = guards[0].host_verdicts
        assert verdicts.cache_info().currsize == 6
        for n in range(HOST_VERDICTS_KEPT + 50):  # a new address every request
            assert status(f"10.0.{n // 256}.{n % 256}:{port}") == 200
        assert verdicts.cache_info().currsize == verdicts.cache_info().maxsize == HOST_VERDICTS_KEPT
        assert status("evil.example") == 400 and status("trainer.internal") == 200  # evicted, judged afresh
        before = verdicts.cache_info()
        long_name = "a" * HOST_VERDICT_MAX_CHARS + ".example"
        assert status(long_name) == 400 and status("[::1]:" + "1" * HOST_VERDICT_MAX_CHARS) == 200
        after = verdicts.cache_info()
        assert (after.hits, after.misses) == (before.hits, before.misses)  # over-long values are never kept


def test_token_helpers(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    token = run_token()
    assert token and auth_headers() == {"Authorization": f"Bearer {token}"}
    assert is_authorized(f"Bearer {token}", token) and is_authorized(f"bearer  {token} ", token)
    assert not is_authorized(None, token) and not is_authorized(token, token) and not is_authorized("Bearer ", token)
    assert bearer("Basic abc") is None
    with pytest.raises(InvalidTokenError, match="at least 16"):
        check_token("short")
    monkeypatch.delenv("MILES_AUTH_TOKEN")
    made = server_token(None, name="engine")
    assert run_token() == made and f"export MILES_AUTH_TOKEN={made}" in capsys.readouterr().err
    assert server_token("y" * 20) == "y" * 20 and run_token() == "y" * 20
