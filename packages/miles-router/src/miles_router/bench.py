"""``miles bench rollout-path``: what the HTTP path of a rollout costs, lean client vs httpx.

A rollout step sends a burst of requests (256 in the learning test) from the driver through the
router to an engine. This bench starts one embedded engine and two routers in front of it (one
forwarding with :mod:`miles.http11`, one with httpx), then times bursts of ``--requests``
one-token generations -- so the engine's own work is small and measured -- over four paths:

* ``direct_httpx``: an httpx ``AsyncClient`` straight to the engine (what the driver used before);
* ``direct_lean``: :class:`miles.engine_client.HttpEngineClient` (lean client) straight to the engine;
* ``router_httpx``: httpx client -> router forwarding with httpx (the old rollout path);
* ``router_lean``: lean client -> router forwarding with the lean client (the current path).

Per path: median wall seconds per burst, requests/s, and the engine's forward + sampling seconds
in the same bursts (from ``/get_server_info``), so ``wall - engine`` is the HTTP path's cost. The
ratio ``router_httpx / router_lean`` is the speed-up of the current path over the old one.

    miles bench rollout-path --requests 256 --repeats 3 --out docs/benchmarks/rollout-path.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from miles.cli import emit_json
from miles_contracts.wire.auth import auth_headers, ensure_run_token

PATHS = ("direct_httpx", "direct_lean", "router_httpx", "router_lean")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="engine model (name or folder); default: the tiny random test model, so the engine's "
                             "work stays small next to the HTTP path")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=256, help="requests per burst (all in flight at once)")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="timed bursts per path (median reported)")
    parser.add_argument("--out", help="also write the JSON here")


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        from miles_models.testing import tiny_model

        model = str(tiny_model("dense"))
    else:
        from miles_models import resolve_model

        model = str(resolve_model(args.model, auto_pull=True))
    report: dict[str, Any] = {
        "benchmark": "rollout-path", "model": args.model or "tiny random llama (miles_models.testing)",
        "device": args.device, "requests_per_burst": args.requests, "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": 1, "repeats": args.repeats, "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "paths": {},
    }
    ensure_run_token()  # one token for the services this bench starts and its clients
    with _services(model, args.device, args.requests) as urls:
        bodies = [_body(i, args.prompt_tokens) for i in range(args.requests)]
        for path in PATHS:
            report["paths"][path] = asyncio.run(_measure(path, urls, bodies, args.repeats))
            entry = report["paths"][path]
            print(f"  {path:13} {entry['wall_s_median']:.3f} s per burst ({entry['requests_per_s']:.0f} req/s, "
                  f"engine work {entry['engine_s_median']:.3f} s)", file=sys.stderr, flush=True)
    paths = report["paths"]
    report["ratios"] = {
        "router_httpx/router_lean": round(paths["router_httpx"]["wall_s_median"] / paths["router_lean"]["wall_s_median"], 2),
        "direct_httpx/direct_lean": round(paths["direct_httpx"]["wall_s_median"] / paths["direct_lean"]["wall_s_median"], 2),
    }
    emit_json(report, args.out)
    return 0


def _body(i: int, prompt_tokens: int) -> dict[str, Any]:
    ids = [1] + [10 + (i * 7 + j) % 200 for j in range(prompt_tokens - 1)]
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "ignore_eos": True, "temperature": 1.0}}


async def _measure(path: str, urls: dict[str, str], bodies: list[dict[str, Any]], repeats: int) -> dict[str, Any]:
    target = urls["engine"] if path.startswith("direct") else urls[path.split("_", 1)[1]]
    send, close = _client(path.endswith("lean"), target, len(bodies))
    try:
        await _burst(send, bodies)  # warm-up: connections, the engine's first shapes
        walls, engine = [], []
        for _ in range(repeats):
            before = await _engine_seconds(urls["engine"])
            started = time.perf_counter()
            await _burst(send, bodies)
            walls.append(time.perf_counter() - started)
            engine.append(await _engine_seconds(urls["engine"]) - before)
    finally:
        await close()
    wall = statistics.median(walls)
    return {"wall_s_median": round(wall, 4), "wall_s_runs": [round(w, 4) for w in walls],
            "requests_per_s": round(len(bodies) / wall, 1), "engine_s_median": round(statistics.median(engine), 4),
            "http_path_s_median": round(wall - statistics.median(engine), 4)}


async def _burst(send: Callable[[dict[str, Any]], Awaitable[None]], bodies: list[dict[str, Any]]) -> None:
    await asyncio.gather(*(send(b) for b in bodies))


def _client(lean: bool, url: str, connections: int):
    """``(send, close)`` for one client kind; ``send`` raises on any non-200 answer."""
    if lean:
        from miles.engine_client import HttpEngineClient

        engine = HttpEngineClient(url, max_connections=max(connections, 1))

        async def send_lean(body: dict[str, Any]) -> None:
            await engine.post("/generate", body)

        return send_lean, engine.aclose
    import httpx

    # The driver's settings before the lean client (max_connections 512, keep-alive for all).
    client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0, connect=10.0),
                               limits=httpx.Limits(max_connections=512, max_keepalive_connections=512),
                               headers=auth_headers(), trust_env=False)

    async def send_httpx(body: dict[str, Any]) -> None:
        response = await client.post("/generate", json=body)
        response.raise_for_status()

    return send_httpx, client.aclose


async def _engine_seconds(url: str) -> float:
    from miles.engine_client import HttpEngineClient

    async with HttpEngineClient(url) as client:
        stats = (await client.get("/get_server_info"))["stats"]
    return stats["decode_seconds"] + stats["prefill_seconds"]


@contextmanager
def _services(model: str, device: str, max_running: int) -> Iterator[dict[str, str]]:
    """An engine and two routers in front of it (lean and httpx forwarding), as supervised child
    processes of the kernel's local executor (logs under a temporary folder)."""
    from miles.executor.local import LocalExecutor, free_port

    ports = {name: free_port() for name in ("engine", "lean", "httpx")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    commands = {
        "engine": [sys.executable, "-m", "miles_engine", "--model", model, "--device", device,
                   "--port", str(ports["engine"]), "--max-running-requests", str(max(max_running, 1))],
        **{kind: [sys.executable, "-m", "miles_router", "--port", str(ports[kind]), "--worker", urls["engine"],
                  "--forward-client", kind, "--log-level", "warning"] for kind in ("lean", "httpx")},
    }
    executor = LocalExecutor(Path(tempfile.mkdtemp(prefix="miles-bench-path-")), startup_timeout=300.0)
    try:
        for name, command in commands.items():
            executor.start(name, command, health_url=urls[name] + "/health")
        yield urls
    finally:
        executor.shutdown()
