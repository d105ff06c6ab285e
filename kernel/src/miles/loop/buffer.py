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
  recycle``, generated again from its prompt (and trained anyway once it used up its
  ``max_attempts``; generations lost to infrastructure aborts do not count).
  Nothing is late before the first weight update (while the version is the one the buffer
  started at), whatever the bound.
- **Aborted groups.** ``recycle``: the group is queued to be generated again from its prompt
  (workers take recycled groups before drawing new prompts). An abort is the infrastructure's
  when every ABORTED sample of the group ended for a reason in :data:`INFRA_ABORTS` (an engine
  or router went away with the request, a weight update paused it); one ABORTED sample with any
  other reason, or none, makes it the prompt's. The two are bounded apart: a group is dropped on
  its ``max_attempts``-th generation that was not lost to an infrastructure abort
  (``attempts_exhausted``), or on the ``max_infra_attempts``-th that was
  (``infra_attempts_exhausted``), whichever comes first; after its second and later
  infrastructure aborts a group backs off before its next generation (:func:`infra_retry_delay`),
  and the producer waits with it rather than draw new prompts into the outage. ``drop``: it is
  dropped. Every outcome
  is counted by reason (:meth:`GroupBuffer.take_counts`).
- **Failure.** A worker that fails calls :meth:`GroupBuffer.fail`; the trainer's ``take`` raises
  that error (waiting or not), so the run stops with it, and :meth:`GroupBuffer.drain` returns
  every finished group not yet taken (queued, or waiting to be), so none is lost.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from miles_contracts import ExitReason, Sample, Status

from miles.loop.ledger import Ledger

UnusedPolicy = Literal["recycle", "drop"]
"""What becomes of a group with an aborted sample (``rollout.unused_groups``)."""
LatePolicy = Literal["train", "recycle"]
"""What becomes of a group over the staleness bound when taken (``rollout.late_groups``)."""
Admit = Callable[[Sequence[Sample]], "str | None"]
"""The filter pipeline as the buffer sees it: None keeps a group, a string is the drop reason."""

MAX_ATTEMPTS = 3
"""Generations a group gets under ``recycle``, those lost to infrastructure aborts not counted
(:data:`MAX_INFRA_ATTEMPTS` bounds them): an aborted group is then dropped (a prompt whose group
keeps aborting costs more than it is worth), a late one trained as it is."""

MAX_INFRA_ATTEMPTS = 10
"""Generations a group may lose to infrastructure aborts (:data:`INFRA_ABORTS`) under ``recycle``
before it is dropped, counted apart from :data:`MAX_ATTEMPTS`. Larger, because such an abort says
nothing about the prompt: a killed or restarted engine, a router failover that gave up, a weight
update's pause abort every request in flight whatever its prompt, and under frequent restarts
three attempts dropped healthy prompts by the hundreds. Still bounded, so that no group cycles
forever on a fleet that never recovers (or on a prompt that only ever meets a broken engine):
the run stops when for two progress reports in a row every group that finished was aborted
(``fully_async``'s wait for a batch raises with the last abort's reason), and a group that
reaches this bound before that is dropped with a reason of its own
(``aborted_infra_attempts_exhausted``)."""

INFRA_RETRY_FIRST_DELAY_S = 0.5
INFRA_RETRY_MAX_DELAY_S = 8.0


def infra_retry_delay(infra_aborts: int) -> float:
    """Seconds a group lost to its ``infra_aborts``-th infrastructure abort waits before it is
    generated again: none after the first (a one-off abort, a weight update's pause), then 0.5 s
    doubling up to 8 s, so its :data:`MAX_INFRA_ATTEMPTS` generations span about 40 s -- longer
    than an engine takes to restart (11-19 s in the chaos soaks), where retrying at once burned
    all ten within the outage and dropped hundreds of healthy samples."""
    if infra_aborts <= 1:
        return 0.0
    return min(INFRA_RETRY_FIRST_DELAY_S * 2.0 ** (infra_aborts - 2), INFRA_RETRY_MAX_DELAY_S)


INFRA_ABORTS = frozenset({ExitReason.ABORT, ExitReason.ENGINE_ERROR})
"""Exit reasons of an ABORTED sample that count as the infrastructure's abort, not its prompt's.
Narrower than :data:`miles.loop.redo.INFRASTRUCTURE_EXITS` on purpose: a reason here buys the
larger bound, so it holds only what the episode does not cause by itself (a timeout, a tool
error, an agent's exception and the budgets can be the prompt's doing)."""


SET_ASIDE_OUTCOMES = ("late_trained", "late_recycled", "aborted_recycled", "aborted_dropped", "attempts_exhausted",
                      "infra_attempts_exhausted")
"""The counts of :meth:`GroupBuffer.take_counts` for groups not trained as they came (``async/<outcome>``
per step in ``fully_async``)."""

