"""Built-in plugin ``train``: the ``miles train`` command (the main job), ``miles chaos`` (:mod:`miles.chaos`), and ``miles replay``,
``miles rollout`` and ``miles ledger`` (:mod:`miles.builtin.debugging`), which read and write the
same run folders."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from miles_contracts import CommandSpec, RunContext

from miles.cli.config_args import add_config_arguments, split_config_args
from miles.errors import MilesError
from miles.hookspecs import hookimpl
from miles.registry import Register

DESCRIPTION = """\
Run RL training. With no config, runs the embedded default: SmolLM2-135M-Instruct (fetched on
first use) learns single-digit addition with GRPO on CPU, 10 steps of 16 samples; the run says at
the start what its reward measures and what it should do.

  miles train                                   # embedded default
  miles train examples/arithmetic/config.yaml   # a config file
  miles train rollout.temperature=0.8 run.steps=20
  miles train --resume runs/miles-20261129-101500 [run.steps=20]

--resume takes the settings that start programs or receive the run's token (sglang.python,
sglang.env, ...) from the run folder only if the command line repeats them, or with
--trust-run-config (docs/design/security.md, "Run folders and checkpoints").
"""


def prepare_run_environment() -> None:
    """What this process's environment needs before it starts a run's processes (``miles train``,
    ``miles rollout``)."""
    from miles_contracts.wire.auth import ensure_run_token

    from miles.loopback import keep_loopback_off_proxies

    # One secret per run, in this process's environment: every service the run starts inherits it.
    ensure_run_token()
    # and no HTTP proxy between the run's processes, for clients Miles does not write (agents')
    added = keep_loopback_off_proxies(os.environ)
    if added:
        print(f"miles: an HTTP proxy is set; added {','.join(added)} to NO_PROXY so loopback calls bypass it",
              file=sys.stderr)


def _train(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles.loop.interrupts import exit_code_of

    prepare_run_environment()
    return exit_code_of(lambda: _train_run(args))


def _train_run(args: argparse.Namespace) -> str:
    from miles import embedded_default
    from miles.config import load_config
    from miles.kernel import Kernel
    from miles.loop.folder_config import TRUST_FLAG, refuse_folder_privileges
    from miles.loop.run_dir import new_run_dir
    from miles.loop.runner import run_training
    from miles.private_files import write_private_text

    config_path, overrides = split_config_args(args.items)
    if args.trust_run_config and not args.resume:
        raise MilesError(f"{TRUST_FLAG} goes with --resume RUN_DIR: it accepts that run folder's config")
    if args.resume:
        run_dir = Path(args.resume)
        if config_path is not None:
            raise MilesError("--resume takes the config from the run folder; give only overrides")
        if not (run_dir / "config.yaml").is_file():
            raise MilesError(f"{run_dir} is not a run folder (no config.yaml); runs live under run.output_dir")
        config = load_config(run_dir / "config.yaml", overrides)
        if not args.trust_run_config:  # before anything runs: the folder may come from anyone
            refuse_folder_privileges(config, overrides, run_dir)
        write_private_text(run_dir / "config.yaml", config.to_yaml())
        return run_training(config, run_dir, resume=True)
    config = load_config(config_path, overrides)
    if config_path is None:  # a newcomer's first run: say what it does and what its reward should do
        print(embedded_default.introduction(config), file=sys.stderr, flush=True)
    # a model name no plugin knows fails here, before the run folder exists (it would hold only
    # config.yaml); a known one is pulled now rather than after the folder is made
    Kernel.load(config.plugin_selection).resolve_model(config.model.name)
    status = run_training(config, new_run_dir(config))
    closing = embedded_default.closing(config) if config_path is None and status == "completed" else None
    if closing is not None:
        print(closing, file=sys.stderr, flush=True)
    return status


def _args(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--trust-run-config", action="store_true",
                   help="with --resume: take every setting from the run folder's config.yaml, those that start "
                        "programs or receive the run's token included (only for a folder you wrote)")


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    from miles.builtin.debugging import LEDGER_COMMAND, REPLAY_COMMAND, ROLLOUT_COMMAND
    from miles.chaos.command import CHAOS_COMMAND

    register("train", CommandSpec("run RL training (the embedded default when no config is given)",
                                  _train, add_arguments=_args, description=DESCRIPTION))
    register("replay", REPLAY_COMMAND)
    register("rollout", ROLLOUT_COMMAND)
    register("ledger", LEDGER_COMMAND)
    register("chaos", CHAOS_COMMAND)
