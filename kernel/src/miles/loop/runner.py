"""`run_training`: the RL loop of ARCHITECTURE §1 on the configured executor.

    prompts -> generator -> reward -> filters -> advantages -> train step -> weight sync -> next

:class:`Run` owns the life cycle of a run in the driver: it starts the executor, the trainer
ranks (:class:`~miles.trainer.group.TrainerGroup`) and the services, restores a checkpoint,
watches for dead processes, and stops everything at the end. The steps themselves are the loop
mode's (:mod:`miles.loop.modes`: ``sync``, ``one_step_off``, ``fully_async``), which drives the
public step operations of :class:`~miles.loop.steps.StepOps`. The driver keeps data, rollout,
rewards and advantages; the trainer runs in its own rank processes (docs/design/process-model.md).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sized
from pathlib import Path
from typing import Any

from miles_contracts import Executor, Process, RunContext

from miles.config import MilesConfig
from miles.data.source import eval_prompts, open_data_source
from miles.engine_client import HttpEngineClient
from miles.errors import ConfigError
from miles.kernel import Kernel
from miles.loop.engine_memory import EngineMemory
from miles.loop.interrupts import stop_requested
from miles.loop.learner import Learner
from miles.loop.ledger import Ledger
from miles.loop.modes import loop_mode
from miles.loop.progress import Progress
from miles.loop.rollout import RolloutManager
from miles.loop.run_dir import latest_checkpoint, read_state
from miles.loop.services import Services, start_services
from miles.loop.steps import RunState, StepOps, random_state_from_json
from miles.placement import Placement, gpus_needed, plan_placement
from miles.tracking import MetricsLogger, open_trackers
from miles.trainer.errors import TrainerRankError
from miles.trainer.group import TrainerGroup


def load_tokenizer(model_path: Path) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # the kernel alone has no model stack
        raise ImportError("miles train needs a train backend: pip install miles-fsdp (or miles-megatron)") from exc
    return AutoTokenizer.from_pretrained(model_path)


class Run:
    """One training run in the driver; :meth:`main` drives it."""

    def __init__(self, config: MilesConfig, run_dir: Path, resume: bool) -> None:
        self.config = config
        self.run_dir = run_dir
        self.resume = resume
        self.kernel = Kernel.load(config.plugin_selection)
        self.ctx = RunContext(config, self.kernel, Process.driver(), run_dir)
        self.mode = loop_mode(config)
        self.progress = Progress(config.run.steps)
        self.state = RunState()
        self.executor: Executor | None = None
        self.services: Services | None = None
        self.trainer: TrainerGroup | None = None
        self.metrics_logger: MetricsLogger | None = None
        self.ops: StepOps | None = None
        self.ledger: Ledger | None = None
        self._fatal: BaseException | None = None
        self._main: tuple[Any, Any] = (None, None)  # the event loop and task to stop from another thread

    # ------------------------------------------------------------------ lifecycle

    async def main(self) -> str:
        status = "failed"
        self._main = (asyncio.get_running_loop(), asyncio.current_task())
        try:
            ops = await self._start()
            await self.mode.run(ops)
            if stop_requested():  # a cancellation was swallowed on the way: still an interruption
                raise asyncio.CancelledError
            if ops.rollouts.ledger is not None:
                ops.rollouts.ledger.complete()  # raises if a prompt was left neither trained nor dropped
            self._export()
            status = "completed"
            trend = self.progress.reward_trend()
            if trend is not None:
                self.progress.message(trend)
        except TrainerRankError as exc:
            raise TrainerRankError(f"{exc}\n{self._resume_hint()}", exc.rank) from None
        except (KeyboardInterrupt, asyncio.CancelledError):
            if isinstance(self._fatal, TrainerRankError):  # a rank died while the driver was elsewhere
                raise TrainerRankError(f"{self._fatal}\n{self._resume_hint()}", self._fatal.rank) from None
            status = "interrupted"
            raise
        finally:
            self._stop()
            self.kernel.run_end(self.run_dir, status)
            self.progress.message(f"run {status}: {self.run_dir}")
        return status

    async def _start(self) -> StepOps:
        cfg, kernel, ctx = self.config, self.kernel, self.ctx
        kernel.configure(ctx)
        random.seed(cfg.run.seed)
        model_path = kernel.resolve_model(cfg.model.name)
        self.progress.message(f"model {cfg.model.name} -> {model_path}")
        tokenizer = load_tokenizer(model_path)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.resume:
            self._supersede_metrics()
        self.metrics_logger = open_trackers(ctx)
        data = open_data_source(ctx)
        self.executor = executor = kernel.executors().get(cfg.executor.name).create(ctx)
        placement = place(cfg, executor, kernel)
        self.progress.message(f"placement: {placement.describe()}")
        self.progress.message(f"starting {len(placement.trainer)} {cfg.train.backend} trainer rank(s), "
                              f"{len(placement.engines)} {cfg.rollout.engine} engine(s) and the router")
        self.trainer = trainer = TrainerGroup.launch(cfg, executor, placement, self.run_dir)
        self.services = services = start_services(cfg, kernel, model_path, executor, placement, self.run_dir)
        trainer.wait_ready()
        services.write_manifest()
        executor.supervise(self._on_death)
        self.ledger = ledger = Ledger(self.run_dir, len(data) if isinstance(data, Sized) else None)
        rollouts = RolloutManager(ctx, data, HttpEngineClient(services.router_url), tokenizer, services.session_url,
                                  partial_rollout=self.mode.partial_rollout(cfg), ledger=ledger,
                                  service_urls=services.urls_by_role())
        held_out = eval_prompts(ctx, cfg.eval.num_prompts, source=data) if cfg.eval.every else []
        self.ops = ops = StepOps(config=cfg, kernel=kernel, run_dir=self.run_dir, state=self.state,
                                 progress=self.progress, rollouts=rollouts, learner=Learner(cfg, kernel, trainer, pad),
                                 trainer=trainer, services=services, metrics=self.metrics_logger,
                                 eval_prompts=held_out,
                                 engine_memory=EngineMemory(cfg.resources.release_engine_memory, services))
        checkpoint = self._restore(ops) if self.resume else None
        # lines after the checkpoint are the crashed attempt's; what was in flight then is drawn again
        rollouts.redraw(ledger.begin(checkpoint, self.state.step))
        if self.resume or cfg.weights.check:
            ops.sync_weights(bump=False)  # engines start from the base model; bring them to ours
        if not cfg.run.save_every and not cfg.run.save_final:
            kept = "only <run>/hf will hold the trained model" if cfg.run.export_hf else "the trained model is not kept"
            self.progress.message(f"no checkpoints will be written (run.save_every=0, run.save_final=false): the run "
                                  f"cannot be resumed and {kept}")
        kernel.run_start(cfg, self.run_dir)
        return ops

    def _stop(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
        if self.trainer is not None:
            self.trainer.close()
        if self.executor is not None:
            self.executor.shutdown()
        if self.metrics_logger is not None:
            self.metrics_logger.close()

    def _export(self) -> None:
        if self.config.run.export_hf and self.trainer is not None:
            self.trainer.export_hf(self.run_dir / "hf")
            self.progress.message(f"exported the trained model to {self.run_dir / 'hf'}")

    # ------------------------------------------------------------------ restore

    def _supersede_metrics(self) -> None:
        """Steps logged after the last checkpoint run again: their old records leave metrics.jsonl."""
        from miles.tracking.jsonl import SUPERSEDED_FILE, supersede_after

        path = latest_checkpoint(self.run_dir)
        moved = supersede_after(self.run_dir, int(read_state(path)["step"]) if path is not None else 0)
        if moved:
            self.progress.message(f"moved {moved} metrics record(s) of steps that run again to {SUPERSEDED_FILE}")

    def _restore(self, ops: StepOps) -> dict[str, Any] | None:
        """Load the last checkpoint; its sample ledger part (None when there is no checkpoint)."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            self.progress.message(f"no complete checkpoint in {self.run_dir}; starting from step 0")
            self.resume = False
            return None
        assert self.trainer is not None
        state = read_state(path)
        extra = self.trainer.load_checkpoint(path)
        ops.rollouts.data.load_state_dict(extra["data"])
        ops.rollouts.load_state_dict(extra["rollout"])
        random.setstate(random_state_from_json(extra["python_random"]))
        self.state.step, self.state.version = int(state["step"]), int(state["weight_version"])
        self.progress.message(f"resumed from {path} (step {self.state.step}, weight version {self.state.version})")
        ledger: dict[str, Any] = extra.get("ledger", {"seq": 0, "unsettled": [], "untracked": True})  # older checkpoints
        return ledger

    # ------------------------------------------------------------------ faults

    def _on_death(self, name: str) -> None:
        """A supervised process died (called from the executor's watcher thread)."""
        if self.trainer is not None and self.trainer.owns(name):
            error = self.trainer.rank_died(name)
            if error is not None:  # every other rank is stuck in a collective: stop the run at once
                loop, task = self._main
                loop.call_soon_threadsafe(self._abort, error, task)
            return
        if self.services is not None and self.config.executor.restart_engines:
            self.services.handle_death(name)

    def _abort(self, error: BaseException, task: asyncio.Task[Any] | None) -> None:
        self._fatal = error
        if task is not None:
            task.cancel()

    def _resume_hint(self) -> str:
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return (f"no checkpoint was saved yet (run.save_every={self.config.run.save_every}): start the run again "
                    f"(set run.save_every to checkpoint more often)")
        step = read_state(path)["step"]
        return f"the last checkpoint is {path} (step {step}): continue with `miles train --resume {self.run_dir}`"


