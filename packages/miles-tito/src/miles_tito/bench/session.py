"""``miles bench session``: what the session server costs on top of calling the engine directly, per wire API.

Setup, per ``--engine-kind`` (default both, in this order):

* ``stub``: a stand-in engine (:mod:`miles_tito.bench.stub_engine`, a real HTTP server on loopback)
  that answers every generation at once with a few fixed ids. It stands in for an engine only so
  that what is measured is the session server's own cost, not the model's.
* ``embedded``: ``miles serve engine`` on ``--model`` (or the running engine at ``--engine``).

A session server process (``miles serve session``) sits in front of it. For each API of ``--apis``
(OpenAI Chat Completions, Anthropic Messages, OpenAI Responses; ``responses-chained`` continues by
``previous_response_id``, see :mod:`miles_tito.bench.session_apis`) and each concurrency level
``c``, ``c`` workers each run ``--sessions-per-worker`` sessions (more at low concurrency, to reach
``--min-requests``) of ``--turns`` turns (a user message appended per turn, the whole history
re-sent), through raw HTTP, one keep-alive connection per worker, so the client adds little.

* **added latency** per request = what the client waited minus the engine call the server made
  for it (its ``latency_s`` record): the extra hop, parsing, TITO tokenization, checks, records
  and response. p50 / p99 over all requests of the level. The bench's client is the server's own
  upstream client (:mod:`miles.http11`), so the client cost inside the wait and the upstream call's
  cost inside ``latency_s`` are the same code and cancel: what remains is what a direct call
  would not pay.
* **requests/s** through the session server, against the same engine requests (the recorded
  prompt ids) sent straight to the engine at the same concurrency: ``throughput_ratio``; and the
  direct calls' own latency, so that, with the stub, session wait minus direct wait is a second
  reading of the added latency.
* **server CPU per request**: CPU seconds the session server process used during the level
  (Linux ``/proc``), divided by its turns (session create/delete included). Unlike wall clock,
  this hardly moves when other processes compete for the cores.

**Load model.** By default the load is closed-loop: a worker sends its next turn the moment the
last one is answered, so with an instant engine ``c`` workers keep ``c`` turns queued in the one
server process and the added latency is mostly queueing (Little's law). ``--think-ms MIN-MAX`` is
an agent that runs tools between turns: before each turn its worker sleeps a time drawn uniformly
from ``MIN``-``MAX`` ms (per worker from ``--seed``, so runs draw the same times), which also
staggers the first turns. Per level the report gives the **offered load** (``c`` / the mean think
time: the turns/s the agents would send to a server that answered at once), the **served load**
(turns/s measured) and the **server CPU utilisation** (its CPU seconds over the level's wall time,
in cores): near 1 core the one-process server is saturated and the added latency is queueing again.
With think times the direct pass is skipped (its throughput would only measure the think times).

The issue's goal (p50 <= 1 ms and p99 <= 5 ms added at 256 sessions) is evaluated per engine kind
and API, with the load it was judged at. ``--profile C --profile-out FILE`` runs the server under cProfile during level ``C`` of
the stub engine (:mod:`miles_tito.bench.profiled_server`); profiled timings are not comparable.

Timings on a shared machine are noisy: run it several times and compare medians.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import pstats
import random
import signal
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Any

from miles_tito.bench.processes import (
    cpu_seconds,
    model_path,
    percentile,
    raise_open_file_limit,
    start_process,
)
from miles_tito.bench.session_apis import CONVERSATIONS

PROMPTS = [
    "Add 17 and 25, then explain the steps.",
    "Write one sentence about the sea.",
    "List three prime numbers.",
    "What is the capital of France?",
]
GOAL = {"concurrency": 256, "added_latency_p50_ms": 1.0, "added_latency_p99_ms": 5.0}
ENGINE_KINDS = {
    "stub": "stand-in engine (miles_tito.bench.stub_engine): answers every generation at once with fixed ids; it "
            "stands in for an engine only so that the session server's own cost is measured",
    "embedded": "miles serve engine (the embedded engine) on the model, on this machine's CPU or GPU",
}
DEFAULT_APIS = "chat,messages,responses"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-kind", default="stub,embedded",
                        help="comma-separated, run in this order: stub (a stand-in engine that answers at once, so only "
                             "the server is measured), embedded (miles serve engine on --model)")
    parser.add_argument("--engine", help="URL of a running engine, used as the embedded kind (default: start one on --model)")
    parser.add_argument("--model", default="tiny-dense", help="model for the engine and tokenizer ('tiny-dense' = the tiny test model)")
    parser.add_argument("--apis", default=DEFAULT_APIS, help=f"comma-separated, of {', '.join(CONVERSATIONS)}")
    parser.add_argument("--concurrency", default="1,64,256,1000", help="comma-separated concurrent sessions")
    parser.add_argument("--sessions-per-worker", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=60, help="more sessions per worker at low concurrency, for stable percentiles")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--think-ms", type=think_range, default=(0.0, 0.0), metavar="MIN-MAX",
                        help="think time before each turn, drawn uniformly from MIN-MAX ms per turn (one number: "
                             "that time); 0 (default): closed loop, the next turn as soon as the last is answered")
    parser.add_argument("--seed", type=int, default=0, help="seeds the think times (per worker)")
    parser.add_argument("--profile", type=int, default=None, metavar="C",
                        help="profile the session server (cProfile) during level C of the stub engine; needs --profile-out")
    parser.add_argument("--profile-out", default=None, help="where the profile (pstats) goes")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--out", default=None, help="also write the JSON report here")


def think_range(text: str) -> tuple[float, float]:
    """``MIN-MAX`` or ``MS`` (milliseconds, MIN <= MAX, not negative) as ``(min, max)``."""
    low, dash, high = text.partition("-")
    try:
        bounds = (float(low), float(high) if dash else float(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN-MAX or MS in milliseconds (e.g. 250-750), got {text!r}") from None
    if not 0 <= bounds[0] <= bounds[1] or not math.isfinite(bounds[1]):
        raise argparse.ArgumentTypeError(f"expected 0 <= MIN <= MAX milliseconds, got {text!r}")
    return bounds


def run(args: argparse.Namespace) -> int:
    from miles.cli.command import emit_json

    kinds = args.engine_kind.split(",")
    apis = args.apis.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    unknown = [k for k in kinds if k not in ENGINE_KINDS] + [a for a in apis if a not in CONVERSATIONS]
    if unknown:
        print(f"error: unknown engine kinds or APIs {unknown}; kinds: {list(ENGINE_KINDS)}, APIs: {list(CONVERSATIONS)}",
              file=sys.stderr)
        return 2
    if args.profile is not None and not args.profile_out:
        print("error: --profile needs --profile-out FILE (where the server writes its profile)", file=sys.stderr)
        return 2
    # per process: a connection per session to the server, one onward to the engine, one direct
    raise_open_file_limit(2 * max(levels) + 256)
    model = model_path(args.model)
    report: dict[str, Any] = {
        "benchmark": "session", "model": args.model, "turns": args.turns, "max_tokens": args.max_tokens,
        "sessions_per_worker": args.sessions_per_worker, "min_requests": args.min_requests,
        "load": _load_model(args.think_ms), "seed": args.seed, "cpu_count": os.cpu_count(), "goal": GOAL, "engine_kinds": {},
    }
    for kind in kinds:
        profile = args.profile if kind == "stub" else None
        with ExitStack() as stack:
            if kind == "stub":
                engine = start_process(stack, [sys.executable, "-m", "miles_tito.bench.stub_engine", "--model", model],
                                       args.startup_timeout)[0]
            else:
                engine = args.engine or start_process(stack, [sys.executable, "-m", "miles_engine", "--model", model],
                                                      args.startup_timeout)[0]
            server_module = ["miles_tito.bench.profiled_server", "--profile-out", args.profile_out] if profile else ["miles_tito.server"]
            server, pid = start_process(stack, [sys.executable, "-m", *server_module, "--router", engine, "--model", model,
                                         "--max-tokens", str(args.max_tokens)], args.startup_timeout)
            results = asyncio.run(_bench(engine, server, pid, apis, levels, args, profile))
        report["engine_kinds"][kind] = {"engine": ENGINE_KINDS[kind], "apis": results}
    report["goal_met"] = goal_met(report["engine_kinds"])
    if args.profile is not None and "stub" in kinds:
        report["profile"] = profile_summary(args.profile_out, args.profile, apis)
    emit_json(report, args.out)
    return 0


def _load_model(think_ms: tuple[float, float]) -> dict[str, Any]:
    if think_ms[1] == 0:
        return {"mode": "closed-loop", "think_ms": None}
    return {"mode": "think-time", "think_ms": {"min": think_ms[0], "max": think_ms[1]}}


def goal_met(kinds: dict[str, Any]) -> dict[str, dict[str, dict[str, Any] | None]]:
    """Per engine kind and API, whether the goal's level met the p50 and p99 bounds (None: not
    measured), with the load it was judged at (served turns/s, the server's CPU utilisation)."""
    out: dict[str, dict[str, dict[str, Any] | None]] = {}
    for kind, measured in kinds.items():
        out[kind] = {}
        for api, levels in measured["apis"].items():
            at = next((level for level in levels if level["concurrency"] == GOAL["concurrency"]), None)
            if at is None:
                out[kind][api] = None
                continue
            p50 = at["added_latency_p50_ms"] <= GOAL["added_latency_p50_ms"]
            p99 = at["added_latency_p99_ms"] <= GOAL["added_latency_p99_ms"]
            out[kind][api] = {"p50": p50, "p99": p99, "met": p50 and p99, "turns_per_s": at.get("turns_per_s"),
                              "server_cpu_utilisation": at.get("server_cpu_utilisation")}
    return out


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


async def _bench(engine: str, server: str, pid: int, apis: list[str], levels: list[int], args: argparse.Namespace,
                 profile: int | None) -> dict[str, list[dict[str, Any]]]:
    # One client per worker: a worker's requests are sequential, so each holds one connection.
    clients = [_Client(server, engine) for _ in range(max(levels))]
    try:
        stop_ids = (await clients[0].call("server", "GET", "/server_info"))["stop_token_ids"]
        for api in apis:  # warm-up: first requests load caches
            await _session_worker(clients[0], api, 1, 0, random.Random(), args, think=False)
        # This process holds transformers' ~400k objects: a full collection of them (~200 ms) while
        # 256 requests are in flight would be counted as the server's latency. Frozen, it is not.
        gc.collect()
        gc.freeze()
        out: dict[str, list[dict[str, Any]]] = {}
        for api in apis:
            out[api] = []
            for level in levels:
                profiled = profile == level
                if profiled:
                    os.kill(pid, signal.SIGUSR1)
                out[api].append(await _level(clients, api, level, pid, stop_ids, args))
                if profiled:
                    await _dump_profile(clients[0], pid, args.profile_out, f"{args.profile_out}.{api}")
    finally:
        for client in clients:
            await client.aclose()
    return out


async def _level(clients: list[_Client], api: str, level: int, pid: int, stop_ids: list[int],
                 args: argparse.Namespace) -> dict[str, Any]:
    sessions = max(args.sessions_per_worker, math.ceil(args.min_requests / (level * args.turns)))
    rngs = [random.Random(f"{args.seed}/{api}/{level}/{w}") for w in range(level)]
    cpu_before, started = cpu_seconds(pid), time.perf_counter()
    per_worker = await asyncio.gather(*[_session_worker(clients[w], api, sessions, w, rngs[w], args) for w in range(level)])
    session_seconds, cpu_after = time.perf_counter() - started, cpu_seconds(pid)
    requests = [r for worker in per_worker for r in worker["requests"]]
    errors = [e for worker in per_worker for e in worker["errors"]]
    thought = [t for worker in per_worker for t in worker["thought_s"]]
    added = sorted(r["added_ms"] for r in requests)
    waited = sorted(r["waited_ms"] for r in requests)
    session_rps = len(requests) / session_seconds
    think_s = statistics.fmean(thought) if thought else 0.0
    if think_s > 0:  # the direct pass would measure the think times, not the engine
        direct: list[float] = []
        direct_rps = float("nan")
    else:
        started = time.perf_counter()
        direct = sorted(await _direct(clients, [r["input_ids"] for r in requests], level, args.max_tokens, stop_ids))
        direct_rps = len(requests) / (time.perf_counter() - started) if requests else float("nan")
    cpu_s = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
    return {
        "concurrency": level, "sessions": level * sessions, "requests": len(requests),
        "failed_sessions": len(errors), "errors": errors[:3],
        "added_latency_p50_ms": round(percentile(added, 50), 3),
        "added_latency_p99_ms": round(percentile(added, 99), 3),
        "added_latency_mean_ms": round(statistics.fmean(added), 3) if added else None,
        "session_wait_p50_ms": round(percentile(waited, 50), 3),
        "session_wait_p99_ms": round(percentile(waited, 99), 3),
        "direct_wait_p50_ms": _rounded(percentile(direct, 50), 3),
        "direct_wait_p99_ms": _rounded(percentile(direct, 99), 3),
        "session_requests_per_s": round(session_rps, 1),
        "direct_requests_per_s": _rounded(direct_rps, 1),
        "throughput_ratio": _rounded(session_rps / direct_rps, 3),
        "think_ms_mean": round(think_s * 1e3, 1),
        # what the agents would send to a server answering at once; closed loop: as much as it serves
        "offered_turns_per_s": round(level / think_s, 1) if think_s > 0 else None,
        "turns_per_s": round(session_rps, 1),
        "server_cpu_utilisation": round(cpu_s / session_seconds, 3) if cpu_s is not None else None,
        "server_cpu_ms_per_request": round(cpu_s / len(requests) * 1e3, 3) if cpu_s is not None and requests else None,
    }


def _rounded(value: float, digits: int) -> float | None:
    """``value`` rounded, None for NaN (not measured), which JSON has no number for."""
    return None if math.isnan(value) else round(value, digits)


async def _session_worker(http: _Client, api: str, sessions: int, worker: int, rng: random.Random,
                          args: argparse.Namespace, think: bool = True) -> dict[str, Any]:
    """``sessions`` sessions one after the other: per turn the added and the whole wait, with the
    turn's prompt ids; a session that failed is counted (its first error kept) and left out. With
    ``--think-ms``, a think time drawn from ``rng`` before each turn (``thought_s``)."""
    from urllib.parse import urlsplit

    from miles.http11 import HttpError

    requests: list[dict[str, Any]] = []
    errors: list[str] = []
    thought: list[float] = []
    low, high = args.think_ms if think else (0.0, 0.0)
    for n in range(sessions):
        try:
            session = await http.call("server", "POST", "/sessions")
            base = urlsplit(session["base_url"]).path
            conversation = CONVERSATIONS[api](args.max_tokens)
            waited = []
            for turn in range(args.turns):
                if high > 0:
                    thought.append(rng.uniform(low, high) / 1e3)
                    await asyncio.sleep(thought[-1])
                body = conversation.request(PROMPTS[(worker + n + turn) % len(PROMPTS)])
                start = time.perf_counter()
                reply = await http.call("server", "POST", f"{base}/{conversation.path}", body)
                waited.append(time.perf_counter() - start)
                conversation.answered(reply)
            view = await http.call("server", "DELETE", f"/sessions/{session['session_id']}")
        except (RuntimeError, HttpError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        for record, seconds in zip(view["records"], waited, strict=True):
            requests.append({"added_ms": (seconds - record["latency_s"]) * 1e3, "waited_ms": seconds * 1e3,
                             "input_ids": record["input_ids"]})
    return {"requests": requests, "errors": errors, "thought_s": thought}


async def _direct(clients: list[_Client], prompts: list[list[int]], level: int, max_tokens: int, stop_ids: list[int]) -> list[float]:
    """The same engine requests straight to the engine at the same concurrency: each one's wait, ms."""
    queue = list(prompts)
    waited: list[float] = []

    async def worker(http: _Client) -> None:
        while queue:
            ids = queue.pop()
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "stop_token_ids": stop_ids}, "return_logprob": True}
            start = time.perf_counter()
            await http.call("engine", "POST", "/generate", body)
            waited.append((time.perf_counter() - start) * 1e3)

    await asyncio.gather(*[worker(clients[w]) for w in range(level)])
    return waited


