"""``run.mode: fully_async``: the trainer takes batches from a buffer that rollout workers keep full.

::

    workers, all the time:  prompt -> generate (rollout.concurrency in flight) -> reward -> buffer (filters)
    trainer, each step:     batch = buffer.take(prompts_per_step, version)     oldest first; late ones trained or recycled
                            train (in a thread: the event loop keeps generating)
                            every weights.update_interval steps, and after the last: push weights;
                            generation goes on, requests in flight continue under the new weights
                            evaluation: in the background, on the same engines; its metrics join the
                            step during which it finished (``eval/step`` says which step it measured)

The loop drives the run through the public step operations (:class:`~miles.loop.steps.StepOps`),
like every mode. The design and the buffer's contract: ``docs/design/async.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from miles_contracts import Sample

from miles.errors import MilesError
from miles.filtering import apply_filters
from miles.loop.buffer import SET_ASIDE_OUTCOMES, Admit, Group, GroupBuffer
from miles.loop.episodes import training_rows
from miles.loop.interrupts import stop_requested
from miles.loop.producer import RolloutWorkers
from miles.loop.rollout import StepRollout, rollout_metrics

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles.kernel import Kernel
    from miles.loop.progress import Progress
    from miles.loop.steps import RunState, StepOps


async def run(ops: StepOps) -> None:
    """Train ``run.steps`` steps in ``fully_async`` mode."""
    cfg = ops.config
    rollout = cfg.rollout
    state = ops.state
    buffer = GroupBuffer(rollout.buffer_groups or 2 * rollout.prompts_per_step, max_staleness=rollout.max_staleness,
                         late=rollout.late_groups, unused=rollout.unused_groups,
                         admit=filter_pipeline(rollout.filters, ops.kernel), start_version=state.version,
                         ledger=ops.rollouts.ledger)
    workers = RolloutWorkers(ops.rollouts, buffer, version=lambda: state.version, start_step=state.step)
    evaluation = BackgroundEvaluation(ops)
    # what a checkpoint may find in flight: a ledger draw held by none of these is lost
    ops.held_groups = lambda: set(workers.running) | buffer.holding() | ops.rollouts.redraw_groups()
    await ops.wait_engines(router=True)
    workers.start()
    last_take = time.perf_counter()
    completed = False
    try:
        while not ops.finished and not stop_requested():  # a swallowed cancellation still stops
            step = ops.next_step()
            final = ops.finished
            started = time.perf_counter()
            stop = asyncio.Event()
            watcher = asyncio.create_task(_resync_restarted_engines(ops, stop), name="miles-resync")
            try:
                groups = await _take(ops, buffer, workers)
            finally:
                stop.set()
                await watcher
            now = time.perf_counter()
            ops.record_batch(step, [g.samples for g in groups])
            batch = StepRollout([g.samples for g in groups], [s for g in groups for s in g.samples])
            batch.metrics = batch_metrics(groups, buffer, state.version, waited=now - started, interval=now - last_take)
            batch.metrics.update(workers.take_metrics())
            last_take = now
            batch.metrics["time/bookkeeping"] = time.perf_counter() - now  # the ledger and the batch's metrics
            # Beside training, off the event loop (which drives every request and agent in flight):
            # each await on that busy loop costs the trainer a wait of its own (0.04-0.2 s a step on the
            # H200), so nothing the step needs only at its end is awaited before it. Training only reads the samples.
            dumped = asyncio.create_task(asyncio.to_thread(ops.dump, step, batch.all_samples, trained=batch.groups))
            metrics = dict(batch.metrics)
            try:
                metrics.update(await ops.train(batch, in_thread=True))
            finally:
                await asyncio.wait([dumped])  # a failed step's samples are on disk before the run stops
            metrics["time/dump"] = dumped.result()  # its own seconds, not a wait of the step's
            routed = asyncio.create_task(ops.router_metrics())  # beside the push and the checkpoint
            try:
                if final or step % cfg.weights.update_interval == 0:
                    metrics.update(await asyncio.to_thread(ops.sync_weights))
                    await buffer.weights_updated()  # the launch pacing allows the next version's groups
                if final:  # the final evaluation is never skipped; an earlier one would only be overwritten
                    await evaluation.supersede()
                if evaluation.due(step):
                    evaluation.start(step)
                metrics.update(await evaluation.finish() if final else evaluation.collect())
                if ops.checkpoint_due(step):
                    metrics["time/checkpoint"] = await ops.save()
                start = time.perf_counter()
                metrics.update(await routed)
                metrics["time/router_metrics"] = time.perf_counter() - start  # what waiting for it cost the step
            finally:
                routed.cancel()  # a failed step does not wait for the router's counters
            metrics["time/step"] = time.perf_counter() - started  # from asking for the batch to here
            ops.log(step, metrics)
        completed = ops.finished
    finally:
        await evaluation.cancel()
        leftovers = await workers.stop()
        if leftovers:  # finished but never trained on: kept with the run's samples
            ops.dump(state.step, [s for g in leftovers for s in g.samples], kind="unconsumed")
        if completed:
            # what the workers held, drawn but never trained: the run is over (a resume with more
            # steps draws them again: the last checkpoint lists them, and these lines come after it)
            held = {g.index: g for g in (*leftovers, *workers.running.values(), *buffer.recycled_groups())}
            ops.rollouts.record([g.samples for g in held.values()], "dropped", reason="run_completed")


async def _resync_restarted_engines(ops: StepOps, stop: asyncio.Event, every: float = 2.0) -> None:
    """While the trainer waits for a batch (it is idle): an engine the supervisor restarted has
    the base model's weights and the router holds it back until a weight update reaches it. With
    one engine nothing is generated meanwhile, so no batch, and no update would ever come: give
    it the current weights now."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
        if not stop.is_set() and ops.stale_engines:
            await asyncio.to_thread(ops.resync_restarted_engines)