def place(config: MilesConfig, executor: Executor, kernel: Kernel) -> Placement:
    """Plan against the executor's capacity (layout errors name what fits), reserve the GPUs the
    layout needs, and place every process on what was reserved."""
    nodes = executor.nodes()
    if config.model.device == "cpu":  # GPUs the run must not use
        nodes = [type(n)(n.name, n.address) for n in nodes]
    plan = plan_placement(config.resources, nodes)
    transport = kernel.weight_transports().get(config.weights.transport)
    if plan.uses_gpus and not plan.colocated and transport.needs_shared_gpu:
        raise ConfigError([f"weights.transport {config.weights.transport!r} hands CUDA memory to engines on the "
                           f"trainer's own GPU, but resources.colocate is false (engines have GPUs of their own); "
                           f"use weights.transport=broadcast, or resources.colocate=true"])
    backend = kernel.train_backends().get(config.train.backend)
    if backend.weights_on_rank0 and any(plan.pushers):
        raise ConfigError([f"train.backend {config.train.backend!r} yields the full weights on trainer rank 0 only, but "
                           f"this layout has other ranks feed the engines on their GPUs (colocated); use "
                           f"resources.colocate=false with weights.transport=broadcast"])
    if not plan.uses_gpus:
        return plan_placement(config.resources, executor.reserve(0))
    return plan_placement(config.resources, executor.reserve(gpus_needed(config.resources)))


def run_training(config: MilesConfig, run_dir: Path, *, resume: bool = False) -> str:
    """Run (or resume) training in ``run_dir``; returns ``completed`` (or raises)."""
    return asyncio.run(Run(config, run_dir, resume).main())


__all__ = ["Run", "run_training"]
