"""Routing over real HTTP on loopback: least-in-flight, affinity, failover, aborts, streaming.

The engines here are stand-ins (router_support.StandinEngine) because these tests must hold
requests open or make an engine drop a connection on cue; the real-engine behaviour is in
test_reliability.py.
"""

from __future__ import annotations

import json

import httpx
import pytest
from miles_contracts.wire.engine import ROUTING_KEY_HEADER, GenerateResponse
from router_support import (
    DroppingServer,
    StandinEngine,
    free_port,
    in_background,
    router_for,
    running,
    wait_until,
    worker_view,
)

PROMPT = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


def _in_flight(client: httpx.Client) -> dict[str, int]:
    return {w["url"]: w["in_flight"] for w in client.get("/list_workers").json()["workers"]}


def test_concurrent_requests_spread_by_requests_in_flight(engines: list[StandinEngine]) -> None:
    a, b = engines
    for engine in engines:
        engine.release.clear()
    with router_for([a.url, b.url]) as client:
        futures = in_background([lambda: client.post("/generate", json=PROMPT) for _ in range(8)])
        wait_until(lambda: sum(_in_flight(client).values()) == 8)
        assert _in_flight(client) == {a.url: 4, b.url: 4}
        for engine in engines:
            engine.release.set()
        assert all(f.result().status_code == 200 for f in futures)
        assert _in_flight(client) == {a.url: 0, b.url: 0}


def test_a_busy_worker_gets_nothing_new_until_it_frees_up(engines: list[StandinEngine]) -> None:
    a, b = engines
    a.release.clear()  # a holds whatever it gets; b answers at once
    with router_for([a.url, b.url]) as client:
        held = in_background([lambda: client.post("/generate", json=PROMPT)])
        wait_until(lambda: sum(_in_flight(client).values()) == 1)
        busy = a.url if _in_flight(client)[a.url] else b.url
        assert busy == a.url
        for _ in range(5):
            assert client.post("/generate", json=PROMPT).headers["x-miles-worker"] == b.url
        assert (worker_view(client, a.url)["dispatched"], worker_view(client, b.url)["dispatched"]) == (1, 5)
        a.release.set()
        assert held[0].result().status_code == 200


def test_same_routing_key_reaches_the_same_worker_until_it_leaves(engines: list[StandinEngine]) -> None:
    a, b = engines
    with router_for([a.url, b.url]) as client:
        def worker_for(key: str) -> str:
            response = client.post("/generate", json=PROMPT, headers={ROUTING_KEY_HEADER: key})
            assert response.status_code == 200
            return response.headers["x-miles-worker"]

        first = {key: worker_for(key) for key in ("s1", "s2", "s3", "s4")}
        assert set(first.values()) == {a.url, b.url}  # new sessions are spread
        for _ in range(3):
            assert {key: worker_for(key) for key in first} == first
        # the router's own affinity table holds the session
        assert client.server.router.policy.affinity.get("s1") == first["s1"]
        gone = first["s1"]
        assert client.post("/remove_worker", params={"url": gone}).status_code == 200
        moved = worker_for("s1")
        assert moved != gone
        assert all(worker_for("s1") == moved for _ in range(3))


@pytest.mark.parametrize(("forward_client", "lost"), [("lean", "ConnectionLost"), ("httpx", "RemoteProtocolError")])
def test_a_dropped_connection_is_retried_elsewhere_and_the_worker_quarantined(forward_client: str, lost: str) -> None:
    dropper, engine = DroppingServer(), StandinEngine()
    with running(dropper, engine), router_for([dropper.url, engine.url], failure_threshold=2,
                                              forward_client=forward_client) as client:
        assert worker_view(client, dropper.url)["state"] == "healthy"  # it answers health probes
        responses = [client.post("/generate", json=PROMPT) for _ in range(6)]
        assert all(r.status_code == 200 and r.headers["x-miles-worker"] == engine.url for r in responses)
        assert all(GenerateResponse.model_validate(r.json()).meta_info.finish_reason.type == "length" for r in responses)
        assert dropper.dropped == 2  # the third request found it quarantined
        assert sorted(r.headers["x-miles-attempts"] for r in responses) == ["1", "1", "1", "1", "2", "2"]
        view = worker_view(client, dropper.url)
        assert view["state"] == "quarantined"
        assert "2 consecutive failures" in view["reason"] and lost in view["last_error"]


