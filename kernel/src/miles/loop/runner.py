"""`run_training`: the RL loop of ARCHITECTURE §1 on the configured executor.

    prompts -> generator -> reward -> filters -> advantages -> train step -> weight sync -> next

``sync`` mode generates step k, then trains on it. ``one_step_off`` generates step k+1 while
training on step k (the next rollout uses weights one step old; samples record the version).
``fully_async`` generates all the time into a bounded buffer the trainer takes batches from
(:mod:`miles.loop.fully_async`).

The trainer runs in its own rank processes behind one handle (:class:`~miles.trainer.group.TrainerGroup`);
the driver keeps data, rollout, rewards and advantages (docs/design/process-model.md).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from miles_contracts import Sample, Status

from miles.config import MilesConfig
from miles.data.source import eval_prompts, open_data_source
from miles.engine_client import HttpEngineClient
from miles.errors import ConfigError, MilesError
from miles.kernel import Kernel
from miles.loop.fully_async import run_fully_async
from miles.loop.interrupts import stop_requested
from miles.loop.learner import Learner
from miles.loop.progress import Progress
from miles.loop.rollout import RolloutManager, StepRollout
from miles.loop.run_dir import (
    checkpoint_dir,
    dump_samples,
    latest_checkpoint,
    prune_checkpoints,
    read_state,
    write_state,
)
from miles.loop.services import Services, start_services
from miles.placement import Placement, gpus_needed, plan_placement
from miles.tracking import open_trackers
from miles.trainer.errors import TrainerCallError, TrainerRankError
from miles.trainer.group import TrainerGroup


def load_tokenizer(model_path: Path) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # the kernel alone has no model stack
        raise ImportError("miles train needs transformers: pip install miles-engine miles-fsdp") from exc
    return AutoTokenizer.from_pretrained(model_path)


class Run:
    """State of one training run; :meth:`main` drives it."""

    def __init__(self, config: MilesConfig, run_dir: Path, resume: bool) -> None:
        self.config = config
        self.run_dir = run_dir
        self.resume = resume
        self.kernel = Kernel.load(config.plugin_selection)
        self.progress = Progress(config.run.steps)
        self.step = 0
        self.version = 0
        self.executor: Any = None
        self.services: Services | None = None
        self.trainer: TrainerGroup | None = None
        self.metrics_logger: Any = None
        self._fatal: BaseException | None = None
        self._unsynced = False  # one_step_off: the trainer's last update waits to be pushed
        self._main: tuple[Any, Any] = (None, None)  # the event loop and task to stop from another thread

    # ------------------------------------------------------------------ lifecycle

    async def main(self) -> str:
        status = "failed"
        self._main = (asyncio.get_running_loop(), asyncio.current_task())
        try:
            await self._start()
            await self._loop()
            if stop_requested():  # a cancellation was swallowed on the way: still an interruption
                raise asyncio.CancelledError
            status = "completed"
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

    async def _start(self) -> None:
        cfg, kernel = self.config, self.kernel
        kernel.configure(cfg)
        random.seed(cfg.run.seed)
        model_path = kernel.resolve_model(cfg.model.name)
        self.progress.message(f"model {cfg.model.name} -> {model_path}")
        tokenizer = load_tokenizer(model_path)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.resume:
            self._supersede_metrics()
        self.metrics_logger = open_trackers(cfg, self.run_dir, kernel)
        data = open_data_source(cfg.data, kernel)
        self.executor = kernel.executors().get(cfg.executor.name)(cfg, self.run_dir)
        placement = place(cfg, self.executor, kernel)
        self.progress.message(f"placement: {placement.describe()}")
        self.progress.message(f"starting {len(placement.trainer)} {cfg.train.backend} trainer rank(s), "
                              f"{len(placement.engines)} {cfg.rollout.engine} engine(s) and the router")
        self.trainer = TrainerGroup.launch(cfg, self.executor, placement, self.run_dir)
        self.services = start_services(cfg, kernel, model_path, self.executor, placement, self.run_dir)
        self.trainer.wait_ready()
        self.services.write_manifest()
        self.executor.supervise(self._on_death)
        self.engine = HttpEngineClient(self.services.router_url)
        self.rollout = RolloutManager(cfg, kernel, data, self.engine, tokenizer, self.services.session_url)
        self.learner = Learner(cfg, kernel, self.trainer, pad)
        self.eval_prompts = self._eval_prompts(data)
        if self.resume:
            self._restore()
        if self.resume or cfg.weights.check:
            self._sync_weights(bump=False)  # engines start from the base model; bring them to ours
        if not cfg.run.save_every and not cfg.run.save_final:
            kept = "only <run>/hf will hold the trained model" if cfg.run.export_hf else "the trained model is not kept"
            self.progress.message(f"no checkpoints will be written (run.save_every=0, run.save_final=false): the run "
                                  f"cannot be resumed and {kept}")
        kernel.run_start(cfg, self.run_dir)

    def _stop(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        if self.executor is not None:
            self.executor.shutdown()
        if self.metrics_logger is not None:
            self.metrics_logger.close()

    # ------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        await self._steps()
        if self.config.run.export_hf:
            self.trainer.export_hf(self.run_dir / "hf")
            self.progress.message(f"exported the trained model to {self.run_dir / 'hf'}")

    async def _steps(self) -> None:
        cfg = self.config
        if cfg.run.mode == "fully_async":
            await run_fully_async(self)
            return
        overlap = cfg.run.mode == "one_step_off"
        pending: asyncio.Task[StepRollout] | None = None
        while self.step < cfg.run.steps and not stop_requested():
            self.step += 1
            step = self.step
            rollout = await self._rollout(step, pending)
            pending = None
            metrics = dict(rollout.metrics)
            if self._unsynced:  # one_step_off: the previous update waited for this rollout to finish
                metrics.update(self._sync_weights())
                self._unsynced = False
            saved_state = None
            if overlap and step < cfg.run.steps:
                if self._checkpoint_due(step):  # before the next rollout draws its prompts: a resume draws them again
                    saved_state = self._checkpoint_state()
                # the trainer will be training meanwhile: this rollout cannot push weights to a restarted engine
                pending = asyncio.create_task(self._collect(step + 1, resync=False))
            dump_samples(self.run_dir, step, rollout.all_samples, tokens=cfg.run.dump_tokens)
            metrics.update(await self._train(rollout))
            if overlap and pending is not None:
                self._unsynced = True
            else:
                metrics.update(self._sync_weights())
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.run.steps):
                if pending is not None:  # let the next rollout finish: evaluation shares the engines
                    await asyncio.wait([pending])
                metrics.update(await self._evaluate(step))
            if self._checkpoint_due(step):
                metrics["time/checkpoint"] = await self._save(saved_state)
            self._log(step, metrics)

    async def _collect(self, step: int, *, probe: bool = False, resync: bool = True) -> StepRollout:
        """One rollout of step ``step``, once the engines (and the router) serve.

        An engine the supervisor restarted has the base model's weights, and the router holds it
        back until a weight sync brings it to the fleet's version: with one engine nothing would
        serve until the step's end. With ``resync`` (the trainer is idle, its weights are
        ``self.version``'s) such an engine gets the current weights first. Without it (a
        one_step_off rollout running beside training) the router is not waited for: the rollout's
        requests are refused, and :meth:`_rollout` syncs and collects the step again."""
        assert self.services is not None
        timeout = self.config.executor.startup_timeout
        await asyncio.to_thread(self.services.wait_ready, timeout, probe=probe)
        resynced = self._resync_restarted_engines() if resync else {}
        if not self.services.stale_engines:
            await asyncio.to_thread(self.services.wait_ready, timeout, router=True)
        rollout = await self.rollout.collect(step, progress=lambda d, t: self.progress.rollout(step, d, t))
        rollout.metrics.update(resynced)
        return rollout

    def _resync_restarted_engines(self) -> dict[str, float]:
        """Push the current weights (version ``self.version``, which the trainer must hold: call it
        while the trainer is idle) if an engine restarted since the last push; its metrics."""
        assert self.services is not None
        if not self.services.stale_engines:
            return {}
        done = self._sync_weights(bump=False)
        self.progress.message(f"gave {done['weights/engines_restarted']:.0f} restarted engine(s) the weights of "
                              f"version {self.version}")
        return {"weights/resynced_engines": done["weights/engines_restarted"], "time/resync": done["time/sync"]}

    async def _rollout(self, step: int, pending: asyncio.Task[StepRollout] | None) -> StepRollout:
        """Step ``step``'s rollout (``pending``: the one already under way). A rollout in which every
        sample was aborted (an engine or its node died under it) is collected again, once, after
        every engine answers its health check again (the supervisor restarts the dead one) and has
        the trainer's weights (a one_step_off sync that waited for this rollout happens first);
        what the aborted attempt generated stays in the step's dump. See :func:`failed_step_error`."""
        rollout = await (pending if pending is not None else self._collect(step))
        self._raise_if_nothing_to_train(step, rollout, retried=False)
        if not all_aborted(rollout):
            return rollout
        self.progress.message(f"step {step}: all {len(rollout.all_samples)} samples were aborted (an engine died?); "
                              f"collecting the step again once every engine is healthy")
        start = time.perf_counter()
        synced: dict[str, float] = {}
        if self._unsynced:  # the trainer is idle now: the deferred update, before generating again
            synced = self._sync_weights()
            self._unsynced = False
        again = await self._collect(step, probe=True)
        self._raise_if_nothing_to_train(step, again, retried=True, earlier=rollout.all_samples)
        metrics = {**synced, **again.metrics, "rollout/recollected": 1.0,
                   "time/rollout": rollout.metrics.get("time/rollout", 0.0) + time.perf_counter() - start}
        return StepRollout(again.groups, rollout.all_samples + again.all_samples, metrics)

    def _raise_if_nothing_to_train(self, step: int, rollout: StepRollout, *, retried: bool,
                                   earlier: list[Sample] | None = None) -> None:
        error = failed_step_error(step, rollout, retried=retried)
        if error is not None:  # the samples still go to the step's dump, for the post-mortem
            dump_samples(self.run_dir, step, (earlier or []) + rollout.all_samples, tokens=self.config.run.dump_tokens)
            raise error

    async def _train(self, rollout: StepRollout) -> dict[str, float]:
        samples = rollout.train_samples
        if not samples:
            self.progress.message(f"step {self.step}: no trainable samples (all groups filtered); skipping the update")
            return {"train/skipped": 1.0}
        start = time.perf_counter()
        if self.config.run.mode != "sync":  # keep the event loop generating meanwhile
            metrics = await asyncio.to_thread(self.learner.train, samples)
        else:
            metrics = self.learner.train(samples)
        metrics["time/train"] = time.perf_counter() - start
        return metrics

    def _sync_weights(self, *, bump: bool = True) -> dict[str, float]:
        """Push the trainer's weights to every engine as the next version (or the current one)."""
        assert self.services is not None
        if bump:
            self.version += 1
        start = time.perf_counter()
        targets = list(self.services.engine_urls.values())
        waited = self.services.wait_ready(self.config.executor.startup_timeout)
        try:
            report = self.trainer.push_weights(targets, self.version)
        except TrainerCallError as exc:
            # an engine may have died during the push: once the supervisor has it back, push again
            self.progress.message(f"weight sync of version {self.version} failed ({exc}); retrying once engines are healthy")
            waited += self.services.wait_ready(self.config.executor.startup_timeout, probe=True)
            targets = list(self.services.engine_urls.values())  # a restarted engine may have moved
            report = self.trainer.push_weights(targets, self.version)
        restarted = self.services.take_stale()
        self.kernel.weights_synced(self.version)
        return {
            "time/sync": time.perf_counter() - start,
            "perf/sync_gb_per_s": report.gbps,
            "weights/version": float(self.version),
            "weights/engines_restarted": float(len(restarted)),
            "time/wait_engines": waited,
        }

    async def _evaluate(self, step: int) -> dict[str, float]:
        if not self.eval_prompts:
            return {}
        start = time.perf_counter()
        samples, metrics = await self.rollout.evaluate(self.eval_prompts)
        dump_samples(self.run_dir, step, samples, kind="eval")
        metrics["time/eval"] = time.perf_counter() - start
        return metrics

    def _eval_prompts(self, data: Any) -> list[Any]:
        if not self.config.eval.every:
            return []
        return eval_prompts(self.config.data, self.kernel, limit=self.config.eval.num_prompts, source=data)

    # ------------------------------------------------------------------ checkpoints and metrics

    def _checkpoint_due(self, step: int) -> bool:
        """A periodic checkpoint (``run.save_every``), or the final one (``run.save_final``)."""
        run = self.config.run
        return bool(run.save_every and step % run.save_every == 0) or (step == run.steps and run.save_final)

    async def _save(self, state: dict[str, Any] | None = None) -> float:
        """Checkpoint step ``self.step``: the driver's state (``state``, else taken now, on the event
        loop where prompts are drawn), the trainer's save off the loop (a one_step_off or
        fully_async rollout goes on meanwhile)."""
        state = state if state is not None else self._checkpoint_state()
        return await asyncio.to_thread(self._write_checkpoint, state)

    def _checkpoint_state(self) -> dict[str, Any]:
        """The driver's part of a checkpoint, taken on the event loop (where data is drawn)."""
        return {"data": self.rollout.data.state_dict(), "rollout": self.rollout.state_dict(),
                "python_random": _jsonable_random_state()}

    def _write_checkpoint(self, extra: dict[str, Any]) -> float:
        """Save the trainer with ``extra`` as checkpoint ``self.step``; may run off the event loop."""
        start = time.perf_counter()
        path = checkpoint_dir(self.run_dir, self.step)
        path.mkdir(parents=True, exist_ok=True)
        self.trainer.save_checkpoint(path, extra)
        write_state(path, {"step": self.step, "weight_version": self.version, "saved_at": time.time()})
        _, failed = prune_checkpoints(self.run_dir, self.config.run.keep_checkpoints)
        if failed:
            self.progress.message(f"could not delete old checkpoint(s) {', '.join(map(str, failed))}: "
                                  f"run.keep_checkpoints is not holding disk use down; delete them by hand")
        return time.perf_counter() - start

    def _supersede_metrics(self) -> None:
        """Steps logged after the last checkpoint run again: their old records leave metrics.jsonl."""
        from miles.tracking.jsonl import SUPERSEDED_FILE, supersede_after

        path = latest_checkpoint(self.run_dir)
        moved = supersede_after(self.run_dir, int(read_state(path)["step"]) if path is not None else 0)
        if moved:
            self.progress.message(f"moved {moved} metrics record(s) of steps that run again to {SUPERSEDED_FILE}")

    def _restore(self) -> None:
        path = latest_checkpoint(self.run_dir)
        if path is None:
            self.progress.message(f"no complete checkpoint in {self.run_dir}; starting from step 0")
            self.resume = False
            return
        state = read_state(path)
        extra = self.trainer.load_checkpoint(path)
        self.rollout.data.load_state_dict(extra["data"])
        self.rollout.load_state_dict(extra["rollout"])
        random.setstate(_random_state_from_json(extra["python_random"]))
        self.step, self.version = int(state["step"]), int(state["weight_version"])
        self.progress.message(f"resumed from {path} (step {self.step}, weight version {self.version})")

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

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}
        self.kernel.step_end(step, metrics)
        self.metrics_logger.log(metrics, step)
        self.progress.step(step, metrics)


