"""What `train.reuse_rollout_logprobs` saves: `miles train` with it off and on, CPU, tiny dense model.

    uv run python scripts/on_policy/reuse_cpu.py --out-dir /tmp/reuse-cpu --repeats 2 --steps 4 \\
        --json docs/benchmarks/on-policy-reuse-cpu.json

Each repeat runs both variants one after the other (the order alternates between repeats, so a
machine that gets busier does not favour one), as `miles train rollout.true_on_policy=true
run.deterministic=true train.updates_per_step=U train.reuse_rollout_logprobs=<off|on> ...` with
OMP_NUM_THREADS=1. A step's train time is what the learner logs: `time/logprobs` (the scoring
passes, the old-policy pass among them without reuse) plus `time/optimizer` (the train step).
Step 1 is the warm-up and is left out. With run.deterministic and true_on_policy both variants
train the very same batches (the reuse test asserts it bit for bit; `same_batches` here compares
the dumped tokens), so step k of one variant against step k of the other is a paired measurement.

Prints JSON: per variant every timed step's seconds, their median and spread ((max - min) /
median); the median of the paired ratios on / off; the skipped pass's own seconds
(`time/old_logprobs`) and its share of the step without reuse; the train step alone
(`time/optimizer`, the same work in both variants: its spread is the machine's noise); how many
old-policy passes ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

VARIANTS = ("off", "on")


def _run(out_dir: Path, name: str, reuse: bool, args: argparse.Namespace, model: Path) -> Path:
    run = out_dir / name
    if (run / "metrics.jsonl").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) == args.steps:
        return run  # already measured
    overrides = [
        f"model.name={model}", f"run.output_dir={out_dir}", f"run.name={name}", f"run.steps={args.steps}",
        "run.deterministic=true", "run.dump_tokens=true", "run.save_final=false",
        f"rollout.prompts_per_step={args.prompts}", "rollout.samples_per_prompt=2",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.temperature=0.8", "rollout.true_on_policy=true",
        f"train.updates_per_step={args.updates}", f"train.reuse_rollout_logprobs={str(reuse).lower()}",
        "data.options={digits: 1}", "executor.startup_timeout=180",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for attempt in (1, 2):  # a shared machine: another job can take a service's port between pick and bind
        out = subprocess.run([sys.executable, "-m", "miles.cli.main", "train", *overrides], capture_output=True,
                             text=True, env=env)
        if out.returncode == 0:
            return run
        print(f"miles train {name} failed (attempt {attempt}):\n{out.stderr[-2000:]}", file=sys.stderr)
        shutil.rmtree(run, ignore_errors=True)
    raise SystemExit(f"miles train {name} failed twice")


def _steps(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _batches(run: Path, steps: int) -> list[list[list[int]]]:
    return [[json.loads(line)["tokens"] for line in (run / "samples" / f"step_{s:06d}.jsonl").read_text().splitlines()]
            for s in range(1, steps + 1)]


def _summary(seconds: list[float]) -> dict[str, Any]:
    median = statistics.median(seconds)
    return {"step_s": seconds, "median_s": median, "spread": (max(seconds) - min(seconds)) / median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is the warm-up)")
    parser.add_argument("--updates", type=int, default=2, help="train.updates_per_step")
    parser.add_argument("--prompts", type=int, default=4, help="rollout.prompts_per_step (2 samples each)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: step 1 is the warm-up")
    from miles_models.testing import tiny_model

    model = tiny_model("dense")
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    optimizer: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios, pass_s, pass_share, passes, same = [], [], [], {v: 0 for v in VARIANTS}, True
    for repeat in range(args.repeats):
        order = VARIANTS if repeat % 2 == 0 else VARIANTS[::-1]
        runs = {v: _run(args.out_dir, f"{v}_{repeat}", v == "on", args, model) for v in order}
        timed = {v: [m["time/logprobs"] + m["time/optimizer"] for m in _steps(runs[v])][1:] for v in VARIANTS}
        for v in VARIANTS:
            seconds[v] += timed[v]
            optimizer[v] += [m["time/optimizer"] for m in _steps(runs[v])][1:]
            passes[v] += sum("time/old_logprobs" in m for m in _steps(runs[v]))
        pass_s += [m["time/old_logprobs"] for m in _steps(runs["off"])][1:]
        pass_share += [p / t for p, t in zip(pass_s[-len(timed["off"]):], timed["off"], strict=True)]
        ratios += [on / off for on, off in zip(timed["on"], timed["off"], strict=True)]
        same = same and _batches(runs["off"], args.steps) == _batches(runs["on"], args.steps)
    result = {
        "machine": "CPU, 2 shared cores (other jobs running), OMP_NUM_THREADS=1",
        "settings": {"model": "tiny dense (miles_models.testing)", "repeats": args.repeats, "steps": args.steps,
                     "warmup_steps": 1, "updates_per_step": args.updates, "samples_per_step": 2 * args.prompts,
                     "max_new_tokens": args.max_new_tokens, "dtype": "float32"},
        "off": _summary(seconds["off"]), "on": _summary(seconds["on"]),
        "ratio_on_off_median": statistics.median(ratios), "ratios_on_off": ratios,
        # what the skipped pass itself took, and the rest of the step (the same work in both variants)
        "old_logprob_pass": _summary(pass_s), "old_logprob_pass_share_of_off_median": statistics.median(pass_share),
        "optimizer_off": _summary(optimizer["off"]), "optimizer_on": _summary(optimizer["on"]),
        "old_logprob_passes": passes, "same_batches": same,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
