"""``run.mode: one_step_off``: generate step k+1 while training on step k.

::

    step k:   await rollout k (started during step k-1)    push the weights of update k-1
              start rollout k+1 (weights of update k-1)    train on rollout k (off the event loop)
              evaluate / checkpoint / log

The next rollout samples with weights one update old (samples record their version), and the
update of step k is pushed only once rollout k+1 is done: an engine is never updated under a
rollout. The last step has no next rollout and pushes at once. A checkpoint due at step k takes
the driver's state before rollout k+1 draws its prompts, so a resume draws them again.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from miles.loop.interrupts import stop_requested

if TYPE_CHECKING:
    from miles.loop.rollout import StepRollout
    from miles.loop.steps import StepOps


class _Deferred:
    """The update trained but not pushed yet (it waits for the rollout running beside it)."""

    def __init__(self, ops: StepOps) -> None:
        self.ops = ops
        self.waiting = False

    def push(self) -> dict[str, float]:
        """Push it now if one waits (the trainer is idle); its metrics."""
        if not self.waiting:
            return {}
        self.waiting = False
        return self.ops.sync_weights()


async def run(ops: StepOps) -> None:
    deferred = _Deferred(ops)
    pending: asyncio.Task[StepRollout] | None = None
    while not ops.finished and not stop_requested():
        step = ops.next_step()
        rollout = await ops.rollout_step(step, pending, before_retry=deferred.push)
        pending = None
        ops.record_batch(step, rollout.groups)  # before the checkpoint's state is taken
        metrics = dict(rollout.metrics)
        metrics.update(deferred.push())  # the previous update waited for this rollout to finish
        saved_state: dict[str, Any] | None = None
        if not ops.finished:
            if ops.checkpoint_due(step):  # before the next rollout draws its prompts: a resume draws them again
                saved_state = ops.checkpoint_state()
            # the trainer will be training meanwhile: this rollout cannot push weights to a restarted engine
            pending = asyncio.create_task(ops.collect(step + 1, resync=False))
        # the dump goes beside training, off the event loop: on it, it held back the next rollout's start
        dumped = asyncio.create_task(asyncio.to_thread(ops.dump, step, rollout.all_samples, trained=rollout.groups))
        metrics.update(await ops.train(rollout, in_thread=True))
        metrics["time/dump"] = await dumped
        if pending is not None:
            deferred.waiting = True
        else:
            metrics.update(ops.sync_weights())
        if ops.evaluation_due(step):
            if pending is not None:  # let the next rollout finish: evaluation shares the engines
                await asyncio.wait([pending])
            metrics.update(await ops.evaluate(step))
        if ops.checkpoint_due(step):
            metrics["time/checkpoint"] = await ops.save(saved_state)
        metrics.update(await ops.router_metrics())
        ops.log(step, metrics)
