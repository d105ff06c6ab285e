"""The driver's side of ``resources.release_engine_memory`` (``miles.loop.engine_memory``) against a
real embedded engine (tiny model, CPU) behind uvicorn on loopback: what a released engine refuses
and holds, what comes back, in which order, and which engines are asked. The engine's fleet (its
URL and start count, which ``miles.loop.services.Services`` keeps in a run) is a plain record here;
the end-to-end runs in ``test_train_e2e.py`` use the real one, with a supervisor that restarts."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from miles.errors import MilesError
from miles.loop.engine_memory import WEIGHTS, EngineMemory
from miles_contracts.wire.auth import auth_headers

PROMPT = {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}


@dataclass
class Fleet:
    """Engine name -> URL, and how often each was started again (what the supervisor counts)."""

    engine_urls: dict[str, str]
    restarts: dict[str, int] = field(default_factory=dict)

    def starts(self, name: str) -> int:
        return self.restarts.get(name, 0)


class Served:
    """A real engine behind uvicorn on a thread, and a client with the run's token."""

    def __init__(self, engine: Any, app: Any) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.engine = engine
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the engine's server did not start"
            time.sleep(0.01)
        self.client = httpx.Client(base_url=self.url, timeout=60, headers=auth_headers())

    def health(self) -> tuple[int, dict[str, Any]]:
        response = self.client.get("/health")
        return response.status_code, response.json()

    def released(self) -> list[str]:
        return list(self.client.get("/server_info").json()["memory_released"])

    def greedy(self) -> list[int]:
        response = self.client.post("/generate", json=PROMPT)
        assert response.status_code == 200, response.text
        return list(response.json()["output_ids"])

    def close(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(20)


@pytest.fixture(scope="module")
def served(tiny_dense: Path) -> Iterator[Served]:
    from miles_engine import Engine, create_app

    engine = Engine(tiny_dense, device="cpu", context_length=256, max_running_requests=8, prefill_wait_ms=0,
                    weight_dir=[str(tiny_dense)])
    running = Served(engine, create_app(engine))
    try:
        yield running
    finally:
        running.close()
        engine.shutdown()


def _reload(served: Served, model: Path) -> httpx.Response:
    """A weight update, standing in for the sync (the same weights, from the model's folder)."""
    return served.client.post("/update_weights_from_disk", json={"model_path": str(model)})


def test_released_engines_refuse_weights_and_hold_requests_until_everything_is_back(served: Served,
                                                                                     tiny_dense: Path) -> None:
    """``all``: after the release the engine answers /health 503 paused (which the run's health
    wait and the router count as alive) and refuses weight updates; the weights come back first
    (a sync may then land), the KV cache after, and then it generates what it did before."""
    before = served.greedy()
    memory = EngineMemory("all", Fleet({"engine-0": served.url}))
    assert asyncio.run(memory.release()) > 0
    assert memory.holding == {"engine-0"}
    status, body = served.health()
    assert status == 503 and body["status"] == "paused"
    assert served.released() == ["cuda_graph", "kv_cache", "weights"]
    refused = _reload(served, tiny_dense)
    assert refused.status_code == 400 and "weights are released" in refused.json()["message"]

    asyncio.run(memory.resume(WEIGHTS))
    assert _reload(served, tiny_dense).status_code == 200
    assert served.health()[0] == 503  # the KV cache is still released: nothing generates yet
    assert memory.holding == {"engine-0"}

    asyncio.run(memory.resume())
    assert memory.holding == set()
    assert served.health() == (200, {"status": "ok"})
    assert served.greedy() == before


def test_a_release_waits_for_what_the_pause_aborted_to_end(served: Served) -> None:
    """A request still running when the release comes (none should, after a sync rollout) is
    aborted by the pause, and the release goes out only once the engine is idle: SGLang's
    scheduler dies on a release while anything runs."""
    answers: list[dict[str, Any]] = []
    long = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 1.0, "max_new_tokens": 200, "ignore_eos": True}}
    worker = threading.Thread(target=lambda: answers.append(served.client.post("/generate", json=long).json()))
    worker.start()
    deadline = time.monotonic() + 60
    while not served.engine.scheduler.running:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.01)
    memory = EngineMemory("kv_cache", Fleet({"engine-0": served.url}))
    asyncio.run(memory.release())
    worker.join(60)
    assert answers[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(answers[0]["output_ids"]) < 200
    assert served.released() == ["kv_cache"]
    asyncio.run(memory.resume())
    assert served.health()[0] == 200


def test_an_engine_restarted_since_its_release_is_not_asked_to_resume(served: Served) -> None:
    """A restart (the supervisor's count moved) gave a fresh process that holds all of its memory,
    and SGLang's scheduler dies on a resume of a tag it never released: the resume leaves it
    alone. (Here the process stayed; that it is still released shows that nothing was sent.)"""
    fleet = Fleet({"engine-0": served.url})
    memory = EngineMemory("kv_cache", fleet)
    asyncio.run(memory.release())
    fleet.restarts["engine-0"] = 1
    asyncio.run(memory.resume())
    assert memory.holding == set()
    assert served.released() == ["kv_cache"]
    served.client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).raise_for_status()
    served.client.post("/continue_generation", json={}).raise_for_status()
    assert served.health()[0] == 200


def test_an_engine_that_refuses_stops_the_run_and_one_that_is_gone_is_left_to_the_supervisor(served: Served) -> None:
    """An answer with an error status would come again (here: a server with another token), so the
    run stops with it, naming the engine; an engine nobody answers for is dead, and the supervisor
    starts it again with all of its memory, so the release goes on without it."""
    from miles_engine import create_app

    strange = Served(served.engine, create_app(served.engine, auth_token="another-run's-token-" + "x" * 16))
    try:
        with pytest.raises(MilesError, match=r"could not release the engines' memory \(resources.release_engine_memory: "
                                             r"kv_cache\): engine-1: engine returned HTTP 401"):
            asyncio.run(EngineMemory("kv_cache", Fleet({"engine-1": strange.url})).release())
    finally:
        strange.close()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    memory = EngineMemory("all", Fleet({"engine-0": served.url, "engine-1": closed}))
    asyncio.run(memory.release())
    assert memory.holding == {"engine-0"}
    asyncio.run(memory.resume())
    assert memory.holding == set() and served.health()[0] == 200