def place(config: MilesConfig, executor: Any, kernel: Kernel) -> Placement:
    """Plan against the executor's capacity (layout errors name what fits), reserve the GPUs the
    layout needs, and place every process on what was reserved."""
    nodes = executor.nodes()
    if config.model.device == "cpu":  # GPUs the run must not use
        nodes = [type(n)(n.name, n.address) for n in nodes]
    plan = plan_placement(config.resources, nodes)
    transport = kernel.weight_transports().get(config.weights.transport)
    if plan.uses_gpus and not plan.colocated and getattr(transport, "needs_shared_gpu", False):
        raise ConfigError([f"weights.transport {config.weights.transport!r} hands CUDA memory to engines on the "
                           f"trainer's own GPU, but resources.colocate is false (engines have GPUs of their own); "
                           f"use weights.transport=broadcast, or resources.colocate=true"])
    backend = kernel.train_backends().get(config.train.backend)
    if getattr(backend, "weights_on_rank0", False) and any(plan.pushers):
        raise ConfigError([f"train.backend {config.train.backend!r} yields the full weights on trainer rank 0 only, but "
                           f"this layout has other ranks feed the engines on their GPUs (colocated); use "
                           f"resources.colocate=false with weights.transport=broadcast"])
    if not plan.uses_gpus:
        return plan_placement(config.resources, executor.reserve(0))
    return plan_placement(config.resources, executor.reserve(gpus_needed(config.resources)))