async def _dump_profile(http: _Client, pid: int, target: str, path: str, timeout: float = 60.0) -> None:
    """Ask the profiled server for its profile (written to ``target``) and wait for the file (each
    /health wakes its loop to run the signal handler); it is moved to ``path``, one file per API."""
    if os.path.exists(target):
        os.remove(target)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + timeout
    while not os.path.exists(target):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the profiled session server wrote no profile to {target} within {timeout:g} s")
        await http.call("server", "GET", "/health")
        await asyncio.sleep(0.05)
    os.replace(target, path)


def profile_summary(out: str, level: int, apis: list[str], top: int = 25) -> dict[str, Any]:
    """Per API: the functions with the most own time in the profiled level, and the server's total."""
    summary: dict[str, Any] = {"concurrency": level, "engine_kind": "stub", "files": {}, "top_own_time": {}}
    for api in apis:
        path = f"{out}.{api}"
        stats = pstats.Stats(path)
        entries = stats.stats  # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tt, ct, callers)
        total = sum(tt for _, _, tt, _, _ in entries.values())
        ranked = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)[:top]
        summary["files"][api] = path
        summary["top_own_time"][api] = {
            "total_s": round(total, 3),
            "functions": [{"function": f"{name} ({os.path.basename(file)}:{line})", "calls": nc,
                           "own_s": round(tt, 4), "own_share": round(tt / total, 4), "cumulative_s": round(ct, 4)}
                          for (file, line, name), (_, nc, tt, ct, _) in ranked],
        }
    return summary
