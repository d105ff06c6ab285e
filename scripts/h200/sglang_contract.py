"""The engine contract suite against a live SGLang server, started the way Miles starts it.

    python3 scripts/h200/sglang_contract.py --model /tmp/sgmodel --out $OUT --sglang-env PYTHONPATH=/tmp/sg ...

Runs in Miles' environment (scripts/h200/env.sh); SGLang runs in its own (``--sglang-python``,
``--sglang-env``), launched from ``miles_sglang.launch_plan`` through the kernel's LocalExecutor
(health wait, logs under ``--out``/logs), with a fresh token as ``--api-key``. Writes one JSON line
per check to ``--out``/sglang_contract.jsonl (and stdout); exits 1 if any check failed.
"""

from __future__ import annotations

import json
import secrets
import sys
import time


def main() -> int:
    from live_check import exit_status, server_arguments, write_results  # next to this script

    parser = server_arguments()
    parser.add_argument("--attention-backend", default="fa3")
    parser.add_argument("--mem-fraction-static", type=float, default=0.6)
    parser.add_argument("--long-tokens", type=int, default=3000, help="a request that runs for seconds (SmolLM2 size: ~2 s)")
    parser.add_argument("--radix-cache", action="store_true",
                        help="keep SGLang's prefix cache (off by default: the suite compares greedy outputs of a random "
                             "model, whose near-ties a cached prefix's slightly different prefill can flip)")
    parser.add_argument("--memory-saver", action="store_true", help="--enable-memory-saver (real GPU memory release)")
    args = parser.parse_args()

    from miles.executor.local import LocalExecutor
    from miles_contracts import EngineSpec
    from miles_contracts.testing.engine import ENGINE_CHECKS, EngineCheckSkipped, EngineUnderTest
    from miles_sglang import SGLangSection, launch_plan

    args.out.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    section = SGLangSection(python=args.sglang_python, env=dict(kv.split("=", 1) for kv in args.sglang_env),
                            attention_backend=args.attention_backend, mem_fraction_static=args.mem_fraction_static,
                            disable_radix_cache=not args.radix_cache, enable_memory_saver=args.memory_saver,
                            log_level="info",
                            # the trimmed SGLang of ../shared/device/sglang.sh has no xgrammar
                            sglang_args=["--grammar-backend", "none"])
    spec = EngineSpec(model_path=args.model, port=args.port)
    plan = launch_plan(spec, section, authenticated=True)  # the token reaches SGLang from its environment
    print("launch:", " ".join(plan.command()), flush=True)
    executor = LocalExecutor(args.out, startup_timeout=480)
    results = []
    started = time.perf_counter()
    try:
        executor.start("sglang", plan.command(), health_url=f"{spec.url}/health", env={"MILES_AUTH_TOKEN": token})
        print(f"SGLang healthy after {time.perf_counter() - started:.0f} s", flush=True)
        engine = EngineUnderTest(spec.url, token=token, model_path=args.model, long_tokens=args.long_tokens,
                                 settle_s=0.5)
        for name, check in ENGINE_CHECKS.items():
            t = time.perf_counter()
            try:
                check(engine)
                outcome, detail = "passed", ""
            except EngineCheckSkipped as exc:
                outcome, detail = "skipped", str(exc)
            except AssertionError as exc:
                outcome, detail = "failed", str(exc)
            row = {"check": name, "outcome": outcome, "seconds": round(time.perf_counter() - t, 2), "detail": detail}
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        executor.shutdown()
        write_results(args.out / "sglang_contract.jsonl", results)
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