def all_aborted(rollout: StepRollout) -> bool:
    """Every sample of the rollout was aborted (engines died or restarted under it)."""
    return bool(rollout.all_samples) and all(s.status is Status.ABORTED for s in rollout.all_samples)


def failed_step_error(step: int, rollout: StepRollout, *, retried: bool) -> MilesError | None:
    """The error that ends the run when a step has nothing to learn from because every sample was
    aborted or failed, or None to go on.

    One sample that FAILED (the engine refused the request: a setting it cannot serve) makes the
    failure deterministic: stop at once. All ABORTED (engines died or restarted) may be transient:
    the step is collected again once engines are healthy (``retried`` is then true), and a second
    attempt that is aborted too stops the run. The run never reports success over a step that
    trained on nothing because its engines were gone.
    """
    samples = rollout.all_samples
    if not samples or any(s.status not in (Status.ABORTED, Status.FAILED) for s in samples):
        return None
    if not retried and all_aborted(rollout):
        return None
    reasons = Counter(f"{s.status.value}: {s.exit_detail or s.exit_reason}"[:300] for s in samples)
    listed = "; ".join(f"{count}x {reason}" for reason, count in reasons.most_common(3))
    again = " in a second attempt after the engines were healthy again" if retried else ""
    return MilesError(f"step {step}: all {len(samples)} samples were aborted or failed{again}, so there is nothing "
                      f"to train on ({listed}); every sample is in the run folder's samples/")


def _jsonable_random_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _random_state_from_json(state: list[Any]) -> tuple[Any, ...]:
    return (state[0], tuple(state[1]), state[2])


def run_training(config: MilesConfig, run_dir: Path, *, resume: bool = False) -> str:
    """Run (or resume) training in ``run_dir``; returns ``completed`` (or raises)."""
    return asyncio.run(Run(config, run_dir, resume).main())


__all__ = ["Run", "run_training"]
