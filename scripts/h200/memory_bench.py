"""Peak GPU memory and step time with and without ``resources.release_engine_memory`` (one GPU).

    bash scripts/h200/memory_bench.sh [--settings none kv_cache all] [--repeats 3] [--steps 10] [-- overrides...]

The learning config (``scripts/learning/arithmetic_h200.yaml``: SmolLM2-135M's shape, GRPO, 32
prompts x 8 samples, 32 new tokens) in ``run.mode sync``, trainer rank and embedded engine on one
GPU, no evaluation, no checkpoint, no export: one warm-up run (setting ``none``, thrown away), then
``--repeats`` rounds of one run per setting, the settings interleaved so that drift over the session
hits each alike.

Per run: ``memory.used`` of the GPU, sampled every ``--interval`` s while it runs (NVML through
pynvml when it imports, else one ``nvidia-smi --query-gpu=memory.used`` per sample: both count what
every process holds, caching allocators included, which is what decides whether trainer and
engine fit beside each other; ``torch.cuda.max_memory_allocated`` sees one process and not its
cache). ``peak_mib`` is the maximum over the whole run (start-up included), ``peak_steady_mib``
over the steps after the first ``--skip``; ``idle_mib`` is the reading just before the run. Step
time: the wall time between consecutive steps' records in ``metrics.jsonl`` (everything the loop
does), the first ``--skip`` steps left out, and the median of each ``time/*`` phase.

Every finished run is appended to ``<work>/runs.jsonl``; the same command again (a later device
call on the warm machine) skips what is there, and a run is started only while ``--budget``
seconds allow one more (estimated from the longest run so far), so the measurement may span calls.
At the end it prints JSON -- per setting the median and spread over the repeats, and each setting
against ``none`` measured in the same session -- and writes it to ``<out>/memory-h200.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

PHASES = ("time/rollout", "time/release", "time/train", "time/resume", "time/sync")


# ---------------------------------------------------------------------------------------- memory


def nvml_reader(gpu: int) -> Callable[[], float] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    except Exception:  # not installed, or no driver library: fall back to nvidia-smi
        return None
    return lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20


def smi_reader(gpu: int) -> Callable[[], float] | None:
    if shutil.which("nvidia-smi") is None:
        return None
    command = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(gpu)]
    return lambda: float(subprocess.run(command, capture_output=True, text=True, timeout=10, check=True).stdout.split()[0])


class Sampler(threading.Thread):
    """``(time.time(), MiB used)`` of one GPU every ``interval`` seconds until :meth:`stop`."""

    def __init__(self, read: Callable[[], float], interval: float) -> None:
        super().__init__(daemon=True)
        self.read, self.interval = read, interval
        self.samples: list[tuple[float, float]] = []
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.samples.append((time.time(), self.read()))
            self._done.wait(self.interval)

    def stop(self) -> list[tuple[float, float]]:
        self._done.set()
        self.join(30)
        return self.samples


# ---------------------------------------------------------------------------------------- one run


def step_rows(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if "step" in r and "time" in r), key=lambda r: r["step"])


def describe_run(rows: list[dict], samples: list[tuple[float, float]], skip: int) -> dict:
    """Step walls after the first ``skip`` steps, phase medians, and the memory peaks."""
    walls = [b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False)][max(0, skip - 1):]
    timed = rows[skip:]
    phases = {k: statistics.median(r[k] for r in timed if k in r) for k in PHASES if any(k in r for r in timed)}
    steady_from = rows[skip - 1]["time"] if 0 < skip <= len(rows) else float("-inf")
    steady = [used for t, used in samples if t >= steady_from]
    return {
        "steps": len(rows), "step_walls_s": walls,
        "step_s_median": statistics.median(walls) if walls else None,
        "phase_s_median": phases,
        "peak_mib": max((used for _, used in samples), default=None),
        "peak_steady_mib": max(steady, default=None),
    }


def run_once(args: argparse.Namespace, read: Callable[[], float] | None, setting: str, name: str) -> dict:
    run_dir = args.runs / name
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"model.name={args.model}", f"run.output_dir={args.runs}", f"run.name={name}", f"run.steps={args.steps}",
                 "run.mode=sync", "eval.every=0", "run.export_hf=false", "run.save_final=false",
                 f"resources.release_engine_memory={setting}", *args.overrides]
    log = args.work / f"{name}.log"
    idle = read() if read is not None else None
    sampler = Sampler(read, args.interval) if read is not None else None
    if sampler is not None:
        sampler.start()
    start = time.monotonic()
    with log.open("w") as out:
        try:
            rc = subprocess.run([sys.executable, "-m", "miles.cli.main", "train", str(args.config), *overrides],
                                stdout=out, stderr=subprocess.STDOUT, timeout=args.run_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.monotonic() - start
    samples = sampler.stop() if sampler is not None else []
    result = {"setting": setting, "name": name, "rc": rc, "wall_s": wall, "idle_mib": idle,
              **describe_run(step_rows(run_dir / "metrics.jsonl"), samples, args.skip)}
    if rc != 0:
        result["log_tail"] = log.read_text()[-3000:]
    return result


# ---------------------------------------------------------------------------------------- summary


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)} if values else {}


def summarize(runs: list[dict], settings: list[str]) -> dict:
    measured = [r for r in runs if r["name"] != "warmup" and r["rc"] == 0]
    per_setting = {}
    for setting in settings:
        mine = [r for r in measured if r["setting"] == setting]
        walls = [w for r in mine for w in r["step_walls_s"]]
        per_setting[setting] = {
            "runs": len(mine),
            "step_s_median_per_run": spread([r["step_s_median"] for r in mine if r["step_s_median"] is not None]),
            "step_s_all_walls": {**spread(walls), **({"quartiles": statistics.quantiles(walls, n=4)} if len(walls) > 1 else {})},
            "peak_mib": spread([r["peak_mib"] for r in mine if r["peak_mib"] is not None]),
            "peak_steady_mib": spread([r["peak_steady_mib"] for r in mine if r["peak_steady_mib"] is not None]),
            "phase_s_median": {k: statistics.median(r["phase_s_median"][k] for r in mine if k in r["phase_s_median"])
                               for k in PHASES if any(k in r["phase_s_median"] for r in mine)},
        }
    base = per_setting.get("none", {})
    against = {}
    for setting, s in per_setting.items():
        if setting == "none" or not base.get("runs") or not s["runs"]:
            continue
        entry: dict = {"step_time_ratio": s["step_s_median_per_run"]["median"] / base["step_s_median_per_run"]["median"]}
        for key in ("peak_mib", "peak_steady_mib"):
            if s[key] and base[key]:
                entry[f"{key}_saved"] = base[key]["median"] - s[key]["median"]
        against[setting] = entry
    return {"settings": per_setting, "against_none": against}


# ---------------------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=["none", "kv_cache", "all"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2, help="leading steps left out (graph capture, allocator warm-up)")
    parser.add_argument("--model", default=os.environ.get("MODEL", "/tmp/sgmodel"))
    parser.add_argument("--config", type=Path, default=Path("scripts/learning/arithmetic_h200.yaml"))
    parser.add_argument("--gpu", type=int, default=0, help="the GPU to sample (nvidia-smi's index)")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between memory samples")
    parser.add_argument("--work", type=Path, default=Path("/tmp/membench"))
    parser.add_argument("--runs", type=Path, default=Path("/tmp/runs"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    parser.add_argument("--budget", type=float, default=540.0, help="start no run that would end after this many seconds")
    parser.add_argument("--run-timeout", type=float, default=300.0)
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for every run (after --)")
    args = parser.parse_args()
    if not Path(args.model, "config.json").exists():
        print(f"no model at {args.model}: run `bash scripts/h200/sglang_parts.sh prepare` (random weights, carry "
              f".benchcfg) or scripts/h200/model.sh, or pass --model", file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    read = nvml_reader(args.gpu)
    sampler = "pynvml" if read is not None else None
    if read is None:
        read = smi_reader(args.gpu)
        sampler = "nvidia-smi" if read is not None else None
    ledger = args.work / "runs.jsonl"
    runs = [json.loads(line) for line in ledger.read_text().splitlines()] if ledger.exists() else []
    plan = [("none", "warmup")] + [(s, f"{s}-r{r}") for r in range(1, args.repeats + 1) for s in args.settings]
    started = time.monotonic()
    longest = max((r["wall_s"] for r in runs), default=120.0)
    for setting, name in plan:
        if any(r["name"] == name for r in runs):
            continue
        if time.monotonic() - started + longest > args.budget:
            break
        result = run_once(args, read, setting, name)
        longest = max(longest, result["wall_s"])
        runs.append(result)
        with ledger.open("a") as out:
            out.write(json.dumps(result) + "\n")
        peak = result["peak_mib"]
        print(f"{name}: exit {result['rc']} in {result['wall_s']:.0f} s, step {result['step_s_median']} s, "
              f"peak {peak} MiB", file=sys.stderr, flush=True)
        if result["rc"] != 0:
            print(result["log_tail"], file=sys.stderr)
    done = {r["name"] for r in runs}
    left = [name for _, name in plan if name not in done]
    report = {
        "what": "learning config, run.mode sync, one GPU: resources.release_engine_memory off and on",
        "command": " ".join([sys.argv[0], *sys.argv[1:]]), "model": args.model, "steps": args.steps, "skip": args.skip,
        "sampler": sampler, "gpu": args.gpu, "runs_left": left,
        **summarize(runs, args.settings), "runs": runs,
    }
    text = json.dumps(report, indent=1)
    (args.out / "memory-h200.json").write_text(text)
    print(text)
    return 0 if not left else 3


if __name__ == "__main__":
    sys.exit(main())
