"""``miles bench sandbox``: what a sandboxed tool call costs.

For each concurrency (default 1, 16, 64: that many episodes at once, each holding one sandbox) it
runs a trivial command (``true``) ``--calls`` times in all, through the service's HTTP API, and the
same command with ``asyncio`` subprocesses directly on the host (the baseline, in the same run);
it reports calls per second and p50/p99 latency of each, and their ratio. Start-up: a cold
sandbox (a new bwrap process, until it answers) against a warm one (leased from the pool, its
workspace reset) -- each until a first command has run. Every figure is the median of
``--repeats`` (>= 3) repeats after a warm-up, with its spread (min, max). Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

COMMAND = "true"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated concurrent sandboxes")
    parser.add_argument("--calls", type=int, default=256, help="commands per measurement, over all workers")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per figure (>= 3)")
    parser.add_argument("--output", default=None, help="also write the JSON here")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


async def _burst(call: Callable[[int], Awaitable[None]], workers: int, calls: int) -> dict[str, float]:
    latencies: list[float] = []
    per_worker = max(1, calls // workers)

    async def worker(index: int) -> None:
        for _ in range(per_worker):
            start = time.perf_counter()
            await call(index)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(workers)))
    elapsed = time.perf_counter() - start
    return {"calls_per_s": len(latencies) / elapsed, "p50_ms": 1000 * _percentile(latencies, 0.5),
            "p99_ms": 1000 * _percentile(latencies, 0.99)}


async def _subprocess_call(_: int) -> None:
    process = await asyncio.create_subprocess_exec("/bin/sh", "-c", COMMAND)
    if await process.wait() != 0:
        raise RuntimeError("the baseline command failed")


async def _measure(url: str, token: str, levels: list[int], calls: int, repeats: int) -> dict[str, Any]:
    import httpx
    from miles_contracts.wire.auth import auth_headers

    limits = httpx.Limits(max_connections=max(levels) + 8, max_keepalive_connections=max(levels) + 8)
    async with httpx.AsyncClient(base_url=url, headers=auth_headers(token), timeout=120, limits=limits,
                                 trust_env=False) as http:
        results: dict[str, Any] = {}
        for level in levels:
            leases = [(await http.post("/sandboxes", json={})).json()["sandbox_id"] for _ in range(level)]

            async def sandbox_call(index: int, leases: list[str] = leases) -> None:
                answer = await http.post(f"/sandboxes/{leases[index]}/exec", json={"command": COMMAND})
                if answer.status_code != 200 or answer.json()["returncode"] != 0:
                    raise RuntimeError(f"a sandboxed call failed: {answer.text[:300]}")

            await _burst(sandbox_call, level, level)  # warm-up
            await _burst(_subprocess_call, level, level)
            runs = {"sandbox": [await _burst(sandbox_call, level, calls) for _ in range(repeats)],
                    "subprocess": [await _burst(_subprocess_call, level, calls) for _ in range(repeats)]}
            for lease in leases:
                await http.delete(f"/sandboxes/{lease}")
            row: dict[str, Any] = {path: {key: _summary([r[key] for r in rs]) for key in rs[0]}
                                   for path, rs in runs.items()}
            row["ratio_calls_per_s"] = row["sandbox"]["calls_per_s"]["median"] / row["subprocess"]["calls_per_s"]["median"]
            row["ratio_p50"] = row["sandbox"]["p50_ms"]["median"] / row["subprocess"]["p50_ms"]["median"]
            results[str(level)] = row
        warm = []
        for _ in range(repeats + 1):  # the first is the warm-up
            start = time.perf_counter()
            lease = (await http.post("/sandboxes", json={})).json()["sandbox_id"]
            await http.post(f"/sandboxes/{lease}/exec", json={"command": COMMAND})
            warm.append(time.perf_counter() - start)
            await http.delete(f"/sandboxes/{lease}")
    return {"levels": results, "warm_start_s": warm[1:]}


async def _cold_starts(repeats: int) -> list[float]:
    from miles_sandbox.box import Sandbox
    from miles_sandbox.config import SandboxSection

    section = SandboxSection()
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        # as the pool starts them: as root, a uid of its own (past the pool's)
        uid = section.base_uid + 4096 + i if os.geteuid() == 0 else None
        box = Sandbox(i, section.limits, section.python, uid=uid)
        await box.start()
        await box.execute(COMMAND, timeout_s=10)
        times.append(time.perf_counter() - start)
        await box.kill()
    return times[1:]


def run(args: argparse.Namespace) -> int:
    from miles_contracts.wire.auth import new_token

    from miles_sandbox.config import SandboxSection
    from miles_sandbox.server import SandboxServer

    if args.repeats < 3:
        raise SystemExit("--repeats must be at least 3")
    levels = [int(x) for x in args.concurrency.split(",")]
    token = new_token()
    started = time.perf_counter()
    with SandboxServer(SandboxSection(pool_size=max(levels)), token=token) as server:
        pool_start_s = time.perf_counter() - started
        measured = asyncio.run(_measure(server.url, token, levels, args.calls, args.repeats))
    cold = asyncio.run(_cold_starts(args.repeats))
    warm = measured["warm_start_s"]
    report = {
        "command": COMMAND, "calls": args.calls, "repeats": args.repeats, "concurrency": measured["levels"],
        "startup": {"cold_s": _summary(cold), "warm_s": _summary(warm),
                    "ratio_cold_over_warm": statistics.median(cold) / statistics.median(warm),
                    f"pool_of_{max(levels)}_s": pool_start_s},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as out:
            out.write(text + "\n")
    return 0
