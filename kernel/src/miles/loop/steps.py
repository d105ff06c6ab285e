"""`StepOps`: the operations an RL step is made of, the one surface every loop mode drives.

A loop mode (:mod:`miles.loop.modes`) decides *when* each operation happens -- rollout before
training (``sync``), the next rollout beside training (``one_step_off``), rollout all the time
(``fully_async``) -- and :class:`StepOps` does them::

    rollout = await ops.rollout_step(step)      # collect a step's groups (again if all aborted)
    metrics |= await ops.release_engine_memory()   # resources.release_engine_memory (sync mode)
    metrics |= await ops.train(rollout)         # log-prob passes, advantages, optimiser step
    metrics |= ops.sync_weights()               # push to every engine as the next version
                                                # (resume_and_sync_weights: after a release)
    metrics |= await ops.evaluate(step)         # when ops.evaluation_due(step)
    metrics["time/checkpoint"] = await ops.save()   # when ops.checkpoint_due(step)
    metrics |= await ops.router_metrics()       # the router's prefix-cache counters, per step
    ops.log(step, metrics)

The :class:`~miles.loop.runner.Run` builds it once everything is started, keeps the life cycle
(start, stop, restore, faults) and hands it to the mode. Everything here runs in the driver.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_contracts import Sample, Status
from miles_contracts.cluster import ROUTER

from miles.config import MilesConfig
from miles.errors import MilesError
from miles.kernel import Kernel
from miles.loop.engine_memory import WEIGHTS, EngineMemory
from miles.loop.learner import Learner
from miles.loop.progress import Progress
from miles.loop.rollout import RolloutManager, StepRollout
from miles.loop.router_metrics import RouterCounters
from miles.loop.run_dir import checkpoint_dir, dump_samples, prune_checkpoints, write_state
from miles.loop.services import Services
from miles.tracking import MetricsLogger
from miles.trainer.errors import TrainerCallError
from miles.trainer.group import TrainerGroup


@dataclass(slots=True)
class RunState:
    """Where the run is: the last step started and the weight version the engines serve."""

    step: int = 0
    version: int = 0


class StepOps:
    """The step operations of one run (see the module docstring). Built by the run; modes use
    only its public methods and read ``config``, ``state``, ``progress`` and ``rollouts``."""

    def __init__(self, *, config: MilesConfig, kernel: Kernel, run_dir: Path, state: RunState, progress: Progress,
                 rollouts: RolloutManager, learner: Learner, trainer: TrainerGroup, services: Services,
                 metrics: MetricsLogger, eval_prompts: list[Sample], engine_memory: EngineMemory) -> None:
        self.config = config
        self.kernel = kernel
        self.run_dir = run_dir
        self.state = state
        self.progress = progress
        self.rollouts = rollouts
        self._learner = learner
        self._trainer = trainer
        self._services = services
        self._metrics = metrics
        self._eval_prompts = eval_prompts
        self._engine_memory = engine_memory
        self._rollout_ended: float | None = None  # perf_counter() when the last rollout's generation ended
        self._router_counters = RouterCounters()
        # the prompt groups the mode holds between steps (fully_async's workers and buffer); a sync
        # or one_step_off checkpoint is taken when only a resume's redraws are pending
        self.held_groups: Callable[[], set[int]] = lambda: self.rollouts.redraw_groups()

    # ------------------------------------------------------------------ steps

    def next_step(self) -> int:
        """Start the next step; its number (1-based)."""
        self.state.step += 1
        return self.state.step

    @property
    def finished(self) -> bool:
        """Every configured step has started."""
        return self.state.step >= self.config.run.steps

    # ------------------------------------------------------------------ rollout

    async def wait_engines(self, *, router: bool = False, probe: bool = False) -> float:
        """Until every engine (and with ``router`` the router) serves; the seconds waited."""
        timeout = self.config.executor.startup_timeout
        return await asyncio.to_thread(self._services.wait_ready, timeout, router=router, probe=probe)

    async def collect(self, step: int, *, probe: bool = False, resync: bool = True) -> StepRollout:
        """One rollout of step ``step``, once the engines (and the router) serve.

        An engine the supervisor restarted has the base model's weights, and the router holds it
        back until a weight sync brings it to the fleet's version: with one engine nothing would
        serve until the step's end. With ``resync`` (the trainer is idle, its weights are
        ``state.version``'s) such an engine gets the current weights first. Without it (a
        one_step_off rollout running beside training) the router is not waited for: the rollout's
        requests are refused, and :meth:`rollout_step` syncs and collects the step again."""
        await self.wait_engines(probe=probe)
        resynced = self.resync_restarted_engines() if resync else {}
        if not self._services.stale_engines:
            await self.wait_engines(router=True)
        started = time.perf_counter()
        rollout = await self.rollouts.collect(step, progress=lambda p: self.progress.rollout(step, p),
                                              recover=self._services_back if resync else None)
        if self._rollout_ended is not None:  # what the engines did not generate for since the last rollout
            rollout.metrics["time/engines_idle"] = max(0.0, started - self._rollout_ended)
        self._rollout_ended = time.perf_counter()
        rollout.metrics.update(resynced)
        return rollout

    async def _services_back(self) -> None:
        """Until every engine and the router serve again and a restarted engine has the trainer's
        weights (the trainer is idle: only a rollout collected with ``resync`` calls it): what a
        group redone in place needs to come out as it would have without the fault."""
        await self.wait_engines(probe=True)
        self.resync_restarted_engines()
        await self.wait_engines(router=True, probe=True)

    async def rollout_step(self, step: int, pending: Awaitable[StepRollout] | None = None, *,
                           before_retry: Callable[[], dict[str, float]] | None = None) -> StepRollout:
        """Step ``step``'s rollout (``pending``: the one already under way). A rollout in which every
        sample was aborted (an engine or its node died under it) is collected again, once, after
        every engine answers its health check again (the supervisor restarts the dead one) and has
        the trainer's weights (``before_retry`` first: a deferred one_step_off weight sync); what
        the aborted attempt generated stays in the step's dump. See :func:`failed_step_error`."""
        rollout = await (pending if pending is not None else self.collect(step))
        self._raise_if_nothing_to_train(step, rollout, retried=False)
        if not all_aborted(rollout):
            return rollout
        self.progress.message(f"step {step}: all {len(rollout.all_samples)} samples were aborted (an engine died?); "
                              f"collecting the step again once every engine is healthy")
        start = time.perf_counter()
        synced = before_retry() if before_retry is not None else {}
        again = await self.collect(step, probe=True)
        self._raise_if_nothing_to_train(step, again, retried=True, earlier=rollout.all_samples)
        metrics = {**synced, **again.metrics, "rollout/recollected": 1.0,
                   "time/rollout": rollout.metrics.get("time/rollout", 0.0) + time.perf_counter() - start}
        return StepRollout(again.groups, rollout.all_samples + again.all_samples, metrics)

    def _raise_if_nothing_to_train(self, step: int, rollout: StepRollout, *, retried: bool,
                                   earlier: list[Sample] | None = None) -> None:
        error = failed_step_error(step, rollout, retried=retried)
        if error is not None:  # the samples still go to the step's dump, for the post-mortem
            self.dump(step, (earlier or []) + rollout.all_samples)
            raise error

    def record_batch(self, step: int, groups: Sequence[Sequence[Sample]]) -> None:
        """The sample ledger: step ``step`` trains ``groups`` (a group without a trainable row is
        dropped, ``untrainable``); then every data epoch that closed is checked (lost or duplicated
        prompts stop the run with :class:`~miles.loop.ledger.LedgerError`)."""
        ledger = self.rollouts.ledger
        if ledger is None:
            return
        for summary in ledger.record_batch(step, groups):
            self.progress.message(f"epoch {summary.epoch} closed: {summary.trained} prompt(s) trained, filtered "
                                  f"{dict(summary.filtered) or 0}, dropped {dict(summary.dropped) or 0}; "
                                  f"0 lost, 0 duplicated")

    def dump(self, step: int, samples: list[Sample], kind: str = "samples", *,
             trained: Sequence[Sequence[Sample]] = ()) -> float:
        """Write ``samples`` to the run folder (``<run>/<kind>/step_<n>.jsonl``), marking those of the
        ``trained`` groups (the step's batch, for ``miles replay``); the seconds it took."""
        start = time.perf_counter()
        dump_samples(self.run_dir, step, samples, kind=kind, tokens=self.config.run.dump_tokens, trained=trained)
        return time.perf_counter() - start

    # ------------------------------------------------------------------ training and weights

    async def train(self, rollout: StepRollout, *, in_thread: bool) -> dict[str, float]:
        """Train on the rollout's trainable samples (``in_thread``: off the event loop, so that
        rollouts in flight go on meanwhile); skipped, and said so, when there are none."""
        samples = rollout.train_samples
        if not samples:
            self.progress.message(f"step {self.state.step}: no trainable samples (all groups filtered); skipping the update")
            return {"train/skipped": 1.0}
        start = time.perf_counter()
        metrics = await asyncio.to_thread(self._learner.train, samples) if in_thread else self._learner.train(samples)
        metrics["time/train"] = time.perf_counter() - start
        return metrics

    def sync_weights(self, *, bump: bool = True) -> dict[str, float]:
        """Push the trainer's weights to every engine as the next version (or the current one)."""
        services = self._services
        if bump:
            self.state.version += 1
        version = self.state.version
        start = time.perf_counter()
        targets = list(services.engine_urls.values())
        waited = services.wait_ready(self.config.executor.startup_timeout)
        try:
            report = self._trainer.push_weights(targets, version)
        except TrainerCallError as exc:
            # an engine may have died during the push: once the supervisor has it back, push again
            self.progress.message(f"weight sync of version {version} failed ({exc}); retrying once engines are healthy")
            waited += services.wait_ready(self.config.executor.startup_timeout, probe=True)
            targets = list(services.engine_urls.values())  # a restarted engine may have moved
            report = self._trainer.push_weights(targets, version)
        restarted = services.take_stale()
        self.kernel.weights_synced(version)
        metrics = {
            "time/sync": time.perf_counter() - start,
            "perf/sync_gb_per_s": report.gbps,
            "time/sync_transport": report.seconds,  # the transport's push; the rest: state gather, calls
            "time/sync_paused": report.paused_seconds,  # the part of it during which engines did not generate
            "weights/version": float(version),
            "weights/sync_bytes": float(report.num_bytes),  # adapters only under train.lora
            "weights/engines_restarted": float(len(restarted)),
            "time/wait_engines": waited,
        }
        if report.checked_engines:  # a check that fails raises WeightCheckError and stops the run
            self.progress.message(f"weights check passed: version {version} is bit-exact on "
                                  f"{len(report.checked_engines)} engine(s): {', '.join(report.checked_engines)}")
            metrics["weights/check_passed"] = 1.0
            metrics["weights/checked_engines"] = float(len(report.checked_engines))
        return metrics

    async def release_engine_memory(self) -> dict[str, float]:
        """After a rollout, with nothing in flight: the engines give back the memory that
        ``resources.release_engine_memory`` names, for the trainer to use until
        :meth:`resume_and_sync_weights` (``time/release``; nothing when the setting is ``none``).
        Only a mode in which rollout and training take turns may call it (``LoopMode.releases_engine_memory``)."""
        if not self._engine_memory.enabled:
            return {}
        return {"time/release": await self._engine_memory.release()}

    async def resume_and_sync_weights(self) -> dict[str, float]:
        """:meth:`sync_weights`, with what the engines released taken back around it: their weights
        before the push (a released engine refuses weight updates; SGLang without a host copy lost
        them, and the push restores them), the KV cache and CUDA graphs after it (the trainer's
        buckets are freed by then), so that evaluation and the next rollout find them whole.
        ``time/resume`` is both resumes together."""
        memory = self._engine_memory
        resumed = await memory.resume(WEIGHTS)
        metrics = self.sync_weights()
        resumed += await memory.resume()
        if memory.enabled:
            metrics["time/resume"] = resumed
        return metrics

    @property
    def stale_engines(self) -> bool:
        """An engine restarted since the last weight sync (it serves the base model's weights)."""
        return bool(self._services.stale_engines)

    def resync_restarted_engines(self) -> dict[str, float]:
        """Push the current weights (version ``state.version``, which the trainer must hold: call it
        while the trainer is idle) if an engine restarted since the last push; its metrics."""
        if not self._services.stale_engines:
            return {}
        done = self.sync_weights(bump=False)
        self.progress.message(f"gave {done['weights/engines_restarted']:.0f} restarted engine(s) the weights of "
                              f"version {self.state.version}")
        return {"weights/resynced_engines": done["weights/engines_restarted"], "time/resync": done["time/sync"]}

    # ------------------------------------------------------------------ evaluation

    def evaluation_due(self, step: int) -> bool:
        """``eval.every`` says step ``step`` evaluates (the last step always does when it is on)."""
        every = self.config.eval.every
        return bool(every) and (step % every == 0 or step == self.config.run.steps)

    async def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the engines' current weights on the held-out prompts; ``eval/`` metrics."""
        if not self._eval_prompts:
            return {}
        start = time.perf_counter()
        samples, metrics = await self.rollouts.evaluate(self._eval_prompts)
        self.dump(step, samples, kind="eval")
        metrics["time/eval"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------ checkpoints and metrics

    def checkpoint_due(self, step: int) -> bool:
        """A periodic checkpoint (``run.save_every``), or the final one (``run.save_final``)."""
        run = self.config.run
        return bool(run.save_every and step % run.save_every == 0) or (step == run.steps and run.save_final)

    def checkpoint_state(self) -> dict[str, Any]:
        """The driver's part of a checkpoint, taken on the event loop (where data is drawn)."""
        state = {"data": self.rollouts.data.state_dict(), "rollout": self.rollouts.state_dict(),
                 "python_random": jsonable_random_state()}
        if self.rollouts.ledger is not None:  # the prompts drawn past the data position: drawn again on resume
            state["ledger"] = self.rollouts.ledger.checkpoint_state(self.held_groups())
        return state

    async def save(self, state: dict[str, Any] | None = None) -> float:
        """Checkpoint step ``state.step``: the driver's state (``state``, else taken now, on the event
        loop where prompts are drawn), the trainer's save off the loop (a one_step_off or
        fully_async rollout goes on meanwhile). The seconds it took."""
        state = state if state is not None else self.checkpoint_state()
        seconds = await asyncio.to_thread(self._write_checkpoint, state)
        if self.rollouts.ledger is not None:  # back on the event loop, the checkpoint complete
            self.rollouts.ledger.compact(state["ledger"])
        return seconds

    def _write_checkpoint(self, extra: dict[str, Any]) -> float:
        start = time.perf_counter()
        path = checkpoint_dir(self.run_dir, self.state.step)
        path.mkdir(parents=True, exist_ok=True)
        self._trainer.save_checkpoint(path, extra)
        write_state(path, {"step": self.state.step, "weight_version": self.state.version, "saved_at": time.time()})
        _, failed = prune_checkpoints(self.run_dir, self.config.run.keep_checkpoints)
        if failed:
            self.progress.message(f"could not delete old checkpoint(s) {', '.join(map(str, failed))}: "
                                  f"run.keep_checkpoints is not holding disk use down; delete them by hand")
        return time.perf_counter() - start

    async def router_metrics(self) -> dict[str, float]:
        """What the step added to the router's prefix-cache counters (``router/*``; see
        :mod:`miles.loop.router_metrics`); nothing when the router does not count them."""
        routers = self._services.role_urls(ROUTER)
        return await self._router_counters.fetch(routers[0] if routers else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The step's metrics to ``miles_step_end``, the trackers and the console (NaNs left out)."""
        metrics = {k: v for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}
        self.kernel.step_end(step, metrics)
        self._metrics.log(metrics, step)
        self.progress.step(step, metrics)


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


def jsonable_random_state() -> list[Any]:
    """Python's ``random`` state as JSON data (checkpoints are JSON, never pickles)."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def random_state_from_json(state: list[Any]) -> tuple[Any, ...]:
    return (state[0], tuple(state[1]), state[2])
