"""``miles bench isolation``: what one huge request does to everybody else's latency.

Setup: an engine (``miles serve engine`` on ``--model``) and a session server process in front of
it, as in ``miles bench session``. For each target -- the session server and the engine -- and
each repeat, three phases of ``--seconds`` each, in this order:

* **baseline**: ``--workers`` clients send small requests back to back (the session server: a
  2-token chat turn of the worker's own session; the engine: a 2-token ``/generate`` of 3 ids),
  and one more client polls ``/health``;
* **oversized**: the same, while one more client sends a request that can never fit the context,
  again as soon as the previous one is answered (the issue's cases: an 8 MB chat message, a
  30 MB ``text``);
* **long**: the same with a text that passes the length bound and must be tokenized (300k emoji,
  ~2 s of tokenizing on a 2-core machine; refused afterwards, 600k tokens being over the context).

A phase runs until its time is up and its large request in flight has been answered. Per phase:
p50 and p99 of the small requests' and of ``/health``'s latency; per target: median, min and max
of each over the repeats, and the ratio of each loaded phase's median to the baseline's. One
untimed round of every phase comes first (warm-up: the first requests load caches).

Timings on a shared machine are noisy: compare the ratios, measured within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from miles_tito.bench.processes import model_path, percentile, start_process

SMALL_GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
LONG_TEXT = "\U0001f642" * 300_000
"""Under the tiny model's bound (4096 tokens x 81 characters), two tokens per character."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-dense", help="model for the engine and tokenizer ('tiny-dense' = the tiny test model)")
    parser.add_argument("--context", type=int, default=4096, help="the session server's max_context_len")
    parser.add_argument("--workers", type=int, default=4, help="clients sending small requests at once")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each phase")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--message-mb", type=float, default=8.0, help="the oversized chat message, in MB")
    parser.add_argument("--text-mb", type=float, default=30.0, help="the oversized engine text, in MB")
    parser.add_argument("--targets", default="session,engine", help="comma-separated: session, engine")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--out", default=None, help="also write the JSON report here")


def run(args: argparse.Namespace) -> int:
    from miles.cli.command import emit_json

    model = model_path(args.model)
    with ExitStack() as stack:
        engine = start_process(stack, [sys.executable, "-m", "miles_engine", "--model", model], args.startup_timeout)[0]
        server = start_process(stack, [sys.executable, "-m", "miles_tito.server", "--router", engine, "--model", model,
                                "--max-context-len", str(args.context)], args.startup_timeout)[0]
        targets = {name: _TARGETS[name](server if name == "session" else engine, args)
                   for name in args.targets.split(",")}
        results = asyncio.run(_bench(targets, args))
    emit_json({"benchmark": "isolation", "model": args.model, "workers": args.workers, "seconds": args.seconds,
               "repeats": args.repeats, "cpu_count": os.cpu_count(), "targets": results}, args.out)
    return 0


@dataclass
class Target:
    """What one server gets: ``small(client, worker)`` and a large request body per loaded phase."""

    url: str
    small: Callable[[Any, int], Awaitable[None]]
    large_path: Callable[[Any], Awaitable[str]]
    large_bodies: dict[str, bytes]
    sizes: dict[str, int]


def _session_target(url: str, args: argparse.Namespace) -> Target:
    sessions: dict[int, str] = {}

    async def open_session(client: Any) -> str:
        created = await _call(client, "POST", "/sessions")
        return "/sessions/" + created["session_id"] + "/v1/chat/completions"

    async def small(client: Any, worker: int) -> None:
        if worker not in sessions:
            sessions[worker] = await open_session(client)
        # the same message every time: a retry of the session's last turn, the same work each time
        await _call(client, "POST", sessions[worker], {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

    message = ("hello world, this is a long message. " * int(args.message_mb * 1e6 / 37 + 1))[: int(args.message_mb * 1e6)]
    bodies = {name: json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 2}).encode()
              for name, text in (("oversized", message), ("long", LONG_TEXT))}
    return Target(url, small, open_session, bodies, {"oversized": len(message), "long": len(LONG_TEXT)})


