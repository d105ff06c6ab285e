"""Rollout workers of ``fully_async`` mode: keep ``rollout.concurrency`` trajectories in flight.

One producer task draws prompt groups (recycled ones first) whenever the buffer has room and a
whole group's worth of sample slots is free; each group runs as its own task: its samples
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
from typing import TYPE_CHECKING

from miles_contracts import Sample

from miles.loop.buffer import Group, GroupBuffer
from miles.rewards import score_samples

if TYPE_CHECKING:
    from miles.loop.rollout import RolloutManager


class RolloutWorkers:
    """``start()`` them, ``stop()`` them (returns the finished groups the trainer never took).

    :param version: the weight version the engines hold now (a group's age when no engine call
        reported one).
    """

    def __init__(self, manager: RolloutManager, buffer: GroupBuffer, *, version: Callable[[], int]) -> None:
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
        self.groups_in_flight = 0  # groups started and not yet handed to the buffer
        self.reward_metrics: Counter[str] = Counter()  # summed since the last take_metrics()
        self.launched = 0  # groups started, recycled ones included
        self.running: dict[int, Group] = {}  # by group index: started, not yet handed to the buffer
        # With a staleness bound, start a group only while fewer than (bound x interval + 1) batches
        # are ahead of the trainer (as AReaL gates admission): a group started now is then taken
        # within `max_staleness` weight updates unless its own generation outlives them.
        self.ahead_limit = None if rollout.max_staleness is None else \
            (rollout.max_staleness * config.weights.update_interval + 1) * rollout.prompts_per_step

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
                await self.buffer.wait_for_room(lambda: self.groups_in_flight, self.ahead_limit)
                for _ in range(self.group_size):  # a group's samples start together
                    await self._slots.acquire()
                group = self.buffer.next_recycled() or self._draw()
                self.manager.record([group.samples], "in_flight")
                group.launched_version = self.version()
                self.in_flight += len(group.samples)
                self.groups_in_flight += 1
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
            try:
                await asyncio.gather(*(self._generate(s) for s in group.samples))
                report = await score_samples(group.samples, self.manager.run)
                self.reward_metrics.update(report.metrics())
                self.manager.record([group.samples], "generated")
            finally:
                self.groups_in_flight -= 1  # from here on the buffer counts it (waiting, queued or set aside)
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
