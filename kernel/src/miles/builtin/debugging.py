"""``miles replay``, ``miles rollout`` and ``miles ledger``: a step of a run trained or scored again
from its dumps, generation without a trainer, and what became of every prompt a run drew
(registered by the built-in ``train`` plugin, beside ``miles train``, whose run folders and
start-up they share). docs/design/debugging.md, docs/design/ledger.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from miles_contracts import CommandSpec, RunContext

from miles.cli.config_args import add_config_arguments, split_config_args
from miles.errors import MilesError

REPLAY = """\
Train step N of a run again from its dumps, on this machine, with no engine, and compare the
loss metrics (and, with run.weights_digest, the weights after the update) with what the run
logged. Starts from the newest checkpoint before step N, else from the base model, training the
steps in between from their dumps too. Needs a run made with run.dump_tokens=true. Prints JSON;
exits 1 when step N differs.

With --rescore, scores step N's recorded episodes again instead (nothing trains, nothing is
generated, the run folder is not changed) and prints each sample's old and new reward:

  miles replay runs/arithmetic --step 3
  miles replay runs/arithmetic --step 3 --rescore --reward f1
  miles replay runs/arithmetic reward.remote_url=http://127.0.0.1:8000/score --step 3 --rescore

Overrides come right after RUN_DIR, before the options.
"""

ROLLOUT = """\
Generate and score without training: starts the engines, router and session server as `miles
train` does, but no trainer; each step draws rollout.prompts_per_step groups from the data source,
generates, scores and filters them and writes <run>/samples/step_<n>.jsonl like a training run.
Prints a JSON summary per step. For debugging a generator, an agent or a reward.

  miles rollout examples/calculator_agent/config.yaml rollout.prompts_per_step=2 --steps 1
"""


def _emit(report: object, out: str | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def _replay(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles.config import load_config
    from miles.loop.folder_config import refuse_folder_privileges

    run_dir = Path(args.run_dir)
    overrides = list(args.overrides)
    stray = [item for item in overrides if "=" not in item]
    if stray:
        raise MilesError(f"expected section.key=value overrides after the run folder, got {stray}")
    if not args.rescore and (overrides or args.reward):
        raise MilesError("overrides and --reward change the scoring of --rescore; a replay trains with the run's "
                         "own config (its point is to get the same bits)")
    if not (run_dir / "config.yaml").is_file():
        raise MilesError(f"{run_dir} is not a run folder (no config.yaml); runs live under run.output_dir")
    config = load_config(run_dir / "config.yaml", overrides)
    if not args.trust_run_config:  # the folder may come from anyone: as for `miles train --resume`
        refuse_folder_privileges(config, overrides, run_dir, command=f"miles replay --step {args.step}"
                                 + (" --rescore" if args.rescore else ""))
    if args.rescore:
        from miles.loop.rescore import rescore_step

        _emit(rescore_step(config, run_dir, args.step, reward=args.reward), args.out)
        return 0
    from miles.loop.replay import replay_step

    report = replay_step(config, run_dir, args.step)
    _emit(report, args.out)
    return 0 if report["equal"] else 1


def _replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (<run.output_dir>/<run.name>)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="with --rescore: config overrides (reward.name=..., reward.remote_url=...), right after RUN_DIR")
    p.add_argument("--step", type=int, required=True, help="the step to replay (from 1)")
    p.add_argument("--rescore", action="store_true", help="score the step's recorded episodes again instead")
    p.add_argument("--reward", metavar="NAME",
                   help="with --rescore: score every sample with this reward (a row's own choice included)")
    p.add_argument("--out", metavar="FILE", help="also write the JSON report here")
    p.add_argument("--trust-run-config", action="store_true",
                   help="take every setting from the run folder's config.yaml, those that start programs or receive "
                        "the run's token included (only for a folder you wrote)")


def _rollout(args: argparse.Namespace, ctx: RunContext) -> int:
    import asyncio

    from miles.builtin.train import prepare_run_environment
    from miles.config import load_config
    from miles.loop.rollout_only import generate_steps
    from miles.loop.run_dir import new_run_dir

    if args.steps < 1:
        raise MilesError(f"--steps must be 1 or more, got {args.steps}")
    config_path, overrides = split_config_args(args.items)
    config = load_config(config_path, overrides)
    prepare_run_environment()
    run_dir = new_run_dir(config)
    print(f"miles rollout: writing {run_dir}", file=sys.stderr, flush=True)
    steps = asyncio.run(generate_steps(config, run_dir, args.steps))
    _emit({"run": str(run_dir), "steps": steps}, args.out)
    return 0


def _rollout_args(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--steps", type=int, default=1, help="steps to generate (default 1)")
    p.add_argument("--out", metavar="FILE", help="also write the JSON summary here")


REPLAY_COMMAND = CommandSpec("train or score a step of a run again from its dumps (no engines)", _replay,
                             add_arguments=_replay_args, description=REPLAY)
ROLLOUT_COMMAND = CommandSpec("generate and score without training (engines, router, no trainer)", _rollout,
                              add_arguments=_rollout_args, description=ROLLOUT)


LEDGER = """\
Summarise a run's sample ledger (<run>/ledger/): per data epoch, the prompts trained, filtered and
dropped (by reason), recycled and aborted (by reason), still in flight, lost (drawn or due and
never trained nor dropped with a reason) and duplicated (settled more than once). Prints JSON;
exits 1 when any prompt was lost or duplicated. docs/design/ledger.md.

  miles ledger runs/arithmetic
"""


def _ledger(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles.loop.ledger import summarize

    report = summarize(Path(args.run_dir))
    print(json.dumps(report, indent=2))
    return 1 if report["lost"] or report["duplicated"] else 0


def _ledger_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (<run.output_dir>/<run.name>)")


LEDGER_COMMAND = CommandSpec("what became of every prompt a run drew: trained, dropped, lost, duplicated", _ledger,
                             add_arguments=_ledger_args, description=LEDGER)