@dataclass(eq=False)
class Group:
    """One prompt group on its way through the buffer.

    :ivar samples: the group's samples (generated, then scored).
    :ivar pristine: the samples as drawn from the data source, to generate again from.
    :ivar launched_version: the weight version when its generation started (its age when no
        engine call reported a version).
    :ivar attempt: how many times the group has been generated (1 for the first), those lost to
        infrastructure aborts included.
    :ivar infra_aborts: how many of its generations before this one an infrastructure abort ended.
    :ivar not_before: when (``time.monotonic()``) a recycled group may be generated again (its
        infrastructure backoff, :func:`infra_retry_delay`; 0: at once).
    """

    samples: list[Sample]
    pristine: list[Sample]
    launched_version: int = 0
    attempt: int = 1
    infra_aborts: int = 0
    not_before: float = 0.0

    @classmethod
    def fresh(cls, samples: list[Sample], launched_version: int = 0) -> Group:
        return cls(samples, copy.deepcopy(samples), launched_version)

    @property
    def index(self) -> int:
        return self.samples[0].group_index if self.samples else -1

    @property
    def aborted(self) -> bool:
        return any(s.status is Status.ABORTED for s in self.samples)

    @property
    def infra_aborted(self) -> bool:
        """Aborted by the infrastructure: every ABORTED sample ended for a reason in
        :data:`INFRA_ABORTS`. A group that mixes reasons is the prompt's abort: its own episode
        failed too, and the larger bound would let it fail that way ``MAX_INFRA_ATTEMPTS`` times."""
        aborted = [s for s in self.samples if s.status is Status.ABORTED]
        return bool(aborted) and all(s.exit_reason in INFRA_ABORTS for s in aborted)

    @property
    def prompt_attempts(self) -> int:
        """Its generations counted against ``max_attempts``: all but those lost to infrastructure aborts."""
        return self.attempt - self.infra_aborts

    def oldest_version(self) -> int:
        """The oldest weight version any engine call of the group ran with, in any branch of its
        episodes (a branch's turns may be older than every turn of its episode's primary one)."""
        return min((v for s in self.samples for branch in (s, *s.branches)
                    if (v := branch.oldest_weight_version) is not None), default=self.launched_version)

    def staleness(self, version: int) -> int:
        return max(0, version - self.oldest_version())

    def regenerated(self, *, infra: bool = False) -> Group:
        """The same prompts, as drawn, for another attempt; ``infra``: this one was lost to an
        infrastructure abort. The attempt counters carry over."""
        return Group(copy.deepcopy(self.pristine), self.pristine, self.launched_version, self.attempt + 1,
                     self.infra_aborts + int(infra))


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
    :param max_attempts: generations of a group under ``recycle``, those lost to infrastructure aborts not counted.
    :param max_infra_attempts: generations a group may lose to infrastructure aborts under ``recycle``.
    :param start_version: the weight version when the buffer starts (no group is stale before it moves).
    :param ledger: the run's sample ledger, told what becomes of each group here (None: not recorded).
    :param infra_backoff: seconds a group waits to be generated again after its k-th infrastructure abort.
    :param clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, capacity: int, *, max_staleness: int | None = None, late: LatePolicy = "train",
                 unused: UnusedPolicy = "recycle", admit: Admit | None = None, max_attempts: int = MAX_ATTEMPTS,
                 max_infra_attempts: int = MAX_INFRA_ATTEMPTS, start_version: int = 0,
                 ledger: Ledger | None = None, infra_backoff: Callable[[int], float] = infra_retry_delay,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be at least 1 group, got {capacity}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.late = late
        self.unused = unused
        self.admit = admit
        self.max_attempts = max_attempts
        self.max_infra_attempts = max_infra_attempts
        self.start_version = start_version
        self.ledger = ledger
        self.infra_backoff = infra_backoff
        self.clock = clock
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
            aborted = [s for s in group.samples if s.status is Status.ABORTED]
            # the reason that decided which bound it counts against: a prompt's, when there is one
            decisive = next((s for s in aborted if s.exit_reason not in INFRA_ABORTS), aborted[0])
            self._record(group, "aborted", decisive.exit_reason.value if decisive.exit_reason else "aborted")
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
        """A group to generate again, the oldest whose backoff is over (None when there is none)."""
        now = self.clock()
        for at, group in enumerate(self._recycled):
            if group.not_before <= now:
                del self._recycled[at]
                return group
        return None

    async def wait_recycled(self, poll_s: float = 1.0) -> None:
        """Return once a recycled group may be generated or none is waiting: while every recycled
        group is backing off from repeated infrastructure aborts, the producer waits with them
        instead of drawing new prompts into the same outage. Returns at once on a stopped buffer
        (the next call that needs it raises)."""
        while self._recycled and not self._stopped:
            wait = min(g.not_before for g in self._recycled) - self.clock()
            if wait <= 0:
                return
            await asyncio.sleep(min(wait, poll_s))

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
                    elif self.late == "recycle" and group.prompt_attempts < self.max_attempts:
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
        """Recycle or drop an aborted group, charging this generation to the infrastructure's bound
        or to the prompt's (:attr:`Group.infra_aborted`)."""
        infra = group.infra_aborted
        if infra:
            used, bound, exhausted = group.infra_aborts + 1, self.max_infra_attempts, "infra_attempts_exhausted"
        else:
            used, bound, exhausted = group.prompt_attempts, self.max_attempts, "attempts_exhausted"
        if self.unused == "recycle" and used < bound:
            again = group.regenerated(infra=infra)
            if infra:
                again.not_before = self.clock() + self.infra_backoff(again.infra_aborts)
            self._recycled.append(again)
            outcome = f"{reason}_recycled"
            self._record(group, "recycled", reason)
        else:
            outcome = f"{reason}_dropped"
            if self.unused == "recycle":
                self._counts[exhausted] += 1
            self._record(group, "dropped", f"{reason}_{exhausted}" if self.unused == "recycle" else reason)
        self._counts[outcome] += 1
        return outcome

    def _record(self, group: Group, state: str, reason: str) -> None:
        if self.ledger is not None:
            self.ledger.record(group.samples, state, reason=reason)