def test_an_engine_that_went_away_between_requests_is_failed_over(engines: list[StandinEngine]) -> None:
    a, b = engines
    with router_for([a.url, b.url], failure_threshold=1) as client:
        a.server.stop()  # nothing listens there any more: connections are refused
        for _ in range(4):
            response = client.post("/generate", json=PROMPT)
            assert response.status_code == 200 and response.headers["x-miles-worker"] == b.url
        view = worker_view(client, a.url)
        assert view["state"] == "quarantined" and "ConnectFailed" in view["last_error"]


def test_no_engine_gives_an_sglang_abort_with_the_reason() -> None:
    with router_for([]) as client:
        response = client.post("/generate", json={**PROMPT, "rid": "req-7"})
        assert response.status_code == 200
        assert response.headers["x-miles-router-abort"] == "no_worker"
        answer = GenerateResponse.model_validate(response.json())
        assert answer.meta_info.id == "req-7" and answer.meta_info.prompt_tokens == 3
        assert answer.meta_info.finish_reason.type == "abort"
        assert "POST /add_worker" in answer.meta_info.finish_reason.message
        batch = client.post("/generate", json={"input_ids": [[1], [2, 3]]}).json()
        assert [item["meta_info"]["prompt_tokens"] for item in batch] == [1, 2]
        other = client.get("/get_model_info")
        assert other.status_code == 503 and "no engine is registered" in other.json()["detail"]
        health = client.get("/health")
        assert health.status_code == 503 and "add one with POST /add_worker" in health.json()["message"]


def test_when_every_engine_fails_the_abort_names_each_failure() -> None:
    first, second = DroppingServer(), DroppingServer()
    with running(first, second), router_for([first.url, second.url], failure_threshold=5) as client:
        response = client.post("/generate", json=PROMPT)
        assert response.headers["x-miles-router-abort"] == "attempts_exhausted"
        message = response.json()["meta_info"]["finish_reason"]["message"]
        assert "after 2 attempt(s)" in message and first.url in message and second.url in message


def test_a_worker_that_is_not_up_yet_joins_when_it_answers() -> None:
    port = free_port()
    late = StandinEngine()
    late.server.port = port
    late.server.server.config.port = port
    with router_for([], health_interval=0.05) as client:
        added = client.post("/add_worker", json={"url": late.url}).json()
        assert added["added"] is True and added["worker"]["state"] == "pending"
        assert client.get("/health").status_code == 503
        with running(late):
            wait_until(lambda: worker_view(client, late.url)["state"] == "healthy")
            assert client.get("/health").json() == {"status": "ok"}  # public: liveness, no counts
            assert client.get("/list_workers").json()["counts"]["healthy"] == 1
            assert client.post("/generate", json=PROMPT).headers["x-miles-worker"] == late.url


def test_streamed_answers_pass_through(engines: list[StandinEngine]) -> None:
    a, b = engines
    with router_for([a.url, b.url]) as client:
        with client.stream("POST", "/generate", json={**PROMPT, "stream": True}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) == 3
        assert sum(_in_flight(client).values()) == 0


def test_an_engine_dying_mid_stream_ends_the_stream_with_an_abort() -> None:
    dropper = DroppingServer()
    with running(dropper), router_for([dropper.url]) as client:
        with client.stream("POST", "/generate", json={**PROMPT, "stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert events[0] == 'data: {"text": 1}' and events[-1] == "data: [DONE]"
        reason = json.loads(events[-2].removeprefix("data: "))["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "failed mid-stream" in reason["message"]
        assert worker_view(client, dropper.url)["in_flight"] == 0


def test_a_request_past_the_timeout_is_aborted_not_retried(engines: list[StandinEngine]) -> None:
    a, b = engines
    for engine in engines:
        engine.release.clear()
    with router_for([a.url, b.url], request_timeout=0.5) as client:
        try:
            response = client.post("/generate", json=PROMPT)
        finally:
            for engine in engines:
                engine.release.set()
        assert response.headers["x-miles-router-abort"] == "timeout"
        message = response.json()["meta_info"]["finish_reason"]["message"]
        assert "did not answer within 0.5s (ResponseTimeout" in message and "not retried" in message
        assert len(a.received) + len(b.received) == 1


def test_other_paths_go_to_one_healthy_worker(engines: list[StandinEngine]) -> None:
    a, b = engines
    with router_for([a.url, b.url]) as client:
        info = client.get("/get_model_info")
        assert info.status_code == 200 and info.json()["model_path"] == "standin"
