"""What the check scripts against a live SGLang server share: their common arguments, and their
ending (one JSON line per check in a file, a summary line, the exit status: 1 when a check failed
or none ran)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def server_arguments() -> argparse.ArgumentParser:
    """A parser with the arguments every script takes: model folder, output folder, port, and
    SGLang's own Python and environment."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="folder with config, tokenizer and safetensors (loaded for real)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--sglang-python", default="python3")
    parser.add_argument("--sglang-env", nargs="*", default=[], metavar="KEY=VALUE")
    return parser


def write_results(path: Path, results: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in results))


def exit_status(results: list[dict]) -> int:
    failed = [r["check"] for r in results if r["outcome"] == "failed"]
    print(f"{len(results) - len(failed)} of {len(results)} checks passed; failed: {failed or 'none'}", flush=True)
    return 1 if failed or not results else 0
