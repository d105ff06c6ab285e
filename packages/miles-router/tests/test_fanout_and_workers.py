"""Fan-out to every worker, weight versions across quarantine, and worker management, over real
HTTP on loopback with stand-in engines (router_support.StandinEngine: these tests must make one
engine refuse an update or report a chosen weight_version)."""

from __future__ import annotations

from router_support import StandinEngine, free_port, router_for, wait_until, worker_view


def test_fanout_reaches_every_worker_and_aggregates(engines: list[StandinEngine]) -> None:
    a, b = engines
    with router_for([a.url, b.url]) as client:
        for path, body in [("/pause_generation", {"mode": "abort"}), ("/abort_request", {"abort_all": True}),
                           ("/flush_cache", None), ("/continue_generation", {}),
                           ("/update_weights_from_disk", {"model_path": "/ckpt"})]:
            response = client.post(path, json=body) if body is not None else client.post(path)
            answer = response.json()
            assert response.status_code == 200 and answer["success"] is True, answer
            assert {w["url"] for w in answer["workers"]} == {a.url, b.url}
            assert answer["failed"] == [] and answer["skipped"] == {}
            assert a.paths()[-1] == path and b.paths()[-1] == path
        assert a.received[0] == ("/pause_generation", {"mode": "abort"})
        # the engines bumped their version on the update; the router read it back
        assert client.get("/list_workers").json()["fleet_weight_version"] == "1"


def test_a_worker_that_fails_an_update_is_named_and_stops_serving(engines: list[StandinEngine]) -> None:
    a, b = engines
    b.refuse.add("/update_weight_version")
    with router_for([a.url, b.url]) as client:
        response = client.post("/update_weight_version", json={"new_version": "5"})
        answer = response.json()
        assert response.status_code == 502 and answer["success"] is False
        assert answer["failed"] == [b.url]
        assert f"1 of 2 workers failed /update_weight_version: {b.url}: HTTP 400: standin refuses" in answer["message"]
        assert worker_view(client, b.url)["state"] == "stale_weights"
        assert all(client.post("/generate", json={"input_ids": [1]}).headers["x-miles-worker"] == a.url
                   for _ in range(3))
        # the held-back worker still gets the next update, and serves again once it has it
        b.refuse.clear()
        assert client.post("/update_weight_version", json={"new_version": "6"}).status_code == 200
        assert worker_view(client, b.url)["state"] == "healthy"
        assert client.get("/list_workers").json()["fleet_weight_version"] == "6"


def test_a_worker_back_from_quarantine_with_old_weights_waits_for_the_fleet(engines: list[StandinEngine]) -> None:
    a, b = engines
    with router_for([a.url, b.url], health_interval=0.05, failure_threshold=2) as client:
        assert client.post("/update_weight_version", json={"new_version": "3"}).status_code == 200
        b.healthy = False
        wait_until(lambda: worker_view(client, b.url)["state"] == "quarantined")
        # while b is away the fleet is paused, and b restarts from its initial weights
        paused = client.post("/pause_generation", json={"mode": "retract"}).json()
        assert paused["skipped"][b.url].startswith("quarantined")
        b.version, b.paused, b.healthy = "0", False, True
        wait_until(lambda: worker_view(client, b.url)["state"] == "stale_weights")
        assert "weight_version 0 is behind the fleet's 3" in worker_view(client, b.url)["reason"]
        # a weight update brings it up to date; it is paused like the fleet before it serves
        assert client.post("/update_weights_from_disk", json={"model_path": "/ckpt", "weight_version": "4"}).status_code == 200
        assert worker_view(client, b.url)["state"] == "healthy"
        assert b.version == "4" and b.paused is True
        # (a worker re-admitted from quarantine is brought to the pause state by the router itself)
        a.healthy = False
        wait_until(lambda: worker_view(client, a.url)["state"] == "quarantined")
        a.paused = False
        a.healthy = True
        wait_until(lambda: worker_view(client, a.url)["state"] == "healthy")
        assert a.paused is True and a.paths()[-1] == "/pause_generation"
        assert client.post("/continue_generation").status_code == 200
        assert not a.paused and not b.paused


