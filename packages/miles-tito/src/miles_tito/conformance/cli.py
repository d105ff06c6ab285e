"""``miles bench conformance``: the conformance table (harness x wire API x chat family).

    miles bench conformance                       # tiny random model, every row, 4 episodes each
    miles bench conformance --model smollm2-135m-instruct --episodes 16 --json out.json

Prints a table and then one JSON object; exits 1 when a row does not conform (100% of turns
token-exact, 0 spurious forks, 0 tool calls dropped silently, no harness failure) or, with
``--require-all``, when an adapter's row is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from miles_contracts import RunContext


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-dense", help="model name or folder (default: the tiny random Llama)")
    parser.add_argument("--family", default="chatml", help="chat family the session servers use")
    parser.add_argument("--episodes", type=int, default=4, help="episodes per row")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16, help="max tokens of a model turn")
    parser.add_argument("--rows", default="all", help="comma-separated adapters besides the SDK agents, or 'all'")
    parser.add_argument("--require-all", action="store_true", help="fail when an adapter's rows are missing")
    parser.add_argument("--json", type=Path, help="also write the JSON report here")
    parser.add_argument("--engine-timeout", type=float, default=300.0, help="seconds to wait for the engine")


def run(args: argparse.Namespace, ctx: RunContext) -> int:
    from transformers import AutoTokenizer

    from miles_tito.bench.processes import model_path, start_process
    from miles_tito.conformance.rows import adapter_rows, builtin_rows
    from miles_tito.conformance.run import run_row
    from miles_tito.families import resolve_family
    from miles_tito.tokenizer import TitoTokenizer

    path = model_path(args.model)
    tito = TitoTokenizer(AutoTokenizer.from_pretrained(path), resolve_family(args.family, kernel=ctx.kernel))
    names = None if args.rows == "all" else [n.strip() for n in args.rows.split(",") if n.strip()]
    rows, missing = adapter_rows(names)
    rows = builtin_rows() + rows
    with ExitStack() as stack:
        engine_url, _ = start_process(stack, [sys.executable, "-m", "miles_engine", "--model", path], args.engine_timeout)
        results = [run_row(row, engine_url, tito, episodes=args.episodes, max_turns=args.max_turns,
                           max_tokens=args.max_tokens) for row in rows]
    report: dict[str, Any] = {
        "model": args.model, "family": args.family, "episodes_per_row": args.episodes,
        "rows": [r.to_dict() for r in results], "missing": missing,
        "conforms": all(r.conforms for r in results) and not (args.require_all and missing),
    }
    print(table(report["rows"], missing))
    print(json.dumps(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["conforms"] else 1


def table(rows: list[dict[str, Any]], missing: dict[str, str]) -> str:
    """The report as a Markdown table (what docs/benchmarks/conformance.md shows)."""
    lines = ["| harness | API | family | episodes | turns | token-exact | spurious forks | tool calls | "
             "malformed kept | silently dropped | conforms |", "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['harness']} | {r['api']} | {r['family']} | {r['episodes']} | {r['turns']} | "
                     f"{r['token_exact_pct']:g}% | {r['spurious_forks']} | {r['tool_calls']} | {r['malformed_kept']} | "
                     f"{r['silently_dropped']} | {'yes' if r['conforms'] else 'NO'} |")
    for name, why in missing.items():
        lines.append(f"| {name} | - | - | - | - | - | - | - | - | - | missing: {why} |")
    return "\n".join(lines)