class _Waiting(Protocol):
    """What :func:`_take` reads of the run while it waits (a :class:`StepOps`)."""

    @property
    def config(self) -> MilesConfig: ...

    @property
    def state(self) -> RunState: ...

    @property
    def progress(self) -> Progress: ...


async def _take(run: _Waiting, buffer: GroupBuffer, workers: RolloutWorkers, report_every: float = 60.0,
                aborted_windows: int = 2) -> list[Group]:
    """The next batch; says what the trainer is waiting on when that takes long (filters dropping
    every group would otherwise look like a hang), and stops the run when for ``aborted_windows``
    reports in a row every group that finished was aborted (engines that refuse every request: the
    run would otherwise wait forever on groups that never come)."""
    wanted = run.config.rollout.prompts_per_step
    step = run.state.step
    seen: dict[str, int] = {}  # the buffer's counts at the previous report
    streak = 0  # reports in a row whose window saw only aborted groups finish
    while True:
        try:
            return await asyncio.wait_for(buffer.take(wanted, run.state.version), timeout=report_every)
        except TimeoutError:  # take() put back what it had: nothing is lost by asking again
            pending = dict(buffer.counts)
            window = {k: n - seen.get(k, 0) for k, n in pending.items() if n > seen.get(k, 0)}
            seen = pending
            run.progress.message(
                f"step {step}: waiting for {wanted} groups: {len(buffer)} queued, {workers.in_flight} samples "
                f"in flight, since the last batch {pending or 'nothing finished'}"
            )
            if any(k == "queued" or k.startswith("filtered_") for k in window):
                streak = 0  # a group finished
            elif window or streak:  # only aborts (or nothing new after them: the producer gave up)
                streak += 1
            if streak >= aborted_windows:
                raise MilesError(f"step {step}: for {streak * report_every:.0f} s every group that finished was "
                                 f"aborted ({pending}); the last one: {buffer.last_abort}. Unused groups are kept in "
                                 f"<run>/unconsumed/") from None


def filter_pipeline(names: Sequence[str], kernel: Kernel) -> Admit:
    """``rollout.filters`` as the buffer's admission check (None keeps, else the drop reason)."""

    def admit(group: Sequence[Sample]) -> str | None:
        kept, drops = apply_filters([group], names, kernel)
        return None if kept else next(iter(drops))

    return admit