def test_a_router_started_before_a_mixed_fleet_serves_only_the_newest_weights(engines: list[StandinEngine]) -> None:
    a, b = engines
    a.version, b.version = "1", "3"  # a is the engine listed first, and it is behind
    with router_for([a.url, b.url]) as client:
        assert worker_view(client, a.url)["state"] == "stale_weights"
        assert worker_view(client, b.url)["state"] == "healthy"
        assert client.get("/list_workers").json()["fleet_weight_version"] == "3"


def test_fanout_with_no_reachable_worker_says_so() -> None:
    with router_for([f"http://127.0.0.1:{free_port()}"]) as client:
        response = client.post("/abort_request", json={"abort_all": True})
        assert response.status_code == 503
        answer = response.json()
        assert answer["success"] is False and "no reachable worker" in answer["message"]
        assert list(answer["skipped"].values())[0].startswith("pending: not answering yet")


def test_add_list_and_remove_workers(engines: list[StandinEngine]) -> None:
    a, b = engines
    with router_for([a.url]) as client:
        added = client.post("/add_worker", params={"url": b.url + "/"})
        assert added.status_code == 200 and added.json()["added"] is True
        assert added.json()["worker"]["state"] == "healthy"  # probed at once
        again = client.post("/add_worker", json={"url": b.url}).json()
        assert again["added"] is False and "already registered" in again["message"]
        listed = client.get("/list_workers").json()
        assert listed["urls"] == [a.url, b.url]
        view = listed["workers"][1]
        assert {k: view[k] for k in ("healthy", "in_flight", "weight_version", "consecutive_failures")} == {
            "healthy": True, "in_flight": 0, "weight_version": "0", "consecutive_failures": 0}
        removed = client.post("/remove_worker", json={"url": a.url})
        assert removed.status_code == 200 and removed.json()["removed"] is True
        assert client.get("/list_workers").json()["urls"] == [b.url]
        assert client.post("/generate", json={"input_ids": [1]}).headers["x-miles-worker"] == b.url


def test_bad_input_gets_a_4xx_that_says_how_to_fix_it(engines: list[StandinEngine]) -> None:
    a, _ = engines
    with router_for([a.url]) as client:
        as_json = {"content-type": "application/json"}
        cases = [
            (client.post("/add_worker"), 400, "give the worker URL: POST /add_worker?url=http://HOST:PORT"),
            (client.post("/add_worker", params={"url": "localhost:3000"}), 400, "must start with http://"),
            (client.post("/add_worker", json={"url": "http://h:1/generate"}), 400, "without path or query"),
            (client.post("/add_worker", content=b"{not json", headers=as_json), 400, "not valid JSON"),
            (client.post("/remove_worker", params={"url": "http://127.0.0.1:9"}), 404,
             f"worker 'http://127.0.0.1:9' is not registered (registered: {a.url})"),
            (client.post("/remove_worker", params={"url": "nope"}), 400, "must start with http://"),
            (client.post("/generate", content=b"[1, 2]", headers=as_json), 400, "must be a JSON object, got list"),
            (client.post("/generate", content=b"{'a': 1}", headers=as_json), 400, "not valid JSON"),
            (client.post("/init_weights_update_group", json={}), 400, "needs its own rank_offset"),
            (client.get("/metrics", params={"format": "xml"}), 400, "use format=json"),
            (client.post("/generate", content=b"{}"), 415, "must be JSON"),
        ]
        for response, status, says in cases:
            assert response.status_code == status, response.text
            assert says in response.json()["detail"], response.json()
        # nothing was lost or changed by the bad requests
        assert client.get("/list_workers").json()["urls"] == [a.url]
        assert client.post("/generate", json={"input_ids": [1]}).status_code == 200


def test_a_paused_engine_is_probed_as_paused_never_quarantined(engines: list[StandinEngine]) -> None:
    import time

    from miles_router.health import Probe

    a, b = engines
    with router_for([a.url, b.url], health_interval=0.05, failure_threshold=1) as client:
        router = client.server.router
        original = router.monitor._probe

        async def paused_probe(worker):  # a's /health answers 503 {"status": "paused"}
            return Probe("0", paused=True) if worker.url == a.url else await original(worker)

        router.monitor._probe = paused_probe
        time.sleep(0.5)  # many probe rounds, with a failure threshold of 1
        view = worker_view(client, a.url)
        assert view["state"] == "healthy" and view["paused"] is True
        answers = [client.post("/generate", json={"input_ids": [1]}) for _ in range(4)]
        assert {r.headers["x-miles-worker"] for r in answers} == {b.url}
