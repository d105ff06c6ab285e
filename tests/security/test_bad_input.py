"""Round two of bad input, against the real engine and router on loopback: values the schema took
in lax mode, a penalty that made the sampler's math non-finite, bodies and paths that became 5xx,
and a router that said "ok" while no engine would serve.

Every answer to a client's mistake is a 4xx naming the field; the engine keeps serving after it.
"""

from __future__ import annotations

import math

import pytest
from security_support import free_port

GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}


def _detail(answer) -> str:
    body = answer.json()
    return body.get("detail") or body.get("message") or ""


@pytest.mark.parametrize(("body", "says"), [
    ({"input_ids": ["1"]}, "input_ids.0"),  # once taken as token 1
    ({"input_ids": [False]}, "input_ids.0"),  # once token 0
    ({"input_ids": [True, 2]}, "input_ids.0"),
    ({"input_ids": [1.0]}, "input_ids.0"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),  # once one token
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"top_k": "5"}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [True]}}, "stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"sampling_seed": False}}, "sampling_seed"),
    ({"input_ids": [1], "logprob_start_len": 2**70}, "logprob_start_len"),
])
def test_integers_must_be_json_integers(engine, body: dict, says: str) -> None:
    answer = engine.client.post("/generate", json=body)
    assert answer.status_code == 400 and says in _detail(answer), answer.text
    assert "valid integer" in _detail(answer) or "less than" in _detail(answer)


def test_a_repetition_penalty_near_zero_is_a_400_and_the_smallest_taken_keeps_logprobs_finite(engine) -> None:
    """1e-39 divided every seen token's positive logit into infinity: the answer was one token
    repeated with "null" log-probs (NaN). The bound (0.01) is SGLang's range cut where the math
    stays finite; at the bound, greedy and sampled, every log-prob is a finite number."""
    for tiny in (1e-39, 0.0, 0.009):
        answer = engine.client.post("/generate", json={**GOOD, "sampling_params": {"repetition_penalty": tiny}})
        assert answer.status_code == 400 and "repetition_penalty" in _detail(answer), answer.text
        assert "greater than or equal to 0.01" in _detail(answer)
    for temperature in (0.0, 1.0):
        sampling = {"max_new_tokens": 8, "ignore_eos": True, "repetition_penalty": 0.01, "temperature": temperature}
        answer = engine.client.post("/generate", json={"input_ids": [1, 2, 3], "return_logprob": True,
                                                       "sampling_params": sampling})
        assert answer.status_code == 200, answer.text
        logprobs = [entry[0] for entry in answer.json()["meta_info"]["output_token_logprobs"]]
        assert len(logprobs) == 8 and all(isinstance(x, float) and math.isfinite(x) for x in logprobs), logprobs


@pytest.mark.parametrize(("version", "says"), [
    ("", "at least 1 character"),
    ("v" * (1 << 19), "at most 256 characters"),  # half a megabyte, echoed in every answer and probe
    ("7\nINFO forged log line", "printable"),
])
def test_a_weight_version_is_1_to_256_printable_characters(engine, router, version: str, says: str) -> None:
    before = engine.client.get("/model_info").json()["weight_version"]
    answer = engine.client.post("/update_weight_version", json={"new_version": version, "abort_all_requests": False})
    assert answer.status_code == 400 and "new_version" in _detail(answer) and says in _detail(answer), answer.text[:300]
    # through the router: every engine refused the client's request, so the answer is their 400, not a 502
    fanned = router.client.post("/update_weight_version", json={"new_version": version, "abort_all_requests": False})
    assert fanned.status_code == 400 and fanned.json()["success"] is False, fanned.text[:300]
    assert engine.client.get("/model_info").json()["weight_version"] == before
    assert engine.client.post("/generate", json=GOOD).status_code == 200


@pytest.mark.parametrize(("change", "says"), [
    ({"master_port": 70000}, "master_port"),  # TCPStore's uint16 port: once a TypeError and a 500
    ({"master_port": 0}, "master_port"),
    ({"master_port": -1}, "master_port"),
    ({"master_port": "1234"}, "master_port"),
    ({"master_port": True}, "master_port"),
    ({"world_size": 2**40}, "world_size"),
    ({"rank_offset": -1}, "rank_offset"),
    ({"group_name": ""}, "group_name"),
    ({"group_name": "a\x00b"}, "group_name"),
    ({"master_address": ""}, "master_address"),
])
def test_a_weight_group_join_with_impossible_values_is_a_400(engine, change: dict, says: str) -> None:
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "group_name": "bad-input", **change}
    answer = engine.client.post("/init_weights_update_group", json=body)
    assert answer.status_code == 400 and says in _detail(answer), answer.text[:300]
    assert engine.client.get("/health").status_code == 200


@pytest.mark.parametrize("model_path", ["/tmp/a\x00b", "~no-such-user-here/ckpt"])
def test_a_weight_path_the_os_cannot_use_is_a_400(engine, model_path: str) -> None:
    """A NUL byte (ValueError) or the home of a user that does not exist (RuntimeError) was a 500."""
    answer = engine.client.post("/update_weights_from_disk", json={"model_path": model_path})
    assert answer.status_code == 400 and "not a usable path" in _detail(answer), answer.text[:300]


@pytest.mark.parametrize("path", ["/caf\u00e9", "/\u4e2d\u6587", "/%E4%B8%AD", "/%ff", "/model_info%0D%0AX-Evil:%201",
                                  "/model_info%3Fx=1"])
