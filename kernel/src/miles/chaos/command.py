"""The ``miles chaos`` command (registered by the built-in ``train`` plugin)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from miles_contracts import CommandSpec, RunContext

from miles.cli.config_args import add_config_arguments, split_config_args
from miles.errors import MilesError

DESCRIPTION = """\
Run `miles train CONFIG` and SIGKILL one of its processes at random (seeded) times: a trainer
rank, an engine, the router, the session server, a reward worker, a sandbox or the driver itself,
among those the run has (kinds it lacks are listed in the output). After each kill it does what a
user would: nothing if the run recovers on its own, `miles train --resume RUN_DIR` if the driver
exits. At the end the sample ledger must show 0 lost and 0 duplicated prompts in every epoch.
Prints JSON (injections by kind, recoveries, time, the ledger summary, passed); exits 1 on failure.
Each attempt's output is in <run>/chaos/. docs/design/async.md, "Fault injection".

  miles chaos examples/arithmetic/config.yaml --injections 10 --seed 1
  miles chaos cfg.yaml run.steps=40 --injections 100 --kinds engine,router,driver --out chaos.json
  miles chaos cfg.yaml run.mode=sync --injections 3 --kinds engine,router,reward_worker --deterministic
"""


def _chaos(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles.chaos.harness import ChaosPlan, run_chaos
    from miles.chaos.reference import DETERMINISTIC_OVERRIDES, check_deterministic_kinds
    from miles.config import load_config

    config_path, overrides = split_config_args(args.items)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if args.deterministic:
        check_deterministic_kinds(kinds)
        overrides = [*overrides, *DETERMINISTIC_OVERRIDES]
    config = load_config(config_path, overrides)
    name = config.run.name or time.strftime("chaos-%Y%m%d-%H%M%S")
    run_dir = config.run.output_dir / name
    if (run_dir / "config.yaml").exists():
        raise MilesError(f"{run_dir} already holds a run; miles chaos starts a new one: choose another run.name")
    low, _, high = args.gap.partition(",")
    try:
        gap = (float(low), float(high or low))
    except ValueError as exc:
        raise MilesError(f"--gap takes LOW,HIGH seconds (e.g. 1,6), got {args.gap!r}") from exc
    plan = ChaosPlan(config_path, (*overrides, f"run.name={name}"), run_dir, args.injections, seed=args.seed,
                     kinds=kinds, gap=gap, recovery_timeout=args.recovery_timeout, timeout=args.timeout,
                     max_resumes=args.max_resumes, deterministic=args.deterministic)
    report = run_chaos(plan)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(f"miles chaos: {'passed' if report['passed'] else 'FAILED: ' + '; '.join(report['failures'])}",
          file=sys.stderr)
    return 0 if report["passed"] else 1


def _chaos_args(p: argparse.ArgumentParser) -> None:
    from miles.chaos.targets import KINDS

    add_config_arguments(p)
    p.add_argument("--injections", type=int, required=True, help="how many processes to SIGKILL")
    p.add_argument("--seed", type=int, default=0, help="seed of the times and choices (default 0)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"kinds that may be killed (default all: {','.join(KINDS)})")
    p.add_argument("--gap", default="1,6", help="seconds LOW,HIGH waited before each kill, drawn uniformly (default 1,6)")
    p.add_argument("--recovery-timeout", type=float, default=180.0,
                   help="seconds the run may take to progress again after a kill (default 180)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole chaos run (default 3600)")
    p.add_argument("--max-resumes", type=int, metavar="N",
                   help="at most N kills of kinds that end the driver (trainer ranks, the driver); after them only "
                        "rollout kinds are chosen (each resume costs a full start-up: a time budget for short runs)")
    p.add_argument("--deterministic", action="store_true",
                   help="run.deterministic (sync or one_step_off), rollout kinds only; at the end, run the same steps "
                        "without faults and require the same final weights (weights.final_weights_equal)")
    p.add_argument("--out", metavar="FILE", help="also write the JSON report here")


CHAOS_COMMAND = CommandSpec("SIGKILL a run's processes at random; check that no prompt is lost or repeated", _chaos,
                            add_arguments=_chaos_args, description=DESCRIPTION)
