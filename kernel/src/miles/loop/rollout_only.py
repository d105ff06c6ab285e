"""``miles rollout CONFIG``: generation and rewards only, for debugging generators, agents and
rewards without a trainer.

It starts what generation needs the way ``miles train`` does -- the executor, the placement
(:func:`~miles.loop.runner.place`), the engines, the router and the services the generator asks
for (:func:`~miles.loop.services.start_services`) -- and no trainer rank. Each step draws
``rollout.prompts_per_step`` groups, generates, scores and filters them with the loop's
:class:`~miles.loop.rollout.RolloutManager`, and writes ``samples/step_<n>.jsonl`` in the same
shape a training run does (``run.dump_tokens`` decides about tokens). The engines serve the base
model's weights throughout: nothing trains. On GPUs, the placement still reserves the trainer's
GPUs of the layout, so that a config behaves here as in training.
"""

from __future__ import annotations

import asyncio
import functools
import math
import random
from pathlib import Path
from typing import Any

from miles_contracts import Process, RunContext

from miles.config import MilesConfig
from miles.data.source import open_data_source
from miles.engine_client import HttpEngineClient
from miles.loop.progress import Progress
from miles.loop.rollout import RolloutManager, StepRollout
from miles.loop.run_dir import dump_samples
from miles.loop.runner import load_tokenizer, place
from miles.loop.services import start_services


def step_summary(step: int, rollout: StepRollout, dump: Path) -> dict[str, Any]:
    """What one generated step came to (timings left out), for the command's JSON."""
    metrics = {k: v for k, v in rollout.metrics.items()
               if not (k.startswith(("time/", "perf/")) or k.endswith("/seconds") or math.isnan(v))}
    return {"step": step, "samples": len(rollout.all_samples), "groups_kept": len(rollout.groups),
            "dump": str(dump), "metrics": metrics}


async def generate_steps(config: MilesConfig, run_dir: Path, steps: int) -> list[dict[str, Any]]:
    """Start the generation side of ``config``'s run in ``run_dir``, generate and score ``steps``
    steps, dump each, stop everything; a summary per step."""
    from miles.kernel import Kernel

    kernel = Kernel.load(config.plugin_selection)
    ctx = RunContext(config, kernel, Process.driver(), run_dir)
    kernel.configure(ctx)
    random.seed(config.run.seed)
    progress = Progress(steps)
    model_path = kernel.resolve_model(config.model.name)
    tokenizer = load_tokenizer(model_path)
    data = open_data_source(ctx)
    executor = kernel.executors().get(config.executor.name).create(ctx)
    try:
        placement = place(config, executor, kernel)
        progress.message(f"starting {len(placement.engines)} {config.rollout.engine} engine(s) and the router "
                         f"(no trainer: generation and rewards only)")
        services = start_services(config, kernel, model_path, executor, placement, run_dir)
        # not supervised: a restarted engine would wait for a weight sync that never comes here, so
        # an engine that dies costs its samples (aborted, in the dump) and nothing else
        services.write_manifest()
        rollouts = RolloutManager(ctx, data, HttpEngineClient(services.router_url), tokenizer, services.session_url,
                                  service_urls=services.urls_by_role())
        await asyncio.to_thread(services.wait_ready, config.executor.startup_timeout, router=True)
        summaries = []
        for step in range(1, steps + 1):
            rollout = await rollouts.collect(step, progress=functools.partial(progress.rollout, step))
            dump = dump_samples(run_dir, step, rollout.all_samples, tokens=config.run.dump_tokens,
                                trained=rollout.groups)
            summaries.append(step_summary(step, rollout, dump))
            m = rollout.metrics
            progress.message(f"step {step}/{steps} | {len(rollout.all_samples)} samples | reward "
                             f"{m.get('rollout/reward_mean', math.nan):.3f} | {dump}")
        return summaries
    finally:
        executor.shutdown()
