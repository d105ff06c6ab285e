"""Miles' step time against TRL's on the learning config, interleaved repeats (docs/benchmarks/learning.md).

    python3 scripts/h200/overlap_bench.py [--parts miles-async trl] [--repeats 3] [--steps 20] [--model /tmp/smol]

Each round runs every part once, in order (so drift over the session hits each part alike):
``miles-async`` (``run.mode=one_step_off``), ``miles-sync``, ``miles-async-compile`` (one_step_off with
``fsdp.compile=true``), ``trl`` (scripts/learning/trl_grpo.py),
all on the learning config (scripts/learning/arithmetic_h200.yaml) with evaluation, export and the
final checkpoint off, ``--steps`` steps each. Per run: the median step wall time over the steps
after the first ``--skip`` (Miles: differences of metrics.jsonl time stamps, everything the loop
does; TRL: its trainer's step, generation included), and for Miles the median of each ``time/*``
phase. Finished runs are appended to ``<work>/runs.jsonl`` and skipped when the command runs again
(a later call on the warm machine continues); a run starts only while ``--budget`` seconds allow
one more. Prints JSON -- per part the median and range over its runs, and each Miles part's
speed-up over TRL (TRL's median step / the part's) -- and writes it to ``<out>/overlap-h200.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIG = "scripts/learning/arithmetic_h200.yaml"


MILES_PARTS = {  # part -> its overrides of the learning config
    "miles-async": ["run.mode=one_step_off", "algorithm.correction=tis"],  # staleness 1 needs a correction
    "miles-sync": ["run.mode=sync"],
    "miles-async-compile": ["run.mode=one_step_off", "algorithm.correction=tis", "fsdp.compile=true"],
}


def miles_command(part: str, name: str, args: argparse.Namespace) -> list[str]:
    return ["miles", "train", CONFIG, f"model.name={args.model}", f"run.output_dir={args.work}/runs", f"run.name={name}",
            f"run.steps={args.steps}", "eval.every=0", "run.export_hf=false", "run.save_final=false",
            *MILES_PARTS[part], *args.overrides]


def run_one(part: str, index: int, args: argparse.Namespace) -> dict:
    name = f"{part}-{index}"
    log = args.out / f"{name}.log"
    start = time.perf_counter()
    if part == "trl":
        command = [sys.executable, "scripts/learning/trl_grpo.py", "--model", args.model, "--steps", str(args.steps),
                   "--out", str(args.work / name)]
    else:
        command = miles_command(part, name, args)
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    record = {"part": part, "index": index, "exit": code, "seconds": time.perf_counter() - start}
    if code != 0:
        return record
    if part == "trl":
        steps = json.loads((args.work / name / "trl.json").read_text())["steps"]
        walls = [s["seconds"] for s in steps][args.skip:]
    else:
        rows = [json.loads(line) for line in (args.work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        walls = [b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False)][max(0, args.skip - 1):]
        timed = rows[args.skip:]
        phases = sorted({k for r in timed for k in r if k.startswith("time/")})
        record["phase_s_median"] = {k: statistics.median(r[k] for r in timed if k in r) for k in phases}
        record["reward_first_last"] = [rows[0].get("rollout/reward_mean"), rows[-1].get("rollout/reward_mean")]
    record["step_s_median"] = statistics.median(walls)
    record["step_s"] = walls
    return record


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def report(records: list[dict], parts: list[str]) -> dict:
    done = [r for r in records if r["exit"] == 0]
    out: dict = {"parts": {}}
    for part in parts:
        medians = [r["step_s_median"] for r in done if r["part"] == part]
        if not medians:
            continue
        entry = {"step_s": spread(medians), "runs": [round(m, 4) for m in medians]}
        phases = [r["phase_s_median"] for r in done if r["part"] == part and "phase_s_median" in r]
        if phases:
            keys = sorted({k for p in phases for k in p})
            entry["phase_s_median"] = {k: statistics.median(p[k] for p in phases if k in p) for k in keys}
        out["parts"][part] = entry
    trl = out["parts"].get("trl")
    if trl:
        for part, entry in out["parts"].items():
            if part != "trl":
                entry["speedup_over_trl"] = trl["step_s"]["median"] / entry["step_s"]["median"]
    out["failed"] = [f"{r['part']}-{r['index']} (exit {r['exit']})" for r in records if r["exit"] != 0]
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", nargs="+", default=["miles-async", "trl"], choices=[*MILES_PARTS, "trl"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="leading steps left out (CUDA graphs, allocator warm-up)")
    parser.add_argument("--model", default="/tmp/smol")
    parser.add_argument("--work", type=Path, default=Path("/tmp/overlap"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    parser.add_argument("--budget", type=float, default=540.0, help="seconds this call may spend starting runs")
    parser.add_argument("overrides", nargs="*", help="extra config overrides for the Miles parts (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    ledger = args.work / "runs.jsonl"
    records = [json.loads(line) for line in ledger.read_text().splitlines()] if ledger.exists() else []
    seen = {(r["part"], r["index"]) for r in records}
    began, longest, left = time.perf_counter(), 0.0, False
    for index in range(args.repeats):
        for part in args.parts:
            if (part, index) in seen:
                continue
            if time.perf_counter() - began + longest * 1.2 > args.budget:
                left = True
                continue
            record = run_one(part, index, args)
            longest = max(longest, record["seconds"])
            print(f"{part}-{index}: exit {record['exit']} in {record['seconds']:.0f} s, "
                  f"step {record.get('step_s_median', float('nan')):.3f} s", flush=True)
            records.append(record)
            with ledger.open("a") as f:
                f.write(json.dumps(record) + "\n")
    result = report(records, args.parts)
    result["left_for_another_call"] = left
    text = json.dumps(result, indent=2)
    (args.out / "overlap-h200.json").write_text(text)
    print(text)
    return 3 if left else 0


if __name__ == "__main__":
    sys.exit(main())
