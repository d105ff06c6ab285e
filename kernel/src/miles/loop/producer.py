"""Rollout workers of ``fully_async`` mode: keep ``rollout.concurrency`` trajectories in flight.

One producer task draws prompt groups (recycled ones first) whenever a whole group's worth of
sample slots is free, the buffer has room (groups being scored included) and the launch pacing
(:class:`LaunchPacing`) allows one more at the current weight version; each group runs as its own task: its samples
generate concurrently (each frees its slot the moment it finishes, so a long-tail sample holds
one slot, not a group's), then the group is scored and put into the :class:`GroupBuffer`, which
applies the filters. Any exception in a worker goes to the buffer, whose ``take`` raises it in
the driver: a bug stops the run instead of starving it.

Generation goes on while the trainer trains and while weights are pushed; a generation that a
weight update aborts continues under the new weights when ``rollout.partial_rollout`` is on
(``GenerateContext.partial_rollout``, see :mod:`miles.rollout.continuation`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles_contracts import Sample

from miles.loop.buffer import Group, GroupBuffer
from miles.rewards import score_samples

if TYPE_CHECKING:
    from miles.loop.rollout import RolloutManager


@dataclass(frozen=True)
class LaunchPacing:
    """How many groups may be reserved (launched and headed for training) while the engines
    serve a given weight version, so that a group launched now is trained within
    ``max_staleness`` updates unless its own generation outlives them (AReaL's admission rule,
    counted in batches of this run).

    Batch ``j`` of this run (0 for the first) is step ``start_step + j + 1``, taken after the
    pushes of the steps before it (one after every step divisible by ``interval``), so at version
    ``start_version + (start_step + j) // interval - start_step // interval``. At version ``v``
    the groups reserved may fill every batch taken at ``v + max_staleness`` or before; never more
    than the steps left need (a group launched past the last batch would never be trained).

    :ivar batch: groups per step (``rollout.prompts_per_step``).
    :ivar interval: steps between weight pushes (``weights.update_interval``).
    :ivar max_staleness: ``rollout.max_staleness``; None: only the steps left limit launches.
    :ivar start_step: steps done when the workers started (a resumed run's included).
    :ivar start_version: the weight version then.
    :ivar steps: ``run.steps``.
    """

    batch: int
    interval: int
    max_staleness: int | None
    start_step: int
    start_version: int
    steps: int

    def limit(self, version: int) -> int:
        left = max(0, self.steps - self.start_step)
        if self.max_staleness is None:
            return left * self.batch
        pushes = version + self.max_staleness - self.start_version + self.start_step // self.interval
        batches = (pushes + 1) * self.interval - self.start_step
        return min(left, max(0, batches)) * self.batch


class RolloutWorkers:
    """``start()`` them, ``stop()`` them (returns the finished groups the trainer never took).

    :param version: the weight version the engines hold now (a group's age when no engine call
        reported one, and what the launch pacing reads).
    :param start_step: steps done when the workers start (for the launch pacing).
    """

    def __init__(self, manager: RolloutManager, buffer: GroupBuffer, *, version: Callable[[], int],
                 start_step: int = 0) -> None:
        config = manager.config
        rollout = config.rollout
        self.manager = manager
        self.buffer = buffer
        self.version = version
        self.group_size = rollout.samples_per_prompt
        self.ctx = manager.context()
        self._slots = asyncio.Semaphore(rollout.concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._main: asyncio.Task[None] | None = None
        self.in_flight = 0  # samples being generated
        self.scoring = 0  # groups generated and being scored: finished, for the buffer's capacity
        self.reward_metrics: Counter[str] = Counter()  # summed since the last take_metrics()
        self.launched = 0  # groups started, recycled ones included
        self.pacing = LaunchPacing(rollout.prompts_per_step, config.weights.update_interval, rollout.max_staleness,
                                   start_step, buffer.start_version, config.run.steps)
        self.running: dict[int, Group] = {}  # by group index: started, not yet handed to the buffer

    def start(self) -> None:
        self._main = asyncio.create_task(self._produce(), name="miles-rollout-producer")

    async def stop(self) -> list[Group]:
        """Cancel every worker; returns the finished groups not taken, in buffer order."""
        leftovers = self.buffer.drain()
        tasks = [t for t in (self._main, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return leftovers

    def take_metrics(self) -> dict[str, float]:
        metrics = {**self.reward_metrics, "async/in_flight_samples": float(self.in_flight),
                   "async/groups_launched": float(self.launched)}
        self.reward_metrics.clear()
        return metrics

    # ------------------------------------------------------------------ workers

    async def _produce(self) -> None:
        try:
            while True:
                for _ in range(self.group_size):  # a group's samples start together
                    await self._slots.acquire()
                await self.buffer.wait_recycled()  # an infrastructure backoff holds new draws too
                await self.buffer.wait_for_launch(lambda: self.scoring, lambda: self.pacing.limit(self.version()))
                self.buffer.reserve()  # before the next await: the limit holds
                group = self.buffer.next_recycled() or self._draw()
                self.manager.record([group.samples], "in_flight")
                group.launched_version = self.version()
                self.in_flight += len(group.samples)
                self.launched += 1
                self.running[group.index] = group
                task = asyncio.create_task(self._run(group), name=f"miles-rollout-group-{group.index}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the data source, the buffer: the run cannot go on without them
            await self.buffer.fail(exc)

    def _draw(self) -> Group:
        [samples] = self.manager.draw_groups(1)
        return Group.fresh(samples)

    async def _run(self, group: Group) -> None:
        try:
            await asyncio.gather(*(self._generate(s) for s in group.samples))
            self.scoring += 1
            try:
                report = await score_samples(group.samples, self.manager.run)
                self.reward_metrics.update(report.metrics())
                self.manager.record([group.samples], "generated")
            finally:
                self.scoring -= 1  # put() counts it among the waiting before it first awaits
            await self.buffer.put(group)
            del self.running[group.index]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # rewards, filters: a plugin bug stops the run (it would recur)
            await self.buffer.fail(exc)

    async def _generate(self, sample: Sample) -> None:
        try:
            await self.manager.generate_one(sample, self.ctx)
        finally:
            self.in_flight -= 1
            self._slots.release()
