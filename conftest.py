"""Repo-wide pytest setup: offline model hub, a run token, the `gpu` marker skips without CUDA, and
the tiny random models of ``miles_models.testing`` as fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_contracts.wire.auth import ensure_run_token

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# As under `miles train`: one token for the session, inherited by every server a test starts and
# sent by every Miles client; tests that talk HTTP themselves add `auth_headers()`.
ensure_run_token()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items) or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dense() -> Path:
    """miles-models' tiny Llama (tied embeddings, 4 heads in 2 groups, SmolLM2's vocabulary)."""
    from miles_models.testing import tiny_model

    return tiny_model("dense")


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    """miles-models' tiny Qwen3-MoE (2 MoE layers, 4 experts, top-2)."""
    from miles_models.testing import tiny_model

    return tiny_model("moe")


class RewardGate:
    """A ``remote`` reward endpoint on loopback (``reward.name=remote reward.remote_url=<url>``) that
    holds one scoring request until the test lets it go: a run is then stopped at a known point
    (after that step's generation, before its training and weight sync), e.g. to kill a process
    there. Scores each answer's fraction of vowels (deterministic, different within a group)."""

    def __init__(self, hold: int, *, and_after: bool = False) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.hold, self.and_after, self.requests = hold, and_after, 0  # and_after: hold every later one too
        self.reached, self.released = threading.Event(), threading.Event()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server dispatches a POST to do_POST
                import json

                samples = json.loads(self.rfile.read(int(self.headers["content-length"])))["samples"]
                with lock:
                    gate.requests += 1
                    held = gate.requests == gate.hold or (gate.and_after and gate.requests > gate.hold > 0)
                if held:
                    gate.reached.set()
                    # held until the test (or close()) lets go: a timer here would release it early on a
                    # loaded machine, before the test acted; the bound only ends a request nobody released
                    gate.released.wait(600)
                rewards = [sum(c in "aeiou" for c in s["response"]) / max(len(s["response"]), 1) for s in samples]
                body = json.dumps({"rewards": rewards}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def reward_gate() -> Iterator[RewardGate]:
    """A :class:`RewardGate` that holds the second scoring request (a step's first, after step 1's
    single round: set ``.hold`` before the run starts for another)."""
    gate = RewardGate(hold=2)
    yield gate
    gate.close()


@pytest.fixture(scope="session")
def vowel_reward() -> Iterator[str]:
    """The URL of a ``remote`` reward that scores each answer's fraction of vowels, holding nothing."""
    gate = RewardGate(hold=0)
    yield gate.url
    gate.close()
