"""``miles bench engine --sessions``: multi-turn sessions with and without the radix prefix cache.

A session is ``turns`` turns; turn ``t`` sends the whole history (every earlier user message and
answer) plus ``user_tokens`` new random token ids, and the engine answers ``answer_tokens`` tokens
(greedy, EOS ignored), as an agent's rollout re-sends its conversation each turn. Two engines of
the same model run in the same process, one with the cache (the default) and one with
``disable_radix_cache``; every repeat plays one session on each, alternating, with fresh random
tokens per repeat (so the cached arm never finds an earlier repeat's session), after one untimed
warm-up session on each. Per turn it records the prefilled tokens (scheduler counter), the turn's
latency (submit to answer) and its prefill time (time to first token).

It prints JSON: per arm and turn the medians over repeats, and at the last turn the ratios
plain / cached of prefilled tokens, turn latency and prefill time (median over repeats, with the
spread of the per-repeat ratios). With ``--systems sglang`` on CUDA, SGLang plays the same
sessions (the same random user tokens) with its radix cache on and off
(:mod:`miles_engine.bench.sglang_sessions_runner`): the reference, ``sglang_last_turn``.

Sizes: 50 turns of 80 + 80 tokens end at 8000 tokens, inside SmolLM2-135M's 8192-token context
(200-token turns would need 10,000); a CPU run uses fewer, smaller turns (label it).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_engine.bench.systems import SGLangSystem

ARMS = ("cached", "plain")


@dataclass(slots=True)
class SessionRun:
    latency_s: list[float] = field(default_factory=list)  # per turn
    prefill_s: list[float] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", action="store_true",
                        help="multi-turn sessions with vs without the radix prefix cache (see bench/sessions.py)")
    parser.add_argument("--turns", type=int, default=50, help="--sessions: turns per session")
    parser.add_argument("--user-tokens", type=int, default=80, help="--sessions: new user tokens per turn")
    parser.add_argument("--answer-tokens", type=int, default=80, help="--sessions: tokens answered per turn")


def run_sessions(args: argparse.Namespace, model_path: str, vocab_size: int,
                 sglang: SGLangSystem | None = None) -> dict[str, Any]:
    """Both embedded arms (and SGLang with its radix cache on and off, given ``sglang``)."""
    from miles_engine.engine import Engine

    needed = args.turns * (args.user_tokens + args.answer_tokens) + 1
    engines = {arm: Engine(model_path, device=args.device, dtype=args.dtype, background=False,
                           plain_linear=args.plain_linear, max_running_requests=4,
                           disable_radix_cache=arm == "plain")
               for arm in ARMS}
    try:
        for arm in ARMS:  # untimed: graphs, kernels and the cache pool are set up at every length here
            _play(engines[arm], args, vocab_size, seed=10_000)
        runs: dict[str, list[SessionRun]] = {arm: [] for arm in ARMS}
        for repeat in range(args.repeats):
            for arm in ARMS:
                runs[arm].append(_play(engines[arm], args, vocab_size, seed=repeat))
                last = runs[arm][-1]
                print(f"  sessions {arm:6} repeat {repeat}: last turn {last.latency_s[-1] * 1000:8.1f} ms, "
                      f"{last.prefill_tokens[-1]} prefilled", flush=True, file=sys.stderr)
        cache_info = engines["cached"].server_info()["radix_cache"]
    finally:
        for engine in engines.values():
            engine.shutdown()
    report: dict[str, Any] = {
        "turns": args.turns, "user_tokens": args.user_tokens, "answer_tokens": args.answer_tokens,
        "tokens_at_last_turn": needed - args.answer_tokens, "repeats": args.repeats,
        "last_turn": _last_turn(runs["plain"], runs["cached"]), "radix_cache": cache_info}
    if sglang is not None:
        job = {"turns": args.turns, "user_tokens": args.user_tokens, "answer_tokens": args.answer_tokens,
               "repeats": args.repeats, "vocab_size": vocab_size}
        for arm, disabled in (("sglang_radix", False), ("sglang_plain", True)):
            answer = sglang.run_job("sglang_sessions_runner.py", {**job, "disable_radix_cache": disabled})
            runs[arm] = [SessionRun(r["latency_s"], [], r["prefill_tokens"], r["cached_tokens"]) for r in answer["runs"]]
            report[f"{arm}_startup_s"], report["sglang_version"] = answer["startup_s"], answer["version"]
        report["sglang_last_turn"] = _last_turn(runs["sglang_plain"], runs["sglang_radix"])
    report["arms"] = {arm: _per_turn(arm_runs) for arm, arm_runs in runs.items()}
    return report


def _play(engine: Any, args: argparse.Namespace, vocab_size: int, *, seed: int) -> SessionRun:
    """One session on ``engine``; its scheduler runs on this (the main) thread, the client on another."""
    from miles_contracts.wire.engine import GenerateRequest, SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=args.answer_tokens, temperature=0.0, ignore_eos=True)
    result = SessionRun()
    stats = engine.scheduler.stats
    done = threading.Event()

    async def session() -> None:
        history: list[int] = []
        for _ in range(args.turns):
            history += [rng.randrange(100, vocab_size) for _ in range(args.user_tokens)]
            before_tokens, before_prefill = stats.prefill_tokens, stats.prefill_seconds
            started = time.perf_counter()
            answer = await engine.generate(GenerateRequest(input_ids=list(history), sampling_params=params))
            result.latency_s.append(time.perf_counter() - started)
            result.prefill_s.append(stats.prefill_seconds - before_prefill)
            result.prefill_tokens.append(stats.prefill_tokens - before_tokens)
            result.cached_tokens.append(answer.meta_info.cached_tokens)
            history += answer.output_ids

    def client() -> None:
        try:
            asyncio.run(session())
        finally:
            done.set()
            engine.scheduler.call(lambda: None)  # wake the loop so it sees `done`

    caller = threading.Thread(target=client, name="bench-sessions")
    caller.start()
    engine.scheduler.run(until=done)
    caller.join()
    return result


def _per_turn(runs: list[SessionRun]) -> dict[str, list[float]]:
    def median(values: list[list[float]] | list[list[int]]) -> list[float]:
        return [round(statistics.median(turn), 5) for turn in zip(*values, strict=True)] if values[0] else []

    return {"latency_s_median": median([r.latency_s for r in runs]),
            "prefill_s_median": median([r.prefill_s for r in runs]),  # empty for SGLang (not measured)
            "prefill_tokens_median": median([r.prefill_tokens for r in runs]),
            "cached_tokens_median": median([r.cached_tokens for r in runs])}


def _last_turn(plain: list[SessionRun], cached: list[SessionRun]) -> dict[str, Any]:
    """Plain / cached at the last turn: per repeat, then median and spread ((max - min) / median)."""
    out: dict[str, Any] = {}
    for key in ("prefill_tokens", "latency_s", "prefill_s"):
        if not getattr(plain[0], key):
            continue
        ratios = [getattr(p, key)[-1] / max(getattr(c, key)[-1], 1e-9) for p, c in zip(plain, cached, strict=True)]
        middle = statistics.median(ratios)
        out[f"{key}_plain_over_cached"] = {"median": round(middle, 3), "runs": [round(r, 3) for r in ratios],
                                           "spread_pct": round(100 * (max(ratios) - min(ratios)) / middle, 1)}
        for arm, arm_runs in (("plain", plain), ("cached", cached)):
            out[f"{key}_{arm}_median"] = round(statistics.median(getattr(r, key)[-1] for r in arm_runs), 5)
    return out
