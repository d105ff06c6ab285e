"""The bounded buffer between rollout workers and the trainer in ``fully_async`` mode.

Its contract (``docs/design/async.md``; each point tested in ``kernel/tests/test_async_buffer.py``):

- **Oldest first.** ``take`` hands out the finished groups whose oldest engine call is oldest, and
  among equally old ones the first queued. Within a batch, groups are sorted by group index, so
  the same set of groups always makes the same batch, however their completions interleaved.
- **Back-pressure.** ``put`` waits while the buffer is full, and :meth:`GroupBuffer.wait_for_launch`
  lets a producer hold off drawing new prompts meanwhile; groups being scored count as finished
  (with a slow reward they would otherwise pile up unbounded).
- **Launch pacing.** Given a limit, ``wait_for_launch`` also waits while that many groups are
  reserved (:meth:`GroupBuffer.reserve`: launched and headed for training, until a filter, an
  abort or lateness takes one out). The producer's limit grows with the weight version
  (:class:`miles.loop.producer.LaunchPacing`), which bounds staleness at the source.
- **Admission** (at ``put``). A group with an ABORTED sample goes to the aborted-group policy. A
  group a filter drops is counted under the filter's reason and never recycled: its prompt
  taught nothing (zero variance) or cannot be trained on, and generating it again would not
  change that. The rest are queued.
- **Lateness** (at ``take``): staleness is the current weight version minus the oldest version
  any engine call of the group ran with. A group over ``max_staleness`` is late: it is never
  thrown away for it, but trained (with the run's importance correction) or, with ``late:
  recycle``, generated again from its prompt (and trained anyway once it used up its attempts).
  Nothing is late before the first weight update (while the version is the one the buffer
  started at), whatever the bound.
- **Aborted groups.** ``recycle``: the group is queued to be generated again from its prompt
  (workers take recycled groups before drawing new prompts), at most ``max_attempts``
  generations in all, after which it is dropped. ``drop``: it is dropped. Every outcome is
  counted by reason (:meth:`GroupBuffer.take_counts`).
- **Failure.** A worker that fails calls :meth:`GroupBuffer.fail`; the trainer's ``take`` raises
  that error (waiting or not), so the run stops with it, and :meth:`GroupBuffer.drain` returns
  every finished group not yet taken (queued, or waiting to be), so none is lost.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from miles_contracts import Sample, Status

from miles.loop.ledger import Ledger

UnusedPolicy = Literal["recycle", "drop"]
"""What becomes of a group with an aborted sample (``rollout.unused_groups``)."""
LatePolicy = Literal["train", "recycle"]
"""What becomes of a group over the staleness bound when taken (``rollout.late_groups``)."""
Admit = Callable[[Sequence[Sample]], "str | None"]
"""The filter pipeline as the buffer sees it: None keeps a group, a string is the drop reason."""

MAX_ATTEMPTS = 3
"""Generations a group gets under ``recycle``: an aborted group is then dropped (a prompt whose group
keeps aborting costs more than it is worth), a late one trained as it is."""


@dataclass(eq=False)
class Group:
    """One prompt group on its way through the buffer.

    :ivar samples: the group's samples (generated, then scored).
    :ivar pristine: the samples as drawn from the data source, to generate again from.
    :ivar launched_version: the weight version when its generation started (its age when no
        engine call reported a version).
    :ivar attempt: how many times the group has been generated (1 for the first).
    """

    samples: list[Sample]
    pristine: list[Sample]
    launched_version: int = 0
    attempt: int = 1

    @classmethod
    def fresh(cls, samples: list[Sample], launched_version: int = 0) -> Group:
        return cls(samples, copy.deepcopy(samples), launched_version)

    @property
    def index(self) -> int:
        return self.samples[0].group_index if self.samples else -1

    @property
    def aborted(self) -> bool:
        return any(s.status is Status.ABORTED for s in self.samples)

    def oldest_version(self) -> int:
        """The oldest weight version any engine call of the group ran with, in any branch of its
        episodes (a branch's turns may be older than every turn of its episode's primary one)."""
        return min((v for s in self.samples for branch in (s, *s.branches)
                    if (v := branch.oldest_weight_version) is not None), default=self.launched_version)

    def staleness(self, version: int) -> int:
        return max(0, version - self.oldest_version())

    def regenerated(self) -> Group:
        """The same prompts, as drawn, for another attempt."""
        return Group(copy.deepcopy(self.pristine), self.pristine, self.launched_version, self.attempt + 1)


class BufferClosedError(RuntimeError):
    """``put`` on a buffer whose run has stopped."""


class GroupBuffer:
    """See the module docstring for the contract.

    :param capacity: finished groups that may wait for the trainer (being scored, blocked in
        ``put`` or queued).
    :param max_staleness: versions a group may lag when taken before it is late; None: no bound.
    :param late: what happens to a late group (trained, or generated again).
    :param unused: what happens to an aborted group.
    :param admit: the filter pipeline (None keeps everything).
    :param start_version: the weight version when the buffer starts (no group is stale before it moves).
    :param ledger: the run's sample ledger, told what becomes of each group here (None: not recorded).
    """

    def __init__(self, capacity: int, *, max_staleness: int | None = None, late: LatePolicy = "train",
                 unused: UnusedPolicy = "recycle", admit: Admit | None = None, max_attempts: int = MAX_ATTEMPTS,
                 start_version: int = 0, ledger: Ledger | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be at least 1 group, got {capacity}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.late = late
        self.unused = unused
        self.admit = admit
        self.max_attempts = max_attempts
        self.start_version = start_version
        self.ledger = ledger
        self._queue: deque[Group] = deque()
        self._waiting: list[Group] = []  # finished groups blocked in put
        self._recycled: deque[Group] = deque()
        self._counts: Counter[str] = Counter()
        self._changed = asyncio.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self.reserved = 0  # groups launched and headed for training (see reserve())
        self.last_abort: str | None = None  # why the last aborted group's first sample ended

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def recycled(self) -> int:
        return len(self._recycled)

    # ------------------------------------------------------------------ producer side

    async def wait_for_launch(self, scoring: Callable[[], int] = lambda: 0,
                              limit: Callable[[], int | None] = lambda: None) -> None:
        """Return once a finished group could be queued without waiting -- counting the ``scoring()``
        groups that finished generating and are being scored -- and, when ``limit()`` gives one,
        fewer groups than that are reserved. The caller reserves its group (:meth:`reserve`)
        before it next awaits."""
        def room() -> bool:
            finished = len(self._queue) + len(self._waiting) + scoring()
            cap = limit()
            return finished < self.capacity and (cap is None or self.reserved < cap)

        async with self._changed:
            await self._changed.wait_for(lambda: self._stopped or room())
            self._raise_if_stopped()

    def reserve(self) -> None:
        """A group was launched: it holds a place in the batches to come until it is trained, or
        a filter, an abort or lateness (``late: recycle``) takes it out (its regeneration, if
        any, reserves again when launched)."""
        self.reserved += 1

    async def weights_updated(self) -> None:
        """The engines serve a new version: a producer's launch limit may have grown."""
        async with self._changed:
            self._changed.notify_all()

    async def put(self, group: Group) -> str:
        """Admit ``group``; returns what became of it: ``queued``, ``filtered_<reason>``,
        ``aborted_recycled`` or ``aborted_dropped``. Waits while the buffer is full."""
        if group.aborted:
            first = group.samples[0] if group.samples else None
            if first is not None:
                self.last_abort = f"{first.status.value}: {first.exit_detail or first.exit_reason}"[:300]
            self.reserved -= 1
            aborted = next(s for s in group.samples if s.status is Status.ABORTED)
            self._record(group, "aborted", aborted.exit_reason.value if aborted.exit_reason else "aborted")
            return await self._settled(self._set_aside(group, "aborted"))
        reason = self.admit(group.samples) if self.admit is not None else None
        if reason is not None:
            self.reserved -= 1
            self._counts[f"filtered_{reason}"] += 1
            self._record(group, "filtered", reason)
            return await self._settled(f"filtered_{reason}")
        # among the waiting before the first await: the producer stopped counting it as being scored
        self._waiting.append(group)
        async with self._changed:
            await self._changed.wait_for(lambda: self._stopped or len(self._queue) < self.capacity)
            self._raise_if_stopped()  # the group stays among the waiting: drain() returns it
            self._waiting.remove(group)
            self._queue.append(group)
            self._counts["queued"] += 1
            self._changed.notify_all()
        return "queued"

    async def _settled(self, outcome: str) -> str:
        async with self._changed:  # a group is no longer in flight: a producer may start another
            self._changed.notify_all()
        return outcome

    def holding(self) -> set[int]:
        """The indices of the groups in the buffer: queued, waiting for room, waiting to be recycled."""
        return {g.index for g in (*self._queue, *self._waiting, *self._recycled)}

    def recycled_groups(self) -> list[Group]:
        """The groups waiting to be generated again, oldest first."""
        return list(self._recycled)

    def next_recycled(self) -> Group | None:
        """A group to generate again, oldest first (None when there is none)."""
        return self._recycled.popleft() if self._recycled else None

    async def fail(self, error: BaseException) -> None:
        """A worker failed: the next (or waiting) ``take`` raises ``error``."""
        async with self._changed:
            if self._error is None:
                self._error = error
            self._changed.notify_all()

    # ------------------------------------------------------------------ trainer side

    async def take(self, count: int, version: int) -> list[Group]:
        """Wait for ``count`` groups to train at weight ``version``: the oldest finished first, then
        sorted by group index. Late groups go to the late-group policy (trained or recycled)."""
        batch: list[Group] = []
        async with self._changed:
            try:
                while len(batch) < count:
                    await self._changed.wait_for(lambda: self._stopped or bool(self._queue))
                    self._raise_if_stopped()
                    group = self._pop_oldest()
                    self._changed.notify_all()  # room for a waiting producer
                    if not self.is_late(group, version):
                        batch.append(group)
                    elif self.late == "recycle" and group.attempt < self.max_attempts:
                        self.reserved -= 1
                        self._recycled.append(group.regenerated())
                        self._counts["late_recycled"] += 1
                        self._record(group, "recycled", "late")
                    else:  # never thrown away for lateness: the correction weighs its old tokens
                        self._counts["late_trained"] += 1
                        batch.append(group)
            except BaseException:  # failed or cancelled: the groups were not taken after all, drain() keeps them
                self._queue.extendleft(reversed(batch))
                raise
        return sorted(batch, key=lambda g: g.index)

    def is_late(self, group: Group, version: int) -> bool:
        if self.max_staleness is None or version == self.start_version:
            return False
        return group.staleness(version) > self.max_staleness

    @property
    def counts(self) -> Counter[str]:
        """What happened to groups since the last :meth:`take_counts` (a view: do not modify)."""
        return self._counts

    def take_counts(self) -> Counter[str]:
        """What happened to groups since the last call, by outcome (and reset)."""
        counts, self._counts = self._counts, Counter()
        return counts

    def drain(self) -> list[Group]:
        """Stop: every finished group not taken (queued, then those waiting to be), in order."""
        self._closed = True
        left = [*self._queue, *self._waiting]
        self._queue.clear()
        return left

    # ------------------------------------------------------------------ internals

    @property
    def _stopped(self) -> bool:
        return self._error is not None or self._closed

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise BufferClosedError("the buffer was drained: the run is stopping")

    def _pop_oldest(self) -> Group:
        """The queued group whose oldest engine call is oldest (the first queued among equals)."""
        at = min(range(len(self._queue)), key=lambda i: self._queue[i].oldest_version())
        group = self._queue[at]
        del self._queue[at]
        return group

    def _set_aside(self, group: Group, reason: str) -> str:
        if self.unused == "recycle" and group.attempt < self.max_attempts:
            self._recycled.append(group.regenerated())
            outcome = f"{reason}_recycled"
            self._record(group, "recycled", reason)
        else:
            outcome = f"{reason}_dropped"
            if self.unused == "recycle":
                self._counts["attempts_exhausted"] += 1
            self._record(group, "dropped", f"{reason}_attempts_exhausted" if self.unused == "recycle" else reason)
        self._counts[outcome] += 1
        return outcome

    def _record(self, group: Group, state: str, reason: str) -> None:
        if self.ledger is not None:
            self.ledger.record(group.samples, state, reason=reason)
