"""Continuous batching, abort and pause on a real server (tiny random Llama), seen from inside.

Batching is asserted on the engine's own statistics (``/server_info``), never on time. What any
engine must do over HTTP (abort by rid and all, the three pause modes, cache flush) is the
contract suite's (``tests/test_engine_contract.py``).
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from engine_support import serve_engine, wait_until

LONG = {"max_new_tokens": 4000, "ignore_eos": True}


@pytest.fixture
def engine(dense_path):
    with serve_engine(dense_path, max_running_requests=32) as running:
        yield running


def stats(engine) -> dict:
    return engine.info()["stats"]


def test_concurrent_requests_are_decoded_together(engine):
    engine.post("/pause_generation", {"mode": "in_place"})
    bodies = [{"input_ids": [1, 10 + i, 20 + i], "rid": f"r{i}",
               "sampling_params": {"max_new_tokens": 12 + i, "ignore_eos": True}} for i in range(16)]
    with cf.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(engine.generate, b) for b in bodies]
        wait_until(lambda: engine.info()["waiting"] == 16)
        engine.post("/continue_generation")
        outs = [f.result() for f in futures]
    assert [len(o["output_ids"]) for o in outs] == [12 + i for i in range(16)]
    s = stats(engine)
    assert s["max_decode_batch"] == 16
    # Requests leave as they finish (different lengths), so batches shrink: still far from one at a time.
    assert s["decode_steps"] < sum(12 + i for i in range(16)) / 4


def test_a_request_joins_a_running_batch(engine):
    with cf.ThreadPoolExecutor(2) as pool:
        long = pool.submit(engine.generate, {"input_ids": [1, 2, 3], "rid": "long", "sampling_params": LONG})
        wait_until(lambda: stats(engine)["decode_steps"] >= 3)
        short = pool.submit(engine.generate, {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
        assert len(short.result()["output_ids"]) == 8
        assert not long.done()  # the late, short request finished while the long one kept running
        engine.post("/abort_request", {"rid": "long"})
        assert long.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert stats(engine)["max_decode_batch"] == 2


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_holds_requests_and_continue_finishes_them(engine, mode):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 3}}
    reference = engine.generate(body)["output_ids"]
    with cf.ThreadPoolExecutor(2) as pool:
        running = pool.submit(engine.generate, body)
        wait_until(lambda: engine.info()["running"] == 1 and stats(engine)["decode_steps"] >= 1)
        assert engine.post("/pause_generation", {"mode": mode}).json()["status"] == "ok"
        held_at = stats(engine)["decode_steps"]
        queued = pool.submit(engine.generate, {"input_ids": [1, 9], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
        wait_until(lambda: engine.info()["waiting"] >= 1 + (mode == "retract"))
        info = engine.info()
        assert info["paused"] and stats(engine)["decode_steps"] == held_at
        assert not running.done() and not queued.done()
        engine.post("/continue_generation")
        out = running.result()
        assert len(queued.result()["output_ids"]) == 5
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    # Same weights, same seed: pausing (even retracting and re-prefilling) does not change the tokens.
    assert out["output_ids"] == reference


def test_pause_abort_mode_aborts_in_flight_requests(engine):
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(engine.generate, {"input_ids": [1, 2], "sampling_params": LONG})
        wait_until(lambda: engine.info()["running"] == 1)
        engine.post("/pause_generation", {"mode": "abort"})
        assert running.result()["meta_info"]["finish_reason"]["type"] == "abort"
    for route in ("/health", "/health_generate"):  # paused: a router must send new work elsewhere
        answer = engine.get(route)
        assert answer.status_code == 503 and answer.json()["status"] == "paused"
    engine.post("/continue_generation")
    assert engine.get("/health_generate").status_code == 200
    assert engine.post("/flush_cache").status_code == 200  # idle after the abort: SGLang flushes only then


def test_a_client_that_goes_away_frees_its_batch_slot(engine):
    import httpx

    with pytest.raises(httpx.ReadTimeout):
        engine.client.post("/generate", json={"input_ids": [1, 2], "sampling_params": LONG}, timeout=1.0)
    wait_until(lambda: engine.info()["running"] == 0)
    assert stats(engine)["finished"]["abort"] == 1
