"""``miles bench session``: what the session server costs on top of calling the engine directly.

Setup: an engine (``--engine URL``, else ``miles serve engine`` is started on ``--model``) and a
session server process (``miles serve session``) in front of it. At each concurrency level ``c``,
``c`` workers each run ``--sessions-per-worker`` sessions (more at low concurrency, to reach
``--min-requests``) of ``--turns`` turns (a user message appended per turn, the history re-sent),
through raw HTTP, one keep-alive connection per worker, so the client adds little.

* **added latency** per request = what the client waited minus the engine call the server made
  for it (its ``latency_s`` record): the extra hop, parsing, TITO tokenization, checks, records
  and response. p50 / p99 over all requests of the level. The bench's client is the server's own
  upstream client (:mod:`miles.http11`), so the client cost inside the wait and the upstream call's
  cost inside ``latency_s`` are the same code and cancel: what remains is what a direct call
  would not pay.
* **requests/s** through the session server, against the same engine requests (the recorded
  prompt ids) sent straight to the engine at the same concurrency: ``throughput_ratio``.
* **server CPU per request**: CPU seconds the session server process used during the level
  (Linux ``/proc``), divided by its chat requests (session create/delete included). Unlike wall
  clock, this hardly moves when other processes compete for the cores.

Timings on a shared machine are noisy: run it several times and compare medians.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from typing import Any

PROMPTS = [
    "Add 17 and 25, then explain the steps.",
    "Write one sentence about the sea.",
    "List three prime numbers.",
    "What is the capital of France?",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", help="URL of a running engine (default: start one on --model)")
    parser.add_argument("--model", default="tiny-dense", help="model for the engine and tokenizer ('tiny-dense' = the tiny test model)")
    parser.add_argument("--concurrency", default="1,64,256", help="comma-separated concurrent sessions")
    parser.add_argument("--sessions-per-worker", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=60, help="more sessions per worker at low concurrency, for stable percentiles")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--startup-timeout", type=float, default=300.0)


def run(args: argparse.Namespace) -> int:
    model = model_path(args.model)
    levels = [int(c) for c in args.concurrency.split(",")]
    with ExitStack() as stack:
        engine = args.engine or start_process(stack, [sys.executable, "-m", "miles_engine", "--model", model], args.startup_timeout)[0]
        server, pid = start_process(stack, [sys.executable, "-m", "miles_tito.server", "--router", engine, "--model", model,
                                     "--max-tokens", str(args.max_tokens)], args.startup_timeout)
        results = asyncio.run(_bench(engine, server, pid, levels, args))
    print(json.dumps({"benchmark": "session", "model": args.model, "turns": args.turns, "max_tokens": args.max_tokens,
                      "cpu_count": os.cpu_count(), "levels": results}, indent=2))
    return 0


def model_path(name: str) -> str:
    if name == "tiny-dense":
        from miles_models.testing import tiny_model

        return str(tiny_model("dense"))
    return name


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_process(stack: ExitStack, argv: list[str], timeout: float) -> tuple[str, int]:
    """Start ``argv --port P`` and wait for its /health: ``(url, pid)``; stopped when ``stack`` closes."""
    import httpx
    from miles_contracts.wire.auth import ensure_run_token

    ensure_run_token()  # the servers inherit it; the bench's clients send it
    port = _free_port()
    process = subprocess.Popen([*argv, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stack.callback(_stop, process)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            assert process.stderr is not None  # stderr=PIPE
            raise RuntimeError(f"`{' '.join(argv)}` exited with {process.returncode}: {process.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0, trust_env=False).status_code == 200:
                return url, process.pid
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"`{' '.join(argv)}` did not become healthy within {timeout}s")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (None where /proc is not available)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Client:
    """One worker's connections: one to the session server, one to the engine (for the direct pass)."""

    def __init__(self, server: str, engine: str) -> None:
        from miles.http11 import HttpClient

        self.server = HttpClient(server, max_connections=1)
        self.engine = HttpClient(engine, max_connections=1)

    async def call(self, to: str, method: str, path: str, body: Any = None) -> Any:
        client = self.server if to == "server" else self.engine
        data = json.dumps(body).encode() if body is not None else b""
        response = await client.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else None)
        if response.status >= 400:
            raise RuntimeError(f"{method} {path} answered HTTP {response.status}: {response.text[:500]}")
        return response.json()

    async def aclose(self) -> None:
        await self.server.aclose()
        await self.engine.aclose()