def _engine_target(url: str, args: argparse.Namespace) -> Target:
    async def small(client: Any, worker: int) -> None:
        await _call(client, "POST", "/generate", SMALL_GENERATE)

    async def path(client: Any) -> str:
        return "/generate"

    text = ("hello world, this is a long message. " * int(args.text_mb * 1e6 / 37 + 1))[: int(args.text_mb * 1e6)]
    bodies = {name: json.dumps({"text": value, "sampling_params": {"max_new_tokens": 2}}).encode()
              for name, value in (("oversized", text), ("long", LONG_TEXT))}
    return Target(url, small, path, bodies, {"oversized": len(text), "long": len(LONG_TEXT)})


_TARGETS = {"session": _session_target, "engine": _engine_target}
PHASES = ("baseline", "oversized", "long")


async def _bench(targets: dict[str, Target], args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for name, target in targets.items():
        for phase in PHASES:  # warm-up
            await _phase(target, phase, args, seconds=min(1.0, args.seconds))
        runs: dict[str, list[dict[str, Any]]] = {phase: [] for phase in PHASES}
        for _ in range(args.repeats):
            for phase in PHASES:
                runs[phase].append(await _phase(target, phase, args, seconds=args.seconds))
        out[name] = _summary(runs, target)
    return out


async def _phase(target: Target, phase: str, args: argparse.Namespace, *, seconds: float) -> dict[str, Any]:
    from miles.http11 import HttpClient

    clients = [HttpClient(target.url, max_connections=1) for _ in range(args.workers + 2)]
    small_ms: list[float] = []
    health_ms: list[float] = []
    large: list[dict[str, Any]] = []
    end = time.perf_counter() + seconds
    stop = asyncio.Event()

    async def worker(index: int) -> None:
        while not stop.is_set():
            started = time.perf_counter()
            await target.small(clients[index], index)
            small_ms.append((time.perf_counter() - started) * 1e3)

    async def health() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            await _call(clients[args.workers], "GET", "/health")
            health_ms.append((time.perf_counter() - started) * 1e3)
            await asyncio.sleep(0.01)

    async def big() -> None:
        client = clients[args.workers + 1]
        while time.perf_counter() < end:
            path = await target.large_path(client)
            started = time.perf_counter()
            answer = await client.request("POST", path, body=target.large_bodies[phase],
                                          headers={"Content-Type": "application/json"})
            large.append({"status": answer.status, "seconds": time.perf_counter() - started})

    try:
        tasks = [asyncio.create_task(worker(i)) for i in range(args.workers)] + [asyncio.create_task(health())]
        if phase != "baseline":
            await big()
        remaining = end - time.perf_counter()
        if remaining > 0:
            await asyncio.sleep(remaining)
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        for client in clients:
            await client.aclose()
    small_ms.sort()
    health_ms.sort()
    return {"small_p50_ms": percentile(small_ms, 50), "small_p99_ms": percentile(small_ms, 99),
            "health_p50_ms": percentile(health_ms, 50), "health_p99_ms": percentile(health_ms, 99),
            "small_requests": len(small_ms), "large": large}


def _summary(runs: dict[str, list[dict[str, Any]]], target: Target) -> dict[str, Any]:
    keys = ("small_p50_ms", "small_p99_ms", "health_p50_ms", "health_p99_ms")
    phases: dict[str, Any] = {}
    for phase, results in runs.items():
        stats: dict[str, Any] = {key: _spread([r[key] for r in results]) for key in keys}
        stats["small_requests"] = [r["small_requests"] for r in results]
        if phase != "baseline":
            answers = [a for r in results for a in r["large"]]
            stats["large"] = {"chars": target.sizes[phase], "requests": len(answers),
                              "statuses": sorted({a["status"] for a in answers}),
                              "seconds_median": round(statistics.median(a["seconds"] for a in answers), 3)}
        phases[phase] = stats
    base = phases["baseline"]
    ratios = {f"{phase}/{key}": round(phases[phase][key]["median"] / base[key]["median"], 2)
              for phase in PHASES[1:] for key in keys}
    return {"phases": phases, "ratio_to_baseline": ratios}


def _spread(values: list[float]) -> dict[str, Any]:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2),
            "runs": [round(v, 2) for v in values]}


async def _call(client: Any, method: str, path: str, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    answer = await client.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else None)
    if answer.status >= 400:
        raise RuntimeError(f"{method} {path} answered HTTP {answer.status}: {answer.text[:300]}")
    return answer.json()