def batch_metrics(groups: list[Group], buffer: GroupBuffer, version: int, *, waited: float,
                  interval: float) -> dict[str, float]:
    """The step's rollout metrics (over the batch) plus the buffer's: staleness, what was set aside.

    ``time/rollout`` is how long the trainer waited for the batch (0 when it was ready), and
    ``perf/rollout_tokens_per_s`` the batch's tokens over the time since the previous batch.
    """
    counts = buffer.take_counts()
    samples = [s for g in groups for s in g.samples]
    drops = Counter({k.removeprefix("filtered_"): n for k, n in counts.items() if k.startswith("filtered_")})
    finished = counts["queued"] + sum(drops.values()) + counts["aborted_recycled"] + counts["aborted_dropped"]
    metrics = rollout_metrics(samples, [g.samples for g in groups], drops, finished, 0, interval)
    metrics["time/rollout"] = metrics["time/wait_batch"] = waited
    staleness = [g.staleness(version) for g in groups]
    metrics |= {
        "async/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "async/staleness_max": float(max(staleness, default=0)),
        "async/buffer_groups": float(len(buffer)),
        "async/recycled_pending": float(buffer.recycled),
        "async/partial_samples": float(sum(len(set(s.weight_versions)) > 1 for s in samples)),
        "async/retried_groups": float(sum(g.attempt > 1 for g in groups)),
    }
    for outcome in SET_ASIDE_OUTCOMES:
        metrics[f"async/{outcome}"] = float(counts[outcome])
    metrics |= token_lag_metrics(training_rows(g.samples for g in groups), version)  # every branch's tokens
    return metrics


def token_lag_metrics(samples: Sequence[Sample], version: int) -> dict[str, float]:
    """How far behind ``version`` the batch's sampled tokens are (``token_versions``)."""
    lags = [version - v for s in samples if s.trainable and s.token_versions  # empty: the generator kept none
            for v, m in zip(s.token_versions, s.loss_mask, strict=True) if m and v >= 0]
    if not lags:
        return {}
    return {"async/token_lag_mean": sum(lags) / len(lags), "async/token_lag_max": float(max(lags)),
            "async/offpolicy_token_frac": sum(lag > 0 for lag in lags) / len(lags)}


class _Evaluating(Protocol):
    def evaluation_due(self, step: int) -> bool: ...

    def evaluate(self, step: int) -> Coroutine[Any, Any, dict[str, float]]: ...


class BackgroundEvaluation:
    """Evaluations on the training engines without stopping training: one at a time (a due one
    that finds the previous still running is skipped and counted), its metrics logged with the
    step during which it finished. The last step evaluates the final weights and waits for that;
    one still unlogged then is dropped for it (:meth:`supersede`)."""

    def __init__(self, ops: _Evaluating) -> None:
        self.ops = ops
        self.task: asyncio.Task[dict[str, float]] | None = None
        self.step = 0
        self.skipped = 0

    def due(self, step: int) -> bool:
        return self.ops.evaluation_due(step)

    def start(self, step: int) -> None:
        if self.task is not None and not self.task.done():
            self.skipped += 1
            return
        self.task, self.step = asyncio.create_task(self.ops.evaluate(step), name=f"miles-eval-{step}"), step

    def collect(self) -> dict[str, Any]:
        """The metrics of a finished evaluation (once), else nothing. An evaluation that failed fails the run."""
        if self.task is None or not self.task.done():
            return {}
        metrics = {**self.task.result(), "eval/step": float(self.step), "eval/skipped": float(self.skipped)}
        self.task, self.skipped = None, 0
        return metrics

    async def finish(self) -> dict[str, Any]:
        if self.task is not None:
            await asyncio.wait([self.task])
        return self.collect()

    async def supersede(self) -> None:
        """Drop an evaluation not logged yet (still running, or finished since the last step) for
        the final one, counted in ``eval/skipped``: both report the same keys in the last step's
        record, so the earlier one's numbers would be overwritten anyway (its samples, if it
        finished, are in ``samples/``)."""
        if self.task is None:
            return
        if self.task.done() and not self.task.cancelled() and self.task.exception() is not None:
            self.collect()  # raises: an evaluation that failed fails the run
        await self.cancel()
        self.task = None
        self.skipped += 1

    async def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
