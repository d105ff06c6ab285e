"""Real processes and servers for the integration tests: an engine, a router, a session server.

The engine (``python -m miles_engine``, the embedded engine on the tiny random Llama) and the
router (``python -m miles_router``) run as subprocesses on free loopback ports; the session server
runs in a thread of the test process (uvicorn on loopback), so tests can hand it any chat family.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from miles_contracts.chat import ChatFamily, ParsedTurn, ToolCall
from miles_contracts.testing.processes import LoggedProcess
from miles_contracts.wire.auth import auth_headers
from miles_contracts.wire.session import SessionView, TurnRecord
from miles_model_llama.chat import parse_chatml
from miles_tito.server.background import BackgroundServer
from miles_tito.server.factory import app_factory
from miles_tito.tokenizer import TitoTokenizer


class _Authed:
    """httpx's module-level calls (``authed.post(...)``) with the run's token, as Miles clients send it."""

    def __getattr__(self, name: str) -> Any:
        call = getattr(httpx, name)

        def with_token(*args: Any, headers: dict[str, str] | None = None, **kwargs: Any) -> Any:
            return call(*args, headers={**auth_headers(), **(headers or {})}, **kwargs)

        return with_token


authed = _Authed()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def process(argv: list[str], log: Path) -> Iterator[str]:
    """Run ``argv + ["--port", P]`` (output in ``log``) until the block ends; yields its URL once
    /health answers."""
    port = free_port()
    with LoggedProcess([*argv, "--port", str(port)], log, env={"HF_HUB_OFFLINE": "1"}) as server:
        url = f"http://127.0.0.1:{port}"
        server.wait_healthy(url)
        yield url


def engine_process(model: str, log: Path) -> contextlib.AbstractContextManager[str]:
    return process([sys.executable, "-m", "miles_engine", "--model", model], log)


def router_process(*workers: str, log: Path) -> contextlib.AbstractContextManager[str]:
    # A generous health timeout: on the shared 2-core test machine a busy engine answers /health slowly.
    argv = [sys.executable, "-m", "miles_router", "--log-level", "warning", "--health-timeout", "30"]
    for worker in workers:
        argv += ["--worker", worker]
    return process(argv, log)


@contextlib.contextmanager
def session_server(upstream: str, tito: TitoTokenizer, **options: Any) -> Iterator[str]:
    """A session server (real uvicorn on loopback, in a thread) in front of ``upstream``."""
    options.setdefault("max_context_len", 4096)
    options.setdefault("default_max_tokens", 16)
    with BackgroundServer(app_factory(upstream, tito, model_name="tiny", **options)) as server:
        yield server.url


# The tiny random model writes no tool calls of its own. These families read its turns the way the
# test needs, so the server's tool-call path runs end to end against the real engine.


def always_calls(text: str) -> ParsedTurn:
    """Every turn is a call of the calculator (with the turn's text kept as content)."""
    return ParsedTurn(content="", tool_calls=(ToolCall("calculator", json.dumps({"expression": "6 * 7"})),))


def thinks_then_calls(text: str) -> ParsedTurn:
    """Every turn is a thought and a calculator call (the tiny model writes neither on its own)."""
    return ParsedTurn(content="", reasoning="six times seven",
                      tool_calls=(ToolCall("calculator", json.dumps({"expression": "6 * 7"})),))


def always_malformed(text: str) -> ParsedTurn:
    """Every turn reads as an unclosed tool call, through the real ChatML parser."""
    return parse_chatml("<tool_call>" + text)


def family_with_parser(base: ChatFamily, parser: Any, name: str) -> ChatFamily:
    import dataclasses

    return dataclasses.replace(base, name=name, parse=parser)


async def wait_until_generating(engine_url: str, timeout: float = 60.0) -> None:
    """Return once the engine reports a request running (``GET /get_server_info``)."""
    import asyncio

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=10, headers=auth_headers()) as http:
        while time.monotonic() < deadline:
            info = (await http.get(f"{engine_url}/get_server_info")).json()
            if info.get("running", 0) > 0:
                return
            await asyncio.sleep(0.02)
    raise TimeoutError(f"the engine at {engine_url} started no request within {timeout}s")


# Long enough (about a second or more on a CPU) that a test can act while it is generating.
LONG_GENERATION = {"max_tokens": 400, "min_tokens": 400}  # long enough to act while it runs


def records(server: str, session_id: str) -> list[TurnRecord]:
    """The session's turn records, as its server returns them."""
    return SessionView.model_validate(authed.get(f"{server}/sessions/{session_id}").json()).records


def greedy_engine_output(router_url: str, record: TurnRecord) -> list[int]:
    """What the engine generates, greedy, from the record's prompt, for as many tokens."""
    body = {"input_ids": record.input_ids, "sampling_params": {"max_new_tokens": len(record.output_ids), "temperature": 0}}
    answer = httpx.post(f"{router_url}/generate", json=body, headers=auth_headers(), timeout=120)
    answer.raise_for_status()
    return list(answer.json()["output_ids"])


def assert_three_tool_turns_chain(turns: list[TurnRecord], chatml: Any) -> None:
    """Three recorded ChatML turns of a tool episode (system "Use tools.", a tool answering 42 after
    each turn): none rolled back, each turn's prompt starts with the previous turn's exact tokens."""
    assert len(turns) == 3 and not any(r.rolled_back for r in turns)
    for previous, current in zip(turns, turns[1:], strict=False):
        turn_k = previous.input_ids + previous.output_ids
        assert current.input_ids[: len(turn_k)] == turn_k  # turn k's tokens unchanged in turn k+1
        between = chatml.decode(current.input_ids[len(turn_k):])
        assert between.endswith("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert chatml.decode(turns[0].input_ids).startswith("<|im_start|>system\nUse tools.")
