"""One request with a huge ``text`` must not freeze the engine (issue 33, item 6).

Real engines (tiny random Llama) behind real uvicorn servers on loopback. Before the fix a long
``text`` was tokenized on a thread while holding the tokenizer's lock, and the event loop takes
that lock to decode every finished request's answer: a 30 MB text stopped every other request and
``/health`` for as long as it took to tokenize (157 s in the issue).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from engine_support import RunningEngine, serve_engine

pytestmark = pytest.mark.slow

DEADLINE_S = 2.0
"""What /health or a 2-token generation may take while the big request is processed: ~100x their
time on an idle engine, well below the seconds the big text takes to tokenize."""

SMALL = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}


@pytest.fixture(scope="module")
def long_context(dense_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEngine]:
    """The tiny model with a 65536-position context (its weights do not depend on it): a text of
    600k emoji is then within the length bound, so it is tokenized (seconds), not refused at once."""
    model = tmp_path_factory.mktemp("long-context") / "model"
    shutil.copytree(dense_path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 65536}))
    with serve_engine(model, context_length=65536, max_running_requests=8) as running:
        yield running


def post_text(engine: RunningEngine, text: str) -> httpx.Response:
    with httpx.Client(timeout=300, headers=engine.client.headers) as client:
        return client.post(f"{engine.url}/generate", json={"text": text, "sampling_params": {"max_new_tokens": 2}})


def others_are_served(engine: RunningEngine, big: cf.Future[httpx.Response]) -> int:
    """Until ``big`` is done: /health, then a small generation, each within the deadline.
    Returns how many rounds completed while ``big`` was still in flight."""
    rounds = 0
    with httpx.Client(base_url=engine.url, timeout=DEADLINE_S, headers=engine.client.headers) as client:
        while not big.done():
            try:
                health = client.get("/health")
                small = client.post("/generate", json=SMALL)
            except httpx.TimeoutException as exc:
                pytest.fail(f"a request waited more than {DEADLINE_S} s while one big text was processed "
                            f"({type(exc).__name__} on {exc.request.url.path})")
            assert health.status_code == 200 and small.status_code == 200, small.text
            rounds += not big.done()
    return rounds


def test_a_text_that_cannot_fit_the_context_is_refused_before_tokenizing(dense: RunningEngine) -> None:
    """The issue's 30 MB text against a 4096-token context: no token of this tokenizer stands for
    more than 81 characters, so it is at least ~370k tokens; a 400 says so without tokenizing it."""
    text = ("hello world, this is a long message. " * 850_000)[:30_000_000]
    with cf.ThreadPoolExecutor(1) as pool:
        big = pool.submit(post_text, dense, text)
        others_are_served(dense, big)
        answer = big.result()
    assert answer.status_code == 400, answer.text[:300]
    detail = answer.json()["detail"]
    assert "'text' has 30000000 characters" in detail and "context length is 4096" in detail, detail


def test_a_long_text_is_tokenized_while_other_requests_are_served(long_context: RunningEngine) -> None:
    """A text within the bound is tokenized on a worker thread with its own tokenizer: other
    generations and /health go on meanwhile, and the text then gets its 400 with the exact count."""
    with cf.ThreadPoolExecutor(1) as pool:
        big = pool.submit(post_text, long_context, "\U0001f642" * 600_000)
        served_meanwhile = others_are_served(long_context, big)
        answer = big.result()
    assert answer.status_code == 400, answer.text[:300]
    assert "the prompt has 1200000 tokens but the context length is 65536" in answer.json()["detail"]
    assert served_meanwhile >= 1

