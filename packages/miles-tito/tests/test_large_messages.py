"""One agent's huge message must not freeze the session server for everyone else (issue 33, item 6).

A real session server (uvicorn on loopback) in front of the real embedded engine (tiny random
Llama, subprocess). While one agent's request with a message of megabytes is processed, other
sessions' chat turns and ``/health`` must keep answering within a generous deadline. Before the
fix, the server tokenized the message on its event loop (SmolLM2's tokenizer: ~1.3 us per
character of English, ~7 us per emoji) and answered nobody until it was done.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from miles_contracts.wire.auth import auth_headers
from miles_tito.tokenizer import TitoTokenizer
from tito_support import session_server

pytestmark = pytest.mark.slow

DEADLINE_S = 2.0
"""What another session's turn or /health may take while the big request is processed: ~100x
what they take on an idle server, well below the seconds the big message takes to tokenize."""

LONG_EMOJI_MESSAGE = "\U0001f642" * 600_000
"""~4.5 s of tokenizing on the 2-core test machine (~1.2M tokens), under the bound that refuses at once."""


@pytest.fixture(scope="module")
def small_context(engine_url: str, chatml: TitoTokenizer) -> Iterator[str]:
    """A 4096-token context: an 8 MB message cannot fit, and is refused before tokenizing."""
    with session_server(engine_url, chatml, max_context_len=4096) as url:
        yield url


@pytest.fixture(scope="module")
def huge_context(engine_url: str, chatml: TitoTokenizer) -> Iterator[str]:
    """A 2**20-token context: a message of 600k emoji could fit by its length, so it is tokenized."""
    with session_server(engine_url, chatml, max_context_len=2**20) as url:
        yield url


def agent(server: str) -> tuple[str, dict[str, str]]:
    """A new session: its chat URL and the headers its agent sends (the session's own key)."""
    created = httpx.post(f"{server}/sessions", headers=auth_headers(), timeout=DEADLINE_S).json()
    return f"{created['base_url']}/chat/completions", {"Authorization": f"Bearer {created['api_key']}"}


def send(server: str, content: str) -> httpx.Response:
    chat, headers = agent(server)
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return httpx.post(chat, json=body, headers=headers, timeout=120)


def others_are_served(server: str, big: cf.Future[Any]) -> int:
    """Until ``big`` is done: /health, then a turn of a new session, each within the deadline.
    Returns how many rounds completed while ``big`` was still in flight."""
    rounds = 0
    with httpx.Client(timeout=DEADLINE_S) as client:
        while not big.done():
            try:
                health = client.get(f"{server}/health")
                chat, headers = agent(server)
                turn = client.post(chat, headers=headers, json={"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 2})
            except httpx.TimeoutException as exc:
                pytest.fail(f"another session waited more than {DEADLINE_S} s while one big message was processed "
                            f"({type(exc).__name__} on {exc.request.url.path})")
            assert health.status_code == 200 and turn.status_code == 200, turn.text
            rounds += not big.done()
    return rounds


def test_a_message_that_cannot_fit_the_context_is_refused_before_tokenizing(small_context: str) -> None:
    """The issue's 8 MB message, against a 4096-token context: at most 81 characters per token
    (this tokenizer's longest entry) makes it at least ~100k tokens, so it is refused with a 400
    that says so, without the ~10 s of tokenizing."""
    message = ("hello world, this is a long message. " * 230_000)[:8_000_000]
    with cf.ThreadPoolExecutor(1) as pool:
        big = pool.submit(send, small_context, message)
        others_are_served(small_context, big)
        answer = big.result()
    assert answer.status_code == 400, answer.text[:300]
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "8000" in error["message"] and "characters" in error["message"], error["message"]
    assert "context limit is 4096" in error["message"]


def test_a_long_message_is_tokenized_while_other_sessions_are_served(huge_context: str) -> None:
    """A message that passes the length bound is tokenized off the event loop: other sessions'
    turns complete meanwhile, and the big one then gets its 400 with the exact token count."""
    with cf.ThreadPoolExecutor(1) as pool:
        big = pool.submit(send, huge_context, LONG_EMOJI_MESSAGE)
        served_meanwhile = others_are_served(huge_context, big)
        answer = big.result()
    assert answer.status_code == 400, answer.text[:300]
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded" and "the prompt is" in error["message"], error["message"]
    assert served_meanwhile >= 1
