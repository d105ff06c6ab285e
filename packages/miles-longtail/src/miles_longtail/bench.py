"""``miles bench async``: the loop modes on the long-tail agentic workload, in one invocation.

::

    miles bench async --steps 10 --repeats 3 --json docs/benchmarks/async-cpu.json --png docs/benchmarks/async-cpu.png

Every mode trains the same run -- same prompts in the same order, same seeds, the same episode
(token budgets, tool latencies) for every sample index, same batch and concurrency -- as a
``miles train`` child process; only ``run.mode`` (and the fully_async knobs) differ. Repeats
cycle through the modes (sync, one_step_off, fully_async, sync, ...) so that a slow spell of a
shared machine hits every mode alike. See :mod:`miles_longtail.report` for what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from miles.cli import emit_json

from miles_longtail.report import (
    compare,
    engine_stats,
    plot,
    run_summary,
    trained_lengths,
    trained_rows,
    turn_latencies,
)

MODES = ("sync", "one_step_off", "fully_async")

WORKLOAD = [  # everything but the mode: what every run of the benchmark shares
    "data.source=arithmetic", "data.options={digits: 1}", "data.seed=0", "run.seed=0",
    "rollout.generator=agentic", "rollout.agent=long_tail", "rollout.agent_timeout=300", "tito.family=chatml",
    "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=64",
    "rollout.max_context_len=1024", "rollout.concurrency=32", "rollout.filters=[no_aborted]",
    "reward.name=repeated_tokens", "rollout.temperature=0.1", "train.lr=1e-3", "algorithm.correction=tis", "eval.every=0",
    "tracking.trackers=[jsonl]", "longtail.turns=3", "longtail.latency_scale=0.1", "longtail.latency_alpha=1.3",
]
MODE_SETTINGS = {
    "sync": ["run.mode=sync"],
    "one_step_off": ["run.mode=one_step_off"],
    "fully_async": ["run.mode=fully_async", "rollout.max_staleness=2", "weights.update_interval=1"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run (the first is the warm-up)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--model", default="tiny", help="'tiny' (random 2-layer model, CPU) or a model name or folder")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every run (repeatable), e.g. model.device=cuda")
    parser.add_argument("--async-set", dest="async_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for the fully_async runs only, e.g. rollout.max_staleness=8")
    parser.add_argument("--runs-dir", type=Path, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--png", help="plot the reward curves of each mode side by side here")
    parser.add_argument("--replot", type=Path, nargs="+", metavar="JSON",
                        help="run nothing: combine reports this command wrote (their runs, e.g. one repeat per device "
                             "call) into --json, and plot them to --png (e.g. on a machine with matplotlib)")


def run(args: argparse.Namespace) -> int:
    if args.replot:
        return _replot(args)
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2: step 1 is the warm-up")
    model = _model(args.model)
    with tempfile.TemporaryDirectory(prefix="miles-bench-async-") as scratch:
        runs_dir = args.runs_dir or Path(scratch)
        summaries: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
        for repeat in range(args.repeats):
            for mode in args.modes:
                extra = args.async_overrides if mode == "fully_async" else []
                summaries[mode].append(_train(model, mode, repeat, args, runs_dir, extra))
    report = {
        "benchmark": "async",
        "workload": {"overrides": WORKLOAD + args.overrides, "mode_settings": MODE_SETTINGS,
                     "async_overrides": args.async_overrides, "model": str(model), "steps": args.steps},
        "modes": compare(summaries),
        "runs": summaries,
    }
    emit_json(report, args.json)
    if args.png:
        plot(summaries, Path(args.png), _title(str(model), args.steps))
    return 0


def _title(model: str, steps: int) -> str:
    return f"long-tail agentic workload, {steps} steps ({Path(model).name})"


def _replot(args: argparse.Namespace) -> int:
    reports = [json.loads(path.read_text()) for path in args.replot]
    runs: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        for mode, summaries in report["runs"].items():
            runs.setdefault(mode, []).extend(summaries)
    combined = {**reports[0], "modes": compare(runs), "runs": runs, "combined_from": [str(p) for p in args.replot]}
    if args.json or len(reports) > 1:
        emit_json(combined, args.json)
    if args.png:
        workload = combined["workload"]
        plot(runs, Path(args.png), _title(workload["model"], workload["steps"]))
    return 0


def _model(name: str) -> Path | str:
    if name != "tiny":
        return name
    from miles_models.testing import tiny_model

    return tiny_model("dense")


def _train(model: Path | str, mode: str, repeat: int, args: argparse.Namespace, runs_dir: Path,
           extra: list[str]) -> dict[str, Any]:
    name = f"{mode}-{repeat}"
    overrides = [f"model.name={model}", f"run.output_dir={runs_dir}", f"run.name={name}", f"run.steps={args.steps}",
                 *WORKLOAD, *MODE_SETTINGS[mode], *args.overrides, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "miles.cli.main", "train", *overrides], capture_output=True, text=True,
                         timeout=args.timeout, env=env)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"the {mode} run (repeat {repeat}) failed with exit code {out.returncode}; see above")
    rows = [json.loads(line) for line in (runs_dir / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = run_summary(rows)
    summary["process_wall_s"] = wall
    trained = trained_rows(runs_dir / name)
    summary["trained_lengths"] = trained_lengths(trained)
    summary["turn_latency_s"] = turn_latencies(trained)
    summary["engine"] = engine_stats(runs_dir / name)
    print(f"{name}: {summary['time_to_steps_s']:.1f} s for steps 2..{args.steps}, "
          f"{summary['samples_per_s']:.2f} samples/s", file=sys.stderr, flush=True)
    return summary