def test_a_router_path_that_is_not_ascii_is_encoded_not_a_5xx(router, path: str) -> None:
    """The router decoded the path and wrote it back as Latin-1: text beyond it raised inside the
    forwarder (a 503 "router error"), and a decoded CR/LF would have ended the request line. It is
    percent-encoded again, so the engine gets a path it can answer: none of these routes exists."""
    answer = router.client.get(path)
    assert answer.status_code == 404, answer.text[:300]
    assert router.client.get("/model_info").status_code == 200


def test_a_mooncake_session_host_that_does_not_resolve_is_a_400(engine) -> None:
    """The name lookup's socket.gaierror (an OSError) was a 500."""
    body = {"session_id": "no-such-host.invalid:1234", "address": 0, "size": 0, "sha256": "0" * 64, "tensors": []}
    answer = engine.client.post("/update_weights_from_mooncake", json=body)
    assert answer.status_code == 400 and "cannot pull the bucket over Mooncake" in _detail(answer), answer.text[:300]


@pytest.mark.parametrize("url", ["http://[::1", "http://a\x00b:1", "http://a b:1"])
def test_a_worker_url_that_is_not_one_is_a_400(router, url: str) -> None:
    """An unclosed IPv6 bracket (urlsplit's ValueError) and a NUL in the host (httpx.InvalidURL in
    the first probe) were 500s from POST /add_worker."""
    answer = router.client.post("/add_worker", json={"url": url})
    assert answer.status_code == 400 and "worker URL" in _detail(answer), answer.text[:300]
    assert router.client.post("/remove_worker", json={"url": url}).status_code == 400
    assert len(router.client.get("/list_workers").json()["workers"]) == 1


def test_a_deeply_nested_body_is_a_400_at_the_router(router) -> None:
    """Ten thousand levels overflowed json.loads (a 500); five hundred parsed and then overflowed
    the forwarder's json.dumps (a 503 "router error")."""
    json_type = {"content-type": "application/json"}
    for body in (b"[" * 10_000 + b"]" * 10_000, b'{"a": ' * 10_000 + b"1" + b"}" * 10_000,
                 b'{"input_ids": [1], "x": ' + b"[" * 500 + b"]" * 500 + b"}"):
        answer = router.client.post("/generate", content=body, headers=json_type)
        assert answer.status_code == 400 and "nest deeper than 100 levels" in _detail(answer), answer.text[:300]
    assert router.client.post("/generate", json=GOOD).status_code == 200


def test_a_deeply_nested_body_or_tool_call_is_no_5xx_at_the_session_server(session_server) -> None:
    """Both json.loads of the session server overflowed into a 500: the request body's, and the
    one that hands a tool call's arguments to the chat template."""
    json_type = {"content-type": "application/json"}
    created = session_server.client.post("/sessions", content=b"[" * 10_000 + b"]" * 10_000, headers=json_type)
    assert created.status_code == 400 and "nest deeper than 100 levels" in created.text, created.text[:300]
    chat = f"{session_server.client.post('/sessions').json()['base_url']}/chat/completions"
    nested = session_server.client.post(chat, content=b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
                                        headers=json_type)
    assert nested.status_code == 400 and "nest deeper than 100 levels" in nested.text, nested.text[:300]
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "1", "content": "ok"}]
    answer = session_server.client.post(chat, json={"messages": messages, "max_tokens": 2})
    # the arguments stay text, as any that are not an object; rendered, they outgrow the suite's context
    assert answer.status_code == 400 and "context limit" in answer.text, answer.text[:300]


def test_the_router_is_paused_while_every_engine_is_and_its_callers_still_see_it_up(engine, router,
                                                                                     tmp_path) -> None:
    """A weight sync pauses every engine. The router answered 200 "ok" then; now 503
    {"status": "paused"}, the engines' own answer, which its callers read as alive: the loop's wait
    before a rollout (Services.wait_ready with the router), and a router in front of it, which
    holds it as paused instead of quarantining it."""
    from miles.loop.services import Planned, Services
    from miles.placement import Node, Slot
    from miles_contracts.cluster import ROUTER
    from miles_router import RouterServer
    from miles_router.config import RouterSection

    class Executor:
        """Only what Services.wait_ready asks: whether the router process is alive (it is)."""

        def alive(self, name: str) -> bool:
            return True

    role = type("Role", (), {"needs": (), "role": ROUTER})()
    services = Services(Executor(), tmp_path, config=None, model_path=tmp_path,
                        planned={"router": Planned("router", ROUTER, role, Slot(Node("n", "127.0.0.1", ())))},
                        urls={"router": router.url})
    section = RouterSection(health_interval=0.2, health_timeout=5.0)
    assert router.client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
    try:
        health = router.client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "paused", health.text
        assert "paused" in health.json()["message"]  # public: the status and a fixed hint, no counts
        assert [w["paused"] for w in router.client.get("/list_workers").json()["workers"]] == [True]
        assert services.wait_ready(10, router=True) < 10
        with RouterServer([router.url], section=section) as front:
            child = front.router.fleet.get(router.url)
            assert child.state.value == "healthy" and child.paused
            assert front.router.health()[1]["status"] == "paused"
    finally:
        router.client.post("/continue_generation", json={})
    health = router.client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    assert engine.client.post("/generate", json=GOOD).status_code == 200
