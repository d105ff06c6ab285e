"""``MathReward``: the ``math`` reward, batched over a shared pool of worker processes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from miles.rewards import Failed, WorkerPool
from miles_contracts import Sample

from miles_rm_math.verify import check_answer, warm_up

if TYPE_CHECKING:
    from miles_contracts import RunContext

_SHARED_POOL: WorkerPool | None = None


def shared_pool() -> WorkerPool:
    """One pool per process for every ``MathReward`` (processes start on first use)."""
    global _SHARED_POOL
    if _SHARED_POOL is None:
        _SHARED_POOL = WorkerPool(initializer=warm_up)
    return _SHARED_POOL


@dataclass(frozen=True)
class MathReward:
    """1.0 / 0.0 per sample by symbolic equivalence with ``sample.label``; NaN without a label,
    for an unparsable label, or when the check did not finish within ``deadline``.

    :ivar deadline: seconds for one batch (``reward.timeout`` once bound); checks still running
        then are abandoned and their worker processes replaced.
    :ivar check_timeout: math-verify's own budget per parse / comparison, in seconds.
    """

    deadline: float = 30.0
    check_timeout: int = 5
    pool: WorkerPool = field(default_factory=shared_pool, repr=False, compare=False)

    def bind(self, ctx: RunContext) -> MathReward:
        """This run's math reward (its deadline is ``reward.timeout``)."""
        return replace(self, deadline=ctx.config.reward.timeout)

    async def __call__(self, samples: Sequence[Sample]) -> list[float]:
        scores = [math.nan] * len(samples)
        labelled = [i for i, sample in enumerate(samples) if sample.label is not None]
        if not labelled:
            return scores
        tasks = [(samples[i].response, samples[i].label, self.check_timeout) for i in labelled]
        for i, outcome in zip(labelled, await self.pool.map(check_answer, tasks, self.deadline), strict=True):
            scores[i] = math.nan if isinstance(outcome, Failed) else float(outcome)
        return scores