async def _bench(engine: str, server: str, pid: int, levels: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    # One client per worker: a worker's requests are sequential, so each holds one connection.
    clients = [_Client(server, engine) for _ in range(max(levels))]
    try:
        stop_ids = (await clients[0].call("server", "GET", "/server_info"))["stop_token_ids"]
        await _session_worker(clients[0], 1, 0, args)  # warm-up: first requests load caches
        # This process holds transformers' ~400k objects: a full collection of them (~200 ms) while
        # 256 requests are in flight would be counted as the server's latency. Frozen, it is not.
        gc.collect()
        gc.freeze()
        out = []
        for level in levels:
            sessions = max(args.sessions_per_worker, math.ceil(args.min_requests / (level * args.turns)))
            cpu_before, started = _cpu_seconds(pid), time.perf_counter()
            per_worker = await asyncio.gather(*[_session_worker(clients[w], sessions, w, args) for w in range(level)])
            session_seconds, cpu_after = time.perf_counter() - started, _cpu_seconds(pid)
            requests = [r for worker in per_worker for r in worker]
            added = sorted(r["added_ms"] for r in requests)
            started = time.perf_counter()
            await _direct(clients, [r["input_ids"] for r in requests], level, args.max_tokens, stop_ids)
            direct_seconds = time.perf_counter() - started
            session_rps, direct_rps = len(requests) / session_seconds, len(requests) / direct_seconds
            out.append({
                "concurrency": level, "requests": len(requests),
                "added_latency_p50_ms": round(percentile(added, 50), 3),
                "added_latency_p99_ms": round(percentile(added, 99), 3),
                "added_latency_mean_ms": round(statistics.fmean(added), 3),
                "session_requests_per_s": round(session_rps, 1),
                "direct_requests_per_s": round(direct_rps, 1),
                "throughput_ratio": round(session_rps / direct_rps, 3),
                "server_cpu_ms_per_request": (
                    round((cpu_after - cpu_before) / len(requests) * 1e3, 3) if cpu_before is not None and cpu_after is not None else None
                ),
            })
    finally:
        for client in clients:
            await client.aclose()
    return out


async def _session_worker(http: _Client, sessions: int, worker: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    from urllib.parse import urlsplit

    out = []
    for n in range(sessions):
        session = await http.call("server", "POST", "/sessions")
        base = urlsplit(session["base_url"]).path
        messages: list[dict[str, Any]] = []
        waited = []
        for turn in range(args.turns):
            messages.append({"role": "user", "content": PROMPTS[(worker + n + turn) % len(PROMPTS)]})
            body = {"model": "m", "messages": messages, "max_tokens": args.max_tokens, "temperature": 0}
            start = time.perf_counter()
            answer = await http.call("server", "POST", f"{base}/chat/completions", body)
            waited.append(time.perf_counter() - start)
            messages.append(answer["choices"][0]["message"])
        view = await http.call("server", "DELETE", f"/sessions/{session['session_id']}")
        for record, seconds in zip(view["records"], waited, strict=True):
            out.append({"added_ms": (seconds - record["latency_s"]) * 1e3, "input_ids": record["input_ids"]})
    return out


async def _direct(clients: list[_Client], prompts: list[list[int]], level: int, max_tokens: int, stop_ids: list[int]) -> None:
    queue = list(prompts)

    async def worker(http: _Client) -> None:
        while queue:
            ids = queue.pop()
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "stop_token_ids": stop_ids}, "return_logprob": True}
            await http.call("engine", "POST", "/generate", body)

    await asyncio.gather(*[worker(clients[w]) for w in range(level)])


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]
